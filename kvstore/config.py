"""One frozen configuration object; :meth:`Config.from_env` is the only reader of
the environment in kvstore (the variables themselves are defined in
:mod:`tracker.control.env`, the contract shared with the launchers)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from tracker.control import env as _env
from tracker.control.security import Security

from .errors import ConfigError


@dataclass(frozen=True)
class Config:
    role: str | None = None
    scheduler_host: str | None = None
    scheduler_port: int | None = None
    num_workers: int | None = None
    num_servers: int | None = None
    rank: int | None = None
    node_host: str = "127.0.0.1"
    timeout: float = 300.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    abort_grace: float = 5.0
    chunk_bytes: int = 2 << 20
    zero_copy_bytes: int = 64 << 10
    max_message_bytes: int = 1 << 30
    transport: str = "auto"
    host_label: str = ""
    pipeline_bytes: int = 8 << 20
    shm_pipeline_bytes: int = 32 << 20
    write_in: bool = True
    # not from the environment: writing in costs a second round trip per message (write,
    # grant; written, reply) and saves a staging copy plus the server's pass over the
    # data, so it is used from about a megabyte per message (a 64 KiB key took 0.86 ms
    # by pushpull, 1.6 ms written in); tests lower it
    write_in_bytes: int = 1 << 20
    data_channel: bool = True
    channel_bytes: int = 1 << 20
    malloc_tuning: bool = True
    secret: str | None = None
    secure: bool = False
    checkpoint_dir: str | None = None
    checkpoint_interval: float = 0.0
    resume: bool = False
    stall_warning: float = 60.0
    server_device: str = "cpu"
    server_gpus: tuple | None = None
    log_level: str = "INFO"
    exit_on_abort: bool = True   # not from the environment: in-process tests turn it off

    def __repr__(self) -> str:  # never print the secret
        fields = ", ".join(f"{f.name}={'***' if f.name == 'secret' and self.secret else getattr(self, f.name)!r}"
                           for f in dataclasses.fields(self))
        return f"Config({fields})"

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
            values = _env.read(environ)
        except _env.EnvError as e:
            raise ConfigError(str(e)) from None
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for name, value in values.items():
            field = name.removeprefix("KVSTORE_").lower()
            if field in fields:
                kwargs[field] = value
        return cls(**kwargs)

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
                "launcher, e.g. `python -m tracker.local -n 2 -s 1 python script.py`")
