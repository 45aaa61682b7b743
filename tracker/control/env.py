"""THE contract of environment variables between launchers and processes.

Launchers (``tracker.local`` and friends) set these for every process they start;
:func:`read` parses them into one frozen :class:`Settings` object, which
``kvstore.config.Config`` extends. MXNet's ``DMLC_*`` names are accepted as
aliases so that processes started by another launcher also work. Every default
lives here, in :data:`VARIABLES`, and nowhere else: code that needs one reads it
with :func:`default` (``tests/project/test_settings.py`` checks this, and that
docs/configuration.md shows :func:`markdown_table` as it is).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import sys
from dataclasses import dataclass
from types import UnionType
from typing import TYPE_CHECKING, Any, Callable, Mapping

SERVER_DEVICES = ("cpu", "gpu")
# KVSTORE_CHUNK_BYTES's default with GPU servers: on an H100 a server's sum and fused
# update of 64 MB per round reached 0.73-0.87x of a device copy's bandwidth in 64 MB
# chunks, 0.07-0.20x in 2 MB ones (launch-bound: benchmarks/results/gpu/gpu_check.md)
GPU_SERVER_CHUNK_BYTES = 64 << 20
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Var:
    name: str
    aliases: tuple[str, ...]
    default: object
    parse: _Parser | type   # raises ValueError; a :class:`_Parser`, or a type that parses (str)
    help: str

    @property
    def type(self) -> object:
        """The type of its :class:`Settings` field (``| None`` when it has no default)."""
        kind = self.parse.type if isinstance(self.parse, _Parser) else self.parse
        return kind if self.default is not None else kind | None

    @property
    def field(self) -> str:
        """Its :class:`Settings` field: ``KVSTORE_CHUNK_BYTES`` -> ``chunk_bytes``."""
        return self.name.removeprefix("KVSTORE_").lower()


class _Parser:
    """A variable's parser: called with its text, it returns the value (or raises
    ValueError); ``type`` is the type of that value (:attr:`Var.type`)."""

    def __init__(self, parse: Callable[[str], object], kind: type | UnionType) -> None:
        self._parse = parse
        self.type = kind

    def __call__(self, text: str) -> object:
        return self._parse(text)


class _Choice(_Parser):
    """A parser of one of ``choices`` (case-insensitive)."""

    def __init__(self, *choices: str) -> None:
        super().__init__(self._one_of, str)
        self.choices = choices

    def _one_of(self, text: str) -> str:
        value = text.strip().lower()
        if value not in self.choices:
            raise ValueError(f"must be one of {', '.join(self.choices)}")
        return value


def _returns(kind: type | UnionType) -> Callable[[Callable[[str], object]], _Parser]:
    """Decorates a parser function with the type of what it returns."""
    return lambda parse: _Parser(parse, kind)


def _number(kind: type[int] | type[float], minimum: float, inclusive: bool = True) -> _Parser:
    """A parser of ``kind`` values >= ``minimum`` (> when not ``inclusive``)."""
    def parse(text: str) -> int | float:
        value = kind(text)
        if not (value >= minimum if inclusive else value > minimum):  # NaN fails too
            raise ValueError(f"must be {'>=' if inclusive else '>'} {minimum}")
        return value
    return _Parser(parse, kind)


@_returns(str)
def _name(text: str) -> str:
    """A lower-cased name (letters, digits, _): the syntax of a value whose valid
    values a registry above this layer holds (KVSTORE_TRANSPORT: kvstore's
    transports, checked by kvstore.Config)."""
    value = text.strip().lower()
    if not re.fullmatch(r"[a-z][a-z0-9_]*", value):
        raise ValueError("must be a name (letters, digits, _)")
    return value


@_returns(int)
def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise ValueError("must be a TCP port 1..65535")
    return value


@_returns(tuple)
def _gpu_list(text: str) -> tuple[int, ...]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or not all(item.isdigit() for item in items):
        raise ValueError("must be a comma-separated list of GPU ordinals, e.g. 0,1")
    return tuple(int(item) for item in items)


@_returns(bool)
def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be 0/1, true/false, yes/no or on/off")


@_returns(tuple)
def _elastic(text: str) -> tuple[int, int]:
    low, sep, high = text.strip().partition(":")
    if not (sep and low.isascii() and low.isdigit() and high.isascii() and high.isdigit()):
        raise ValueError("must be MIN:MAX, two integers, e.g. 2:4")
    if not 1 <= int(low) <= int(high):
        raise ValueError("must have 1 <= MIN <= MAX")
    return int(low), int(high)


@_returns(int)
def _replicas(text: str) -> int:
    value = text.strip()
    if value not in ("0", "1"):
        raise ValueError("must be 0 (no replica) or 1 (one backup per server's share)")
    return int(value)


@_returns(int | str)      # bytes, or "auto"
def _pipeline(text: str) -> int | str:
    value = text.strip().lower()
    if value == "auto":
        return value
    if not (value.isascii() and value.isdigit()):
        raise ValueError("must be auto or an integer >= 0 (bytes)")
    return int(value)


@_returns(int | float)    # an int, or math.inf
def _staleness(text: str) -> int | float:
    value = text.strip().lower()
    if value in ("inf", "infinity"):
        return math.inf
    if not (value.isascii() and value.isdigit()):     # also refuses "-1" and "1.5"
        raise ValueError("must be an integer >= 0, or inf")
    return int(value)


_POSITIVE_FLOAT = _number(float, 0, inclusive=False)
_NON_NEGATIVE_FLOAT = _number(float, 0)
_POSITIVE_INT = _number(int, 1)
_NON_NEGATIVE_INT = _number(int, 0)

VARIABLES: tuple[Var, ...] = (
    Var("KVSTORE_ROLE", ("DMLC_ROLE",), None, _Choice("worker", "server", "scheduler"),
        "Role of this process: worker, server or scheduler."),
    Var("KVSTORE_SCHEDULER_HOST", ("DMLC_PS_ROOT_URI",), None, str,
        "Address of the scheduler (rendezvous) that every process connects to."),
    Var("KVSTORE_SCHEDULER_PORT", ("DMLC_PS_ROOT_PORT",), None, _port,
        "TCP port of the scheduler."),
    Var("KVSTORE_NUM_WORKERS", ("DMLC_NUM_WORKER",), None, _POSITIVE_INT,
        "Number of worker processes in the job."),
    Var("KVSTORE_NUM_SERVERS", ("DMLC_NUM_SERVER",), None, _POSITIVE_INT,
        "Number of server processes in the job."),
    Var("KVSTORE_RANK", (), None, _NON_NEGATIVE_INT,
        "Rank of this process within its role, in launch order. Set by our launchers; "
        "when no process of the job sets it, ranks follow registration order (as MXNet)."),
    Var("KVSTORE_NODE_HOST", ("DMLC_NODE_HOST",), "127.0.0.1", str,
        "Address this process binds and advertises to its peers."),
    Var("KVSTORE_TIMEOUT", (), 300.0, _POSITIVE_FLOAT,
        "Seconds any blocking call (registration, init, push/pull reply, barrier) "
        "may wait before failing with an error that names what it waited for."),
    Var("KVSTORE_HEARTBEAT_INTERVAL", (), 1.0, _POSITIVE_FLOAT,
        "Seconds between heartbeats from each process to the scheduler."),
    Var("KVSTORE_HEARTBEAT_TIMEOUT", (), 10.0, _POSITIVE_FLOAT,
        "Seconds without a heartbeat after which a process is declared dead and the "
        "whole job is aborted with an error naming it. Also how long a server waits for its "
        "checkpoint directory's lock (held by another live job's server) before it fails."),
    Var("KVSTORE_SCHEDULER_RESTART_TIMEOUT", (), 10.0, _NON_NEGATIVE_FLOAT,
        "Seconds a process that lost contact with the scheduler for KVSTORE_HEARTBEAT_TIMEOUT "
        "keeps trying, for its launcher to restart the scheduler (tracker.local, tracker.ssh; a "
        "hand-started scheduler is not waited for), "
        "before it stops with \"lost contact with the scheduler\"; a restarted scheduler waits "
        "as long (plus the heartbeat timeout) for every member to register again. 0: stop at the "
        "heartbeat timeout (and the launcher does not kill a scheduler that hangs: nothing would wait "
        "for its restart)."),
    Var("KVSTORE_ABORT_GRACE", (), 5.0, _POSITIVE_FLOAT,
        "Seconds a worker whose job was aborted may keep running (to raise the error "
        "from its next kvstore call) before it exits by itself with status 70."),
    Var("KVSTORE_CHUNK_BYTES", (), 2 << 20, _POSITIVE_INT,
        "Arrays larger than this are split into near-equal chunks of at most this size, "
        "spread over the servers. Must be equal on every worker (checked when the store "
        "is created). Unset with KVSTORE_SERVER_DEVICE=gpu: 67108864 (64 MiB), where a GPU "
        "server's sum and update are not launch-bound (docs/gpu.md)."),
    Var("KVSTORE_ZERO_COPY_BYTES", (), 64 << 10, _NON_NEGATIVE_INT,
        "Buffers at least this large are sent without copying."),
    Var("KVSTORE_MAX_MESSAGE_BYTES", (), 1 << 30, _POSITIVE_INT,
        "Largest frame a server or client accepts. ZeroMQ drops the connection of a peer "
        "that sends a bigger one (no reply); keep it above KVSTORE_CHUNK_BYTES."),
    Var("KVSTORE_TRANSPORT", (), "auto", _name,
        "How workers reach servers on their own host: auto (GPU values by CUDA IPC with GPU "
        "servers, cuda_ipc; other array data through shared memory, control on tcp; tcp to "
        "other hosts), cuda_ipc (the same), shm (shared memory only), ipc (ZeroMQ ipc), or tcp "
        "(always): auto or a name in kvstore's transport registry "
        "(kvstore/transport/registry.py), whose order is the fall-back order. Set it for the "
        "whole job (servers then skip what is not needed)."),
    Var("KVSTORE_HOST_LABEL", (), "", str,
        "Emulates several machines on one: processes whose labels differ treat each other "
        "as on different hosts (tcp between them, shared memory only within a label). Set "
        "per process by `tracker.local --emulate-hosts K`; empty on real clusters."),
    Var("KVSTORE_HOST_REDUCE", (), False, _bool,
        "1: in dist_sync, the workers of one host hand their pushpull gradients to the lowest "
        "rank among them, which sums them and pushes the host's sum once for all (as BytePS "
        "does): the host's link carries one gradient instead of one per worker. Workers "
        "with it off, or alone on their host, push directly. Not in elastic jobs. Read by workers."),
    Var("KVSTORE_PIPELINE_BYTES", (), "auto", _pipeline,
        "A worker cuts each server's share of a push/pull/pushpull into messages of about this "
        "many bytes, interleaved across servers, so that transfer, sum and reply overlap "
        "(0: one message per server and call). auto: 10 ms of the rate its calls have "
        "reached, 256 KiB to 8 MiB (kvstore/transport/pace.py)."),
    Var("KVSTORE_SHM_PIPELINE_BYTES", (), 32 << 20, _NON_NEGATIVE_INT,
        "The same as KVSTORE_PIPELINE_BYTES for servers reached through shared memory, where "
        "no link transfer needs overlapping and fewer, larger messages are cheaper."),
    Var("KVSTORE_WRITE_IN", (), True, _bool,
        "1: in dist_sync pushpull, a worker writes large gradients straight into the sums of "
        "servers it reaches through shared memory (granted by the server), instead of staging "
        "them for the server to add. 0: stage and push. Read by workers."),
    Var("KVSTORE_DATA_CHANNEL", (), True, _bool,
        "1: workers open a plain TCP data channel to each server they reach over tcp, and "
        "replies of KVSTORE_CHANNEL_BYTES or more come through it, received straight into "
        "the caller's arrays; ZeroMQ carries the rest. Never with KVSTORE_SECURE=1. "
        "0: everything through ZeroMQ. Read by workers and servers."),
    Var("KVSTORE_CHANNEL_BYTES", (), 1 << 20, _NON_NEGATIVE_INT,
        "Replies (pull, pushpull) of at least this many bytes use the data channel."),
    Var("KVSTORE_MALLOC_TUNING", (), True, _bool,
        "1: set glibc's malloc thresholds (mallopt) in servers and in workers that receive over "
        "tcp/ipc, so that large incoming messages reuse warm memory instead of page-faulting."),
    Var("KVSTORE_SECRET", (), None, str,
        "The job's secret (hex), created by the launcher and handed to every process in "
        "its environment. Every connection must prove it holds it; unset: no authentication. "
        "Under torch's launchers (torchrun, PyTorchJob) give it yourself, here or in "
        "KVSTORE_SECRET_FILE (docs/launching.md)."),
    Var("KVSTORE_SECRET_FILE", (), None, str,
        "A file holding the job's secret (e.g. a mounted Kubernetes Secret), read when "
        "KVSTORE_SECRET is unset; surrounding whitespace is ignored. It must be a regular, "
        "non-empty file that neither group nor others may read or write (chmod 600 or 400): "
        "any other is refused, naming it."),
    Var("KVSTORE_SECURE", (), False, _bool,
        "1: encrypt and authenticate all traffic with ZeroMQ CURVE (keys derived from "
        "KVSTORE_SECRET). Launchers turn it on when processes run on more than one host."),
    Var("KVSTORE_CHECKPOINT_DIR", (), None, str,
        "Directory (on each server's host) where servers write their checkpoints "
        "(server-RANK.ckpt: parameters, optimizer state, metadata)."),
    Var("KVSTORE_CHECKPOINT_INTERVAL", (), 0.0, _NON_NEGATIVE_FLOAT,
        "Seconds between automatic server checkpoints (0: only when a worker calls "
        "save_checkpoint()). Needs KVSTORE_CHECKPOINT_DIR."),
    Var("KVSTORE_RESUME", (), False, _bool,
        "1: servers start from their checkpoints in KVSTORE_CHECKPOINT_DIR (set by the "
        "launchers' --resume)."),
    Var("KVSTORE_ELASTIC", (), None, _elastic,
        "MIN:MAX opts in to elastic workers (set by the launchers' --elastic MIN:MAX): a worker "
        "that fails leaves the job instead of aborting it while at least MIN remain, and workers "
        "may join a running job up to MAX. Unset: any failure aborts the job."),
    Var("KVSTORE_DETERMINISTIC", (), False, _bool,
        "1: dist_sync servers add a round's pushes in worker-rank order whatever their arrival, so "
        "the same job on the same data gives the same bits (as torch.use_deterministic_algorithms "
        "asks); workers then push instead of writing into the servers' sums. kvstore.create(..., "
        "deterministic=True) overrides it. Read by workers; dist_async and dist_ssp refuse it."),
    Var("KVSTORE_REPLICAS", (), 0, _replicas,
        "1: each server's share of chunks has a backup on another server (the next in the ring, on "
        "another host where there is one) that applies every dist_sync round (dist_async, dist_ssp push) "
        "too, and a worker keeps each push until its backup has it; when a server dies the backup takes "
        "over its chunks and the job goes on (docs/reliability.md). Needs 2 or more servers in host memory "
        "(not KVSTORE_SERVER_DEVICE=gpu), tracker.local or tracker.ssh (not mpirun, srun), and not dist_ssp "
        "with elastic workers: other combinations are refused at start. 0: a dead server ends the job. "
        "Set it for the whole job (the launcher and every process)."),
    Var("KVSTORE_STALL_WARNING", (), 60.0, _NON_NEGATIVE_FLOAT,
        "Seconds a synchronous round may wait for missing workers before the server logs "
        "which workers and which key it waits for (0: never)."),
    Var("KVSTORE_STALENESS", (), 1, _staleness,
        "dist_ssp's staleness bound s: a worker's pull waits until every worker has pushed those "
        "chunks at least (its own pushes - s) times, so no worker runs more than s steps ahead "
        "of the slowest (0: exactly dist_sync; inf: dist_async). kvstore.create(\"dist_ssp\", "
        "staleness=s) overrides it. Read by workers; the same on every worker (checked)."),
    Var("KVSTORE_SERVER_DEVICE", (), "cpu", _Choice(*SERVER_DEVICES),
        "Where servers keep values, sums and optimizer state: cpu, or gpu (server s uses GPU "
        "s mod the host's GPU count, or KVSTORE_SERVER_GPUS; sums and optimizer updates run "
        "as CuPy kernels). A GPU server on a host without a usable GPU fails at start with "
        "the reason, and the job ends naming it. Set by the launchers' --server-device."),
    Var("KVSTORE_SERVER_GPUS", (), None, _gpu_list,
        "GPUs the servers of a host use with KVSTORE_SERVER_DEVICE=gpu, e.g. 0,1: server s "
        "takes entry s mod the list's length [default: every GPU of the host]."),
    Var("KVSTORE_SERVER_MEMORY", (), "auto", _pipeline,
        "Bytes of values and held requests one server may hold (0: no limit; auto: half of its "
        "host's memory, or of its cgroup's limit if lower). A request that would pass it (an init, "
        "init_rows or init_dyn of a large shape, a dynamic table's growth, a pull_dyn's reply, an "
        "early request held) is refused with an error naming the key, the bytes and this setting; "
        "the server changes nothing and goes on serving (docs/reliability.md)."),
    Var("KVSTORE_SERVERS_PER_HOST", (), 1, _POSITIVE_INT,
        "Under torch's launchers (torchrun, PyTorchJob: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
        "set, no KVSTORE_* job variables), how many servers each host's local rank 0 starts "
        "(tracker/torch_job.py)."),
    Var("KVSTORE_TIMELINE", (), None, str,
        "Directory where every worker and server writes a Chrome trace-event file of its "
        "calls, requests and rounds (worker-R.json, server-R.json; opens in Perfetto; "
        "`python -m kvstore.tools.timeline DIR` merges them). Unset: nothing is recorded."),
    Var("KVSTORE_PROFILE_DIR", (), "kvstore-profiles", str,
        "Directory (on each server's host; relative: to the server's working directory) where a "
        "server writes the profiles a worker asks for with "
        "kv._send_command_to_servers(\"profile_dump\", LABEL) (server-RANK[-LABEL].prof, created "
        "new, mode 0600). No path ever comes from the wire."),
    Var("KVSTORE_LOG_LEVEL", (), "INFO", str,
        "Log level of the entry points (server processes, launchers)."),
)

BY_NAME = {var.name: var for var in VARIABLES}


def default(name: str) -> Any:
    """The default of variable ``name`` (``default("KVSTORE_TIMEOUT")`` -> 300.0):
    how code outside this table spells a default, so that it is written once. Its
    type is the variable's (:attr:`Var.type`), which the table does not give type
    checkers: Any, so that it defaults a parameter or field of that type."""
    return BY_NAME[name].default


def _repr(self) -> str:  # never print the secret
    shown = ", ".join(f"{f.name}={'***' if f.name == 'secret' and self.secret else getattr(self, f.name)!r}"
                      for f in dataclasses.fields(self))
    return f"{type(self).__name__}({shown})"


if TYPE_CHECKING:
    class Settings(Any):
        """What type checkers see of the class below, which the table makes: its
        fields (one per variable) are not spelled out again, so they read as Any."""

        def __init__(self, **fields: object) -> None: ...
else:
    Settings = dataclasses.make_dataclass(
        "Settings", [(var.field, var.type, dataclasses.field(default=var.default)) for var in VARIABLES],
        frozen=True, repr=False, namespace={"__module__": __name__, "__repr__": _repr, "__doc__": (
            "Every variable of the table, parsed: one field per variable, named after it "
            "(``KVSTORE_CHUNK_BYTES`` -> ``chunk_bytes``), with its default. Frozen; build one "
            "with :func:`read`, or directly (not validated) in tests.")})


class EnvError(ValueError):
    """An environment variable has a value that cannot be parsed."""


def read(environ: Mapping[str, str]) -> Settings:
    """Parse every variable of the contract from ``environ`` into :class:`Settings`.

    The canonical name (``KVSTORE_...``) wins over an alias; unset or empty means
    absent (then the default). Raises :class:`EnvError` naming the variable.
    """
    values: dict[str, object] = {}
    for var in VARIABLES:
        for name in (var.name, *var.aliases):
            text = environ.get(name)
            if text is None or text == "":
                continue
            try:
                values[var.field] = var.parse(text)
            except ValueError as e:
                raise EnvError(f"environment variable {name}={text!r} is invalid: {e}") from None
            break
    if values.get("server_device") == "gpu":
        values.setdefault("chunk_bytes", GPU_SERVER_CHUNK_BYTES)
    if values.get("secret") is None and values.get("secret_file"):
        values["secret"] = _secret_from_file(str(values["secret_file"]))
    return Settings(**values)


SECRET_FILE_BYTES = 64 << 10   # more than any secret: a larger KVSTORE_SECRET_FILE is the wrong file


def _secret_from_file(path: str) -> str:
    """The secret held by ``path`` (KVSTORE_SECRET_FILE), whitespace stripped. Raises
    EnvError naming the file when it is missing, unreadable, not a regular file,
    open to group or others, empty, or not text. Checked on the opened file (fstat),
    so what is checked is what is read."""
    what = f"KVSTORE_SECRET_FILE={path!r}"
    try:
        # O_NONBLOCK: a FIFO opens at once (and is refused below) instead of waiting for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise EnvError(f"{what}: no such file") from None
    except OSError as e:
        raise EnvError(f"{what}: cannot be read ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise EnvError(f"{what}: not a regular file")
        if info.st_mode & 0o077:
            raise EnvError(f"{what}: group or others may access it (mode {stat.S_IMODE(info.st_mode):04o}); "
                           f"the job's secret must be readable by its user only: chmod 600 {path}")
        data = os.read(fd, SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > SECRET_FILE_BYTES:
        raise EnvError(f"{what}: larger than {SECRET_FILE_BYTES} bytes; is it the secret?")
    try:
        secret = data.decode().strip()
    except UnicodeDecodeError:
        raise EnvError(f"{what}: not text (a secret is text, e.g. 64 hex digits)") from None
    if not secret:
        raise EnvError(f"{what}: empty")
    return secret


def fields(settings) -> dict[str, object]:
    """The values of a :class:`Settings` (or of a subclass's table fields) by field name."""
    return {var.field: getattr(settings, var.field) for var in VARIABLES}


def log_level(environ: Mapping[str, str]) -> tuple[str, str | None]:
    """(KVSTORE_LOG_LEVEL as given, or its default when unset or empty; that as a
    :mod:`logging` level name, upper case, or None when it is not one). The table
    takes any text, since the library itself never configures logging; the
    entry points that do refuse what is not a level."""
    text = environ.get("KVSTORE_LOG_LEVEL") or default("KVSTORE_LOG_LEVEL")
    level = text.strip().upper()
    return text, (level if level in LOG_LEVELS else None)


def for_process(*, role: str, rank: int | None, scheduler_host: str, scheduler_port: int,
                num_workers: int, num_servers: int, node_host: str = default("KVSTORE_NODE_HOST"),
                extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a launcher sets for one child process (both our names and
    MXNet's, so scripts written for either find what they expect)."""
    env = {
        "KVSTORE_ROLE": role, "DMLC_ROLE": role,
        "KVSTORE_SCHEDULER_HOST": scheduler_host, "DMLC_PS_ROOT_URI": scheduler_host,
        "KVSTORE_SCHEDULER_PORT": str(scheduler_port), "DMLC_PS_ROOT_PORT": str(scheduler_port),
        "KVSTORE_NUM_WORKERS": str(num_workers), "DMLC_NUM_WORKER": str(num_workers),
        "KVSTORE_NUM_SERVERS": str(num_servers), "DMLC_NUM_SERVER": str(num_servers),
        "KVSTORE_NODE_HOST": node_host, "DMLC_NODE_HOST": node_host,
    }
    if rank is not None:
        env["KVSTORE_RANK"] = str(rank)
    if extra:
        env.update(extra)
    return env


# the names :func:`for_process` sets per process (role, rank, counts, addresses):
# launchers never forward the user's values of these
PER_PROCESS = frozenset(for_process(role="worker", rank=0, scheduler_host="", scheduler_port=1,
                                    num_workers=1, num_servers=1))


def markdown_table() -> str:
    """The table of variables as markdown (for docs/configuration.md)."""
    lines = ["| variable | MXNet alias | default | meaning |", "|---|---|---|---|"]
    for var in VARIABLES:
        alias = ", ".join(f"`{a}`" for a in var.aliases) or ""
        shown = "" if var.default is None else f"`{var.default}`"
        lines.append(f"| `{var.name}` | {alias} | {shown} | {var.help} |")
    return "\n".join(lines)


def entry_point_arguments(prog: str, doc: str, argv: list) -> int | None:
    """For ``python -m`` entry points configured by the environment only (the server,
    the scheduler): ``-h`` prints ``doc`` (returns 0), other arguments are refused
    (returns 2); None when there are none."""
    if argv in (["-h"], ["--help"]):
        print(doc.strip())
        return 0
    if argv:
        print(f"{prog} takes no arguments (got {' '.join(argv)}): it is configured "
              "by the KVSTORE_* environment (docs/configuration.md); -h for help", file=sys.stderr)
        return 2
    return None
