"""Parameter server: :class:`ServerState` (pure logic) and :class:`ServerNode` (I/O)."""

from .state import ServerState, Reply
from .node import ServerNode


def run(config) -> int:
    """Run one server process until the job ends; returns its exit status."""
    return ServerNode(config).run()


__all__ = ["ServerState", "Reply", "ServerNode", "run"]
