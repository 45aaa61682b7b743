"""Store types: the built-in names, MXNet's aliases, and types users plug in.

:func:`kvstore.create` asks :func:`resolve` what a name means. Names match
case-insensitively, as in MXNet. A class registered with
:meth:`KVStoreBase.register` is found under its class name, lower-cased (as
MXNet's ``KVStoreBase.register``), before anything else; then come MXNet's
aliases of the built-in types, then the built-in types. MXNet's ``nccl``,
``horovod`` and ``byteps`` are not store types here: asking for one is an error
that says what to use instead.

Example::

    import kvstore

    @kvstore.KVStoreBase.register
    class EchoStore(kvstore.KVStoreBase):
        def broadcast(self, key, value, out, priority=0):
            out[...] = value

    kv = kvstore.create("echostore")        # EchoStore(); kv.type == "echostore"
"""

from __future__ import annotations

import math
import numbers

from ..errors import ArgumentTypeError, ConfigError, InvalidArgumentError
from ..modes import ASYNC, SSP, SYNC, ConsistencyMode
from ..registry import Registry
from ..timeline import Timeline

STORE_TYPES = ("local", "dist_sync", "dist_async", "dist_ssp", "device", "dist_device_sync")

ALIASES = {
    "dist_sync_device": "dist_device_sync",   # MXNet matches "dist" + "device" in any order
    "local_update_cpu": "local",              # older MXNet names of its local store
    "local_allreduce_cpu": "local",           # (its nightly test_kvstore.py uses all three)
    "local_allreduce_device": "device",
}

ELSEWHERE = {
    "nccl": "MXNet's 'nccl' store (NCCL all-reduce among one machine's GPUs) does not exist "
            "here: use 'device' (sums and runs the optimizer on one GPU), or "
            "'dist_device_sync' across processes and machines",
    "horovod": "MXNet's 'horovod' store wraps Horovod's all-reduce and is not built in: use "
               "'dist_sync' ('dist_device_sync' for GPU values) under a tracker launcher, or "
               "plug a store of your own in with kvstore.KVStoreBase.register",
    "byteps": "MXNet's 'byteps' store wraps BytePS and is not built in: use 'dist_sync' "
              "(servers sum the pushes, as BytePS's do; 'dist_device_sync' for GPU values), or "
              "plug a store of your own in with kvstore.KVStoreBase.register",
}

CAPABILITIES = ("optimizer",)


class KVStoreBase:
    """MXNet's ``KVStoreBase``: the base of every store type, and the table of
    store types users plug in (:meth:`register`).

    :class:`kvstore.KVStore` is the base of the built-in types. A type of your
    own subclasses this class, implements the calls its users make (MXNet's
    interface: ``broadcast``, ``pushpull``, ``set_optimizer``, ...) and is built
    by :func:`kvstore.create` with no arguments, as MXNet does.
    """

    OPTIMIZER = "optimizer"
    """The capability of running an optimizer on pushed gradients (:meth:`is_capable`)."""

    capabilities: frozenset = frozenset()
    """The capabilities this store type has (:data:`OPTIMIZER`, or none)."""

    def is_capable(self, capability: str) -> bool:
        """Whether this store has ``capability`` (MXNet's ``is_capable``; e.g.
        ``kv.is_capable(kvstore.KVStore.OPTIMIZER)``: True for every built-in type,
        since each runs an optimizer given to ``set_optimizer``). Raises
        InvalidArgumentError (a ValueError, as MXNet raises) for an unknown capability."""
        if not isinstance(capability, str):
            raise ArgumentTypeError(f"is_capable: a capability is a str, got {type(capability).__name__}")
        if capability.lower() not in CAPABILITIES:
            raise InvalidArgumentError(f"is_capable: unknown capability {capability!r}; known: "
                                       f"{', '.join(map(repr, CAPABILITIES))} (KVStoreBase.OPTIMIZER)")
        return capability.lower() in self.capabilities

    @property
    def type(self) -> str:
        """The store type's name (a registered type: its class name, lower-cased)."""
        return type(self).__name__.lower()

    @property
    def rank(self) -> int:
        """Rank of this worker, 0 .. num_workers - 1."""
        return 0

    @property
    def timeline(self) -> Timeline | None:
        """This worker's timeline recorder (:class:`kvstore.timeline.Timeline`), or None
        when nothing is recorded: a dist store's when ``KVSTORE_TIMELINE`` is set, None
        for every other store. Integrations add their own events to the worker's trace
        through it (the Trainer's ``step``, ``bucket ready``)::

            tl = kv.timeline
            start = tl.now() if tl is not None else 0
            ...                                    # the work to show
            if tl is not None:
                tl.span("trainer", "step", start)
                tl.instant("trainer", "first gradient")
        """
        return None

    @property
    def num_workers(self) -> int:
        """Number of workers in the job."""
        return 1

    @property
    def local_rank(self) -> int:
        """This worker's place among the workers on its host (0 .. local_size - 1)."""
        return 0

    @property
    def local_size(self) -> int:
        """The number of workers on this worker's host."""
        return 1

    @property
    def members(self) -> tuple:
        """The ranks of the job's workers, ascending: ``0 .. num_workers - 1``, except
        in an elastic job (docs/elastic.md), whose workers leave and join."""
        return tuple(range(self.num_workers))

    @property
    def elastic(self) -> tuple | None:
        """(MIN, MAX) workers of an elastic job (``--elastic MIN:MAX``), else None."""
        return None

    @property
    def joined(self) -> bool:
        """Whether this worker joined a running elastic job (docs/elastic.md)."""
        return False

    # MXNet's KVStoreBase declares these and raises NotImplementedError from each:
    # a plugged-in type that leaves one out answers a clear error, not AttributeError
    def broadcast(self, key, value, out, priority: int = 0) -> None:
        """Initialise ``key`` with ``value`` (rank 0's) and pull it into ``out``."""
        raise self._not_implemented("broadcast")

    def pushpull(self, key, value, out=None, priority: int = 0) -> None:
        """Push ``value`` and pull the result into ``out`` (or ``value``)."""
        raise self._not_implemented("pushpull")

    def set_optimizer(self, optimizer) -> None:
        """Run ``optimizer`` on pushed gradients."""
        raise self._not_implemented("set_optimizer")

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Write the optimizer's state to ``fname``."""
        raise self._not_implemented("save_optimizer_states")

    def load_optimizer_states(self, fname: str) -> None:
        """Read the optimizer's state from ``fname``."""
        raise self._not_implemented("load_optimizer_states")

    def _not_implemented(self, method: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__qualname__}.{method}: this store type does not "
                                   f"implement {method}() (KVStoreBase declares it, as MXNet's does)")

    @staticmethod
    def register(klass):
        """Class decorator (MXNet's ``KVStoreBase.register``): ``kvstore.create(name)``
        builds ``klass()`` when ``name`` is its class name in any case. Raises
        ConfigError for a class that is not a KVStoreBase subclass, whose name is a
        built-in type or alias, or whose name another class already holds."""
        return _REGISTERED.add(klass)


def _class_name(klass: type) -> str:
    name = klass.__name__
    if name.lower() in STORE_TYPES or name.lower() in ALIASES:
        raise ConfigError(f"KVStoreBase.register: {klass.__qualname__} would be found as "
                          f"{name.lower()!r}, a built-in store type; give the class another name")
    return name


_REGISTERED = Registry("store type", KVStoreBase, "KVStoreBase.register", _class_name)


def resolve(name) -> str | type:
    """What ``kvstore.create(name)`` builds: a registered class, or the built-in
    type's own name (aliases mapped). Raises ArgumentTypeError for a name that is
    not a str, ConfigError for an unknown one (listing the valid names) or one of
    MXNet's that is not a store type here (saying what to use instead)."""
    if not isinstance(name, str):
        raise ArgumentTypeError(f"create: the store type must be a str, got {type(name).__name__}")
    registered = _REGISTERED.get(name)
    if registered is not None:
        return registered
    key = ALIASES.get(name.lower(), name.lower())
    if key in STORE_TYPES:
        return key
    if key in ELSEWHERE:
        raise ConfigError(f"store type {name!r}: {ELSEWHERE[key]}")
    extra = f"; registered: {', '.join(_REGISTERED.names())}" if _REGISTERED.names() else ""
    raise ConfigError(f"unknown store type {name!r}; valid types: {', '.join(STORE_TYPES)} "
                      f"(aliases: {', '.join(ALIASES)}){extra}")


def builtin_type(name: str) -> str:
    """The built-in store type that ``name`` (any case, or one of MXNet's aliases)
    names: ``builtin_type("dist_sync_device") == "dist_device_sync"``; any other
    name comes back lower-cased. A store built under an alias (``kv.type``) asks it
    which type it is."""
    return ALIASES.get(name.lower(), name.lower())


# -- dist_ssp's staleness bound ------------------------------------------------------------
class _FromConfig:
    """``create``'s ``staleness`` when not given: the job's KVSTORE_STALENESS."""

    def __repr__(self) -> str:
        return "KVSTORE_STALENESS"


FROM_CONFIG = _FromConfig()


def staleness_bound(given, configured) -> int | float:
    """dist_ssp's bound s: ``given`` (create's ``staleness``), or ``configured``
    (KVSTORE_STALENESS, already parsed) when it is :data:`FROM_CONFIG`. An int >= 0,
    or ``math.inf`` for ``None``, ``"inf"`` or ``math.inf``. Raises ArgumentTypeError
    or InvalidArgumentError for anything else."""
    value = configured if given is FROM_CONFIG else given
    if value is None or (isinstance(value, str) and value.strip().lower() in ("inf", "infinity")) \
            or (isinstance(value, float) and value == math.inf):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"create: staleness must be an int >= 0, None or 'inf', got {value!r}")
    if value < 0:
        raise InvalidArgumentError(f"create: staleness must be >= 0 (0 is dist_sync), got {value}")
    return int(value)


def server_mode(kind: str, bound) -> ConsistencyMode:
    """How the servers run a distributed store (kvstore.modes): :data:`~kvstore.modes.SYNC`,
    :data:`~kvstore.modes.ASYNC`, or :data:`~kvstore.modes.SSP` for dist_ssp with
    0 < bound < inf. dist_ssp's bound 0 is dist_sync and inf is dist_async, run by the
    same code so that they behave exactly alike."""
    if kind == "dist_async" or bound == math.inf:
        return ASYNC
    return SSP if kind == "dist_ssp" and bound > 0 else SYNC
