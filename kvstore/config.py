"""One frozen configuration object; :meth:`Config.from_env` is the only reader of
the environment in kvstore. The variables, their fields and their defaults are
defined once, in :mod:`tracker.control.env` (the contract shared with the
launchers): :class:`Config` is its :class:`~tracker.control.env.Settings` plus
two knobs that no variable sets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, cast

from tracker.control import env as _env
from tracker.control.security import Security

from .errors import ConfigError
from .transport import registry


@dataclass(frozen=True, repr=False)   # Settings' repr: it never prints the secret
class Config(_env.Settings):
    """Every field of :class:`tracker.control.env.Settings` (one per variable:
    ``KVSTORE_CHUNK_BYTES`` -> ``chunk_bytes``, defaults from the table), plus
    ``write_in_bytes`` and ``exit_on_abort``, which no variable sets."""
    # not from the environment: writing in costs a second round trip per message (write,
    # grant; written, reply) and saves a staging copy plus the server's pass over the
    # data, so it is used from about a megabyte per message (a 64 KiB key took 0.86 ms
    # by pushpull, 1.6 ms written in); tests lower it
    write_in_bytes: int = 1 << 20
    exit_on_abort: bool = True   # not from the environment: in-process tests turn it off

    def __post_init__(self):
        # tracker checks only KVSTORE_TRANSPORT's syntax: the names are kvstore's registry's
        registry.check(self.transport)

    def security(self) -> Security:
        """How this process's sockets authenticate (see tracker.control.security)."""
        try:
            return Security(self.secret, self.secure)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "Config":
        """Build a Config from ``environ`` (pass ``os.environ``). Raises ConfigError."""
        try:
            settings = _env.read(environ)
        except _env.EnvError as e:
            raise ConfigError(str(e)) from None
        return cls(**cast(dict[str, Any], _env.fields(settings)))

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def require_cluster(self, what: str) -> None:
        """Raise ConfigError unless the variables that locate the job are set."""
        missing = [name for name, value in (
            ("KVSTORE_SCHEDULER_HOST (or DMLC_PS_ROOT_URI)", self.scheduler_host),
            ("KVSTORE_SCHEDULER_PORT (or DMLC_PS_ROOT_PORT)", self.scheduler_port),
            ("KVSTORE_NUM_WORKERS (or DMLC_NUM_WORKER)", self.num_workers),
            ("KVSTORE_NUM_SERVERS (or DMLC_NUM_SERVER)", self.num_servers)) if value is None]
        if missing:
            raise ConfigError(
                f"{what} needs a running job, but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set. Start the script with a "
                "launcher, e.g. `python -m tracker.local -n 2 -s 2 python script.py`")
