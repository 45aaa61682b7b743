"""The exceptions kvstore raises.

Every error a user can see derives from :class:`KVStoreError`. Argument errors
also derive from the built-in ``TypeError``/``ValueError`` so that code written
against MXNet or PyTorch conventions keeps catching them.
"""

from __future__ import annotations

import builtins


class KVStoreError(Exception):
    """Base class of every kvstore error."""


class ConfigError(KVStoreError, ValueError):
    """A setting, environment variable, store type or optimizer name is invalid."""


class InvalidArgumentError(KVStoreError, ValueError):
    """A call got a bad value: unknown key, wrong shape or dtype, key initialised twice."""


class ArgumentTypeError(KVStoreError, TypeError):
    """A call got an argument of the wrong type (e.g. a float as a key)."""


class ProtocolError(KVStoreError):
    """A message on the wire is malformed, truncated, oversized or of another version."""

    request_id: int | None = None     # the request's id, where its header had a usable one


class RemoteError(KVStoreError):
    """A server rejected a request; ``node`` names it, ``kind`` is its error class."""

    def __init__(self, node: str, kind: str, message: str):
        super().__init__(f"{node} rejected the request: {kind}: {message}")
        self.node = node
        self.kind = kind
        self.remote_message = message


class DeadlineError(KVStoreError, builtins.TimeoutError):
    """A blocking call did not complete in time. The message names what it waited
    for and the setting that raises the limit."""


class NodeFailedError(KVStoreError):
    """Another process of the job died or the job was aborted; the message names it."""


class CheckpointError(KVStoreError):
    """A checkpoint cannot be written, or a resume cannot find a complete, intact
    set of server checkpoints; the message names the server and the file."""
