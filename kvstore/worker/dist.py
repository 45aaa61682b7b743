"""``dist_sync``, ``dist_async`` and ``dist_ssp``: a store whose values live on the servers.

Keys are split into chunks placed on servers (:mod:`kvstore.sharding`); the
store's :class:`~kvstore.worker.exchange.Exchange` groups a call's chunks bound for
one server into messages of about the size its link prefers, sends them through
the :class:`~kvstore.worker.client.Client` and fills the outputs. Collective calls
(create, init, set_optimizer, barrier, allgather_bytes) pass through the scheduler's barrier
(:mod:`kvstore.worker.job`); checkpoints are :mod:`kvstore.worker.checkpoints`, optimizer
states on the servers :mod:`kvstore.worker.remote_states`, finishing or failing
:mod:`kvstore.worker.leaving`. ``dist_ssp`` runs the servers in ``ssp`` mode
(kvstore.server.ssp), or in sync (staleness 0) or async (inf) mode.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from . import remote_states
from .checkpoints import Checkpoints
from .store import KeyInfo, KVStore
from .client import Client
from ..devices.base import Accelerators
from ..devices.staging import Staging
from ..rows.dist import DistRows
from ..rows.dynamic import DynamicRows
from ..config import Config
from ..errors import ArgumentTypeError, InvalidArgumentError
from .exchange import Exchange, OpenRound, Pending, Wire
from .failover import replicated_config
from ..hostgroup.group import HostGroup
from .job import JobMember
from .plans import CallPlan
from .leaving import Departure
from ..protocol import ops
from ..sharding import Placement
from .types import builtin_type, server_mode
from ..timeline import Timeline, open_timeline

log = logging.getLogger(__name__)


class DistStore(KVStore):
    """A worker's handle on the distributed store. Created by
    ``kvstore.create("dist_sync")`` inside a process started by a launcher;
    ``staleness``: dist_ssp's bound (kvstore.server.ssp; None otherwise)."""

    def __init__(self, name: str, config: Config, staleness: int | float | None = None,
                 accelerators: Accelerators | None = None):
        super().__init__(name)                   # kv.type: the name given to create, an alias as given
        kind = builtin_type(name)                # the built-in type it names ("dist_sync_device": dist_device_sync)
        config.require_cluster(f"kvstore.create({kind!r})")
        # what the servers run (kvstore.modes): sync, async, or ssp (dist_ssp, 0 < s < inf)
        self._mode = server_mode(kind, staleness)
        if config.deterministic:
            if not self._mode.ordered_sums:
                raise InvalidArgumentError(
                    f"kvstore.create({kind!r}): deterministic sums (KVSTORE_DETERMINISTIC=1 or deterministic="
                    "True) need dist_sync; this store applies each push as it arrives, in arrival order")
            # the servers add a round's pushes in rank order: nothing writes into their sums
            config = config.replace(write_in=False)
        if config.replicas:     # servers with backups (kvstore.worker.failover): what is built
            config = replicated_config(config, self._mode, kind)
        self._config = config
        self._staleness = staleness
        # summing on the host first (kvstore.hostgroup.group): its endpoint is registered
        host = HostGroup(config, accelerators) if config.host_reduce and self._mode.host_sums else None
        self._job = JobMember(config, addr=host.advert if host else "")
        self._membership = self._job.membership
        self._optimizer_calls = 0      # set_optimizer calls (numbered with replicated servers)
        self._departure = Departure(self._job)     # close, fail, the exit handlers
        self._client: Client     # once registered (below); a failed registration has none
        self._exchange: Exchange
        client: Client | None = None
        self._rank = -1
        self._timeline: Timeline | None = None     # KVSTORE_TIMELINE (kvstore.timeline): None when off
        try:
            reg = self._job.register()
            self._rank, self._members = reg.rank, tuple(reg.members)
            self._elastic = tuple(reg.elastic) if reg.elastic else None
            # joined a running elastic job: the others are not at this worker's first
            # collective calls (create, init, set_optimizer), which it makes alone
            # until its first barrier meets theirs (docs/elastic.md)
            self._joining = self._joined = bool(reg.joined)
            client = self._client = Client(config, self._membership, reg.servers, reg.rank, accelerators)
            self._plans.also_forget(client.forget)      # the links' layouts go with the call plans
            self._timeline = self._client.timeline = open_timeline(config.timeline, "worker", reg.rank)
            # sending and filling (kvstore.worker.exchange); device values cross to the host by staging
            self._exchange = Exchange(client, config, self._mode, self._leads, self._wire, self._timeline,
                                      Staging(accelerators) if accelerators is not None else None)
            if host is not None and host.form(reg, self._membership):
                self._exchange.join_host(host)
            host = self._exchange.host         # form() closed a group that did not form
            self._departure.attach(client, host, self._rank)
            self._rows = DistRows(self._client, self._mode, self._collective, self._leads)
            self._placement = Placement(reg.num_servers, config.chunk_bytes)
            self._collective(f"create {kind} chunk_bytes={config.chunk_bytes}"
                             + (f" staleness={staleness}" if staleness is not None else "")
                             + (" deterministic" if config.deterministic else ""))
            # --resume: every server restores the same checkpoint set before anything else
            self._checkpoints = Checkpoints(self._client, self._leads, config, self._collective,
                                            self._membership.fail, self._exchange.flush)
            self._checkpoints.resume()
            if self._leads():
                # the servers count a round complete when every worker rank is in it
                self._client.request_all(ops.CONFIGURE, "configuring the servers", num_workers=reg.worker_ranks,
                                         **self._mode.configure_fields(staleness),
                                         **({"deterministic": True} if config.deterministic else {}))
        except BaseException:
            self._departure.attach(client, host, self._rank)
            self._departure.release()
            raise
        self._departure.watch(config.exit_on_abort)
        log.info("[worker:%d] %s %s with %d workers and %d servers%s",
                 self._rank, "joined the running job" if self._joined else "joined", kind,
                 len(self._members), reg.num_servers,
                 (f" (elastic {self._elastic[0]}:{self._elastic[1]})" if self._elastic else "")
                 + (", sums in rank order (deterministic)" if config.deterministic else ""))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def timeline(self) -> Timeline | None:
        """This worker's timeline recorder with ``KVSTORE_TIMELINE`` set, else None
        (:attr:`kvstore.KVStoreBase.timeline`)."""
        return self._timeline

    @property
    def num_workers(self) -> int:
        """The number of workers; in an elastic job, of members as of this worker's
        last collective call (they leave and join: docs/elastic.md)."""
        return len(self._members)

    @property
    def members(self) -> tuple:
        return self._members

    @property
    def host_group(self) -> tuple:
        """The ranks of the workers whose pushpulls this host sums before pushing
        (``KVSTORE_HOST_REDUCE=1``; the lowest pushes for all), or () when none."""
        host = self._exchange.host
        return host.ranks if host is not None else ()

    def _host_stats(self) -> dict:
        """comm_stats' bytes to and from the group's others (none without a group)."""
        host = self._exchange.host
        if host is None:
            return {}
        return {"host_bytes_sent": host.bytes_sent, "host_bytes_received": host.bytes_received}

    def _host_mates(self) -> list[int]:
        """The member ranks registered from this worker's host (its KVSTORE_NODE_HOST
        address: emulated hosts on one machine count as one), ascending."""
        hosts = [str(w).rsplit(":", 1)[0] for w in self._membership.workers]
        if self._rank >= len(hosts):
            return [self._rank]
        return [r for r in self._members if r < len(hosts) and hosts[r] == hosts[self._rank]]

    @property
    def local_rank(self) -> int:
        """This worker's place among the job's workers on its host, by rank (torchrun's
        LOCAL_RANK when torchrun started the job), as of the last collective call."""
        return self._host_mates().index(self._rank)

    @property
    def local_size(self) -> int:
        """The number of the job's workers on this worker's host (LOCAL_WORLD_SIZE)."""
        return len(self._host_mates())

    @property
    def elastic(self) -> tuple | None:
        return self._elastic

    @property
    def joined(self) -> bool:
        return self._joined

    @property
    def progress(self) -> dict:
        """The job's progress as last saved by any worker with :meth:`save_progress`,
        as this worker last heard it (at registration and at each barrier); {} if none."""
        return dict(self._membership.progress)   # as of registration, barriers, saves

    def save_progress(self, progress: dict) -> None:
        """Record ``progress`` (a small dict, e.g. ``{"epoch": 3}``) with the job's
        scheduler, where a worker that joins an elastic job later reads it
        (``kv.progress``). Not collective: one worker saves, e.g. ``kv.members[0]``."""
        self._check_open("save_progress")
        if not isinstance(progress, dict):
            raise InvalidArgumentError(f"save_progress: progress must be a dict, got {type(progress).__name__}")
        self._job.save_progress(progress)

    def _leads(self) -> bool:
        """Whether this worker acts for all at collective calls (configure, init,
        set_optimizer, checkpoints): rank 0, or in an elastic job the lowest member,
        which every worker computes alike from the members of the same barrier."""
        return not self._joining and self._rank == self._members[0]

    def _collective(self, token: str, deadline: bool = True, items: Sequence[str] = ()) -> None:
        """Wait for every worker's same collective call (the scheduler's barrier;
        ``items``: what it agrees on key by key, named in the error when the workers
        differ); learn the members (they change in an elastic job). A worker that
        joined a running job passes alone until its first :meth:`barrier`."""
        if self._joining:
            return
        # (replicated servers) no push of this worker may be only in its memory once the
        # others pass: they may read what it pushed, or send every server a request
        # (set_optimizer) that must not reach a backup before the rounds it follows do
        # (a backup applies those rounds with the optimizer it has when they come)
        self._client.settle(token)
        _, members = self._job.collective(token, deadline, items)
        self._now_members(members)

    def _now_members(self, members) -> None:
        """The members as of the last collective call; a change forgets the call plans."""
        members = tuple(members)
        if members != self._members:
            self._plans.clear()
        self._members = members

    @property
    def staleness(self) -> int | float | None:
        """dist_ssp's bound (0: run as dist_sync; inf: as dist_async); None for other types."""
        return self._staleness

    @property
    def resumed(self) -> bool:
        """Whether the servers started from a checkpoint (a job started with ``--resume``)."""
        return self._checkpoints.resumed

    @property
    def resume_meta(self) -> dict:
        """The ``meta`` that checkpoint was saved with ({} when not resumed)."""
        return self._checkpoints.meta

    def save_checkpoint(self, meta: dict | None = None) -> None:
        """Collective: every server writes its checkpoint (parameters, optimizer
        state, and ``meta``, e.g. ``{"epoch": 3}``) to KVSTORE_CHECKPOINT_DIR once
        every worker's pushes so far are applied. A job restarted with the same
        command plus ``--resume`` starts from it; ``kv.resume_meta`` returns ``meta``.
        ``meta`` holds str, int, float, bool, None, bytes, lists and dicts (numpy
        scalars become Python numbers); anything else raises InvalidArgumentError on
        every worker, before anything is sent."""
        self._check_open("save_checkpoint")
        self._checkpoints.save(meta)

    def _send_command_to_servers(self, head: str, body: str = "") -> list:
        """MXNet's call: run a command on every server (kvstore.server.commands:
        ``"profile_start"``, ``"profile_stop"``, ``"profile_dump"``, whose ``body`` is
        an optional label: each server writes ``server-RANK[-LABEL].prof`` into its own
        ``KVSTORE_PROFILE_DIR``; no path travels); returns each server's result (for a
        dump, its file). Not collective: any worker may send one. A bad command or
        body raises RemoteError naming the server and changes nothing."""
        self._check_open("_send_command_to_servers")
        if not isinstance(head, str) or not isinstance(body, str):
            raise ArgumentTypeError(f"_send_command_to_servers: head and body must be str, got "
                                    f"{type(head).__name__} and {type(body).__name__}")
        replies = self._client.request_all(ops.COMMAND, f"server command {head!r}", head=head, body=body)
        return [reply.get("result") for reply in replies]

    def empty(self, shape, dtype=np.float32) -> np.ndarray:
        """A new, uninitialised numpy array for gradients. When this worker reaches
        servers on its host through shared memory, the array lives there, and
        ``pushpull`` lets those servers read it in place instead of copying it into
        a staging slot (``push`` still copies: the caller may overwrite its buffer
        as soon as ``push`` returns). Elsewhere it is an ordinary array."""
        self._check_open("empty")
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return self._client.shared_empty(int(np.prod(shape, dtype=np.int64)), dtype).reshape(shape)

    def _wire(self) -> Wire:
        """How this call's values go on the wire (kvstore.worker.exchange): the compression
        and whether the servers' optimizer needs whole keys' norms."""
        opt = self._optimizer
        return Wire(self._compressor, opt is not None and opt.splits_norms, self._args.low_precision,
                    self._model_sums if opt is not None and opt.whole_model else None)

    def _model_sums(self, terms: list) -> list:
        """A whole-model optimizer's sums of a call's terms, kept as ``last_model_sums``."""
        assert self._optimizer is not None
        self.last_model_sums = self._optimizer.model_sums(terms)
        return self.last_model_sums

    def _multi_precision_refusal(self) -> str | None:
        if self._exchange.host is not None:
            return "a host's sum (KVSTORE_HOST_REDUCE=1) is summed in its keys' dtypes: set KVSTORE_HOST_REDUCE=0"
        return None

    # -- hooks ---------------------------------------------------------------------------------
    def _do_init(self, items) -> None:
        call = self._timeline.begin(ops.INIT, [k for k, *_ in items]) if self._timeline is not None else None
        self._collective("init", items=[f"key {k!r} {tuple(shape)} {dtype.name}" for k, shape, dtype, _ in items])
        infos, flats = [], []
        for key, shape, dtype, value in items:
            size = int(np.prod(shape, dtype=np.int64))
            info = KeyInfo(key, tuple(shape), dtype, self._placement.place(key, size, dtype.itemsize))
            infos.append(info)
            flats.append((info, np.ascontiguousarray(value, dtype=dtype).reshape(-1)))
        self._check_whole_keys(self._optimizer, infos, "init")    # every worker alike, before sending
        if self._leads():
            self._exchange.init(f"init of {len(items)} key(s)", flats)
        for info in infos:
            self._keys[info.key] = info
        self._collective("init done")
        if call is not None:
            call.done()

    def _do_init_rows(self, items) -> None:
        if not self._mode.takes_rows:
            raise InvalidArgumentError(f"init: {self._mode.no_rows}")
        self._rows.init(items)
        self._keys.update({k: KeyInfo(k, tuple(shape), np.dtype(dtype), sparse=True,
                                      dynamic=spec if isinstance(spec, DynamicRows) else None)
                           for k, shape, dtype, spec, *_ in items})

    def _do_push_rows(self, items) -> None:
        self._check_can_push()
        self._rows.push([(info.key, rows, data) for info, rows, data in items])

    def _do_assign_rows(self, info, rows, data) -> None:
        self._exchange.flush("assign_rows")      # after this worker's pushes, as a pull is
        self._rows.assign(info.key, rows, data)

    def _do_pull_rows(self, info, rows) -> np.ndarray:
        data = self._rows.pull(info.key, rows, info.shape[1:], info.dtype)
        self._checkpoints.pulled()
        return data

    def _do_row_stats(self, info) -> list:
        return self._rows.stats(info.key)      # dynamic rows (kvstore.rows.dist)

    def _check_can_push(self) -> None:
        if self._joining:
            raise InvalidArgumentError(
                "this worker joined a running elastic job: it pushes only after its first "
                "barrier(), where it meets the other workers (docs/elastic.md)")
        if self._mode.needs_optimizer and self._optimizer is None:
            raise InvalidArgumentError(f"{self._type} applies every push with an optimizer on the "
                                       "servers: call set_optimizer() before push() or pushpull()")

    def _do_push(self, items, wait_sent: bool = True, rows: dict | None = None) -> None:
        self._check_can_push()
        self._exchange.push(f"push of {_keys_text(info for info, _ in items)}", items, wait_sent, rows)

    # -- norms across servers (LARS, LAMB on keys cut into chunks; kvstore.server.sync) --------
    def _norms_across_servers(self, optimizer) -> bool:
        return optimizer.splits_norms and self._mode.split_norms and self._elastic is None and self._exchange.host is None

    def _why_no_norms_across_servers(self, optimizer) -> str:
        if not optimizer.splits_norms:
            return f"{type(optimizer).__name__}'s step cannot be split by norms across servers"
        if not self._mode.split_norms:
            return f"norms across servers are added up in dist_sync only, not in {self._type}"
        return ("norms across servers need a fixed set of workers, without --elastic or "
                "KVSTORE_HOST_REDUCE")

    # a call's start returns at once (paced=False: it never waits for replies to keep
    # a window in flight); a whole call may (transport/pace.py)
    def _do_pull_start(self, items, paced: bool = False) -> Pending:
        return self._exchange.send(ops.PULL, f"pull of {_keys_text(i for i, _ in items)}", None, items, paced)

    def _do_pull_finish(self, handle: Pending) -> None:
        self._exchange.fill(handle)
        self._checkpoints.pulled()

    def _do_pushpull_start(self, items, rows: dict | None = None, paced: bool = False,
                           plan: CallPlan | None = None) -> Pending:
        self._check_can_push()
        what = f"pushpull of {_keys_text(i for i, _, _ in items)}"
        if rows and self._exchange.host is not None:
            raise InvalidArgumentError(
                f"{what}: a row-sparse gradient on dense key {next(iter(rows))!r} updates only its rows "
                f"({type(self._optimizer).__name__}'s lazy_update), which a host's sum (KVSTORE_HOST_REDUCE=1) "
                "does not carry: push it with kv.push, or set lazy_update=False, or KVSTORE_HOST_REDUCE=0")
        return self._exchange.send(ops.PUSHPULL, what, [(info, merged) for info, merged, _ in items],
                                   [(info, targets) for info, _, targets in items], paced, rows,
                                   plan.routes() if plan is not None else None)

    _do_pushpull_finish = _do_pull_finish     # the same: fill the outputs, a pull for checkpoints

    def _do_pushpull_open(self, items) -> OpenRound:
        self._check_can_push()
        what = f"pushpull of {_keys_text(i for i, _, _ in items)}"
        if self._optimizer is None or not self._optimizer.whole_model:
            raise InvalidArgumentError(f"{what}: pushpull_open needs a whole-model optimizer on the servers (a torch "
                                       "twin with clip_grad_norm or grad_scale: set_optimizer first)")
        return self._exchange.open_model(what, [(info, merged) for info, merged, _ in items],
                                         [(info, targets) for info, _, targets in items])

    def _do_pushpull_close(self, opened, sums: list) -> None:
        self._exchange.close_model(opened, sums)
        self._checkpoints.pulled()

    def _do_set_optimizer(self, optimizer, collective: bool = True, keep_state: bool = False,
                          state_scale: float = 1.0) -> None:
        if self._config.replicas and optimizer.whole_model:
            raise InvalidArgumentError(
                f"{type(optimizer).__name__} with clip_grad_norm or grad_scale (kvstore.torch.Trainer's "
                "clip_grad_norm= and grad_scaler= with the servers updating) takes every key through two phases "
                "across servers, which replicated servers (KVSTORE_REPLICAS=1) do not replicate yet: unset "
                "KVSTORE_REPLICAS, or clip and scale with the workers updating (update_on_kvstore=False)")
        config = optimizer.to_config()
        fields = {"optimizer": config}
        if self._config.replicas:
            # numbered: a server that gets it twice (from this worker and forwarded by a
            # primary it backs up: kvstore.server.replication) applies it once
            self._optimizer_calls += 1
            fields["call"] = self._optimizer_calls
        if keep_state:
            fields.update(keep_state=True, **({"state_scale": state_scale} if state_scale != 1.0 else {}))
        if not collective:
            self._client.settle("set_optimizer")    # (replicas) see _collective
            self._client.request_all(ops.SET_OPTIMIZER, "set_optimizer", **fields)
            return
        self._exchange.flush("set_optimizer")
        self._collective(f"set_optimizer {config['name']}")
        if self._leads():
            self._client.request_all(ops.SET_OPTIMIZER, "set_optimizer", **fields)
        self._collective("set_optimizer done")

    def _get_states(self) -> dict:
        self._exchange.flush("save_optimizer_states")
        return remote_states.gather(self._client, self._keys, self._optimizer, self._pulled)

    def _pulled(self, info, rows=None) -> np.ndarray:
        if info.sparse:
            return self._do_pull_rows(info, rows)
        value = np.empty(info.size, info.dtype)
        self._do_pull_finish(self._do_pull_start([(info, [value])], paced=True))
        return value

    def _set_states(self, states: dict) -> None:
        remote_states.scatter(self._client, self._keys, self._optimizer, states)

    def comm_stats(self) -> dict:
        """Bytes this worker sent and received: each message's header plus the bytes
        of its arrays, whichever way they went, so a model reports the same bytes on
        one host as across hosts. ``bytes_sent``/``bytes_received``: to and from the
        servers; ``by_transport``: those split by ``tcp``, ``ipc``, ``shm`` (shared
        memory with co-located servers) and ``channel`` (data-channel replies), plus
        ``host`` (to and from a host group's others, also ``host_bytes_*``;
        kvstore/transport/traffic.py)."""
        traffic = self._client.traffic.by_transport()
        sent, received = self._client.traffic.totals()
        host = self._host_stats()
        if host:
            traffic["host"] = {"sent": host["host_bytes_sent"], "received": host["host_bytes_received"]}
        return {"bytes_sent": sent, "bytes_received": received, "by_transport": traffic, **host}

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for pushes in flight, tell the scheduler this worker is done, release
        sockets (kvstore.worker.leaving.Departure)."""
        self._plans.clear()
        try:
            self._departure.close()
        finally:
            self._closed = self._departure.left

    def __exit__(self, exc_type, exc, tb) -> None:
        """Leaving a ``with`` block: close, or on an exception report the failure."""
        try:
            self._departure.exit_block(exc_type, exc)
        finally:
            self._closed = self._departure.left

    def barrier(self) -> None:
        """Wait until every worker called barrier(); pushes sent before are applied.
        In an elastic job: every member, and the members (``kv.members``,
        ``kv.num_workers``) and ``kv.progress`` are updated here; a worker that
        joined a running job meets the others at its first barrier."""
        self._check_open("barrier")
        self._exchange.flush("barrier")
        joining, self._joining = self._joining, False
        # a joiner's first: the others come at their next barrier (an epoch's end, maybe)
        self._collective("barrier", deadline=not joining)


    def _do_allgather(self, data: bytes, timeout: float | None) -> list[bytes]:
        if self._joining:
            raise InvalidArgumentError(
                "allgather_bytes: this worker joined a running job and is no member until its first "
                "barrier(), where it meets the others (docs/elastic.md)")
        # through the scheduler (tracker.control.membership.Membership.allgather): its
        # control channel authenticates every peer; the members come back with the payloads
        self._client.settle("allgather_bytes")
        members, parts = self._job.allgather(data, "allgather_bytes", timeout)
        self._now_members(members)
        return parts


def _keys_text(infos) -> str:
    # (the first five keys' reprs only: every call names its keys, a 161-key call need not repr 161)
    keys, count = [], 0
    for info in infos:
        if count < 5:
            keys.append(repr(info.key))
        count += 1
    shown = ", ".join(keys) + (f" and {count - 5} more" if count > 5 else "")
    return f"key{'s' if count > 1 else ''} {shown}"
