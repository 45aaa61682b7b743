"""A worker's exchange of values with the servers: the sending and filling half of
the dist stores (:class:`kvstore.worker.dist.DistStore` composes one).

A call's values are cut into their keys' chunks, grouped by server and sent in
messages of about the size each link prefers (:func:`kvstore.sharding.pieces`)
through the :class:`~kvstore.worker.client.Client`; the call's outputs are filled from
the replies by :meth:`Exchange.fill`. Between the two the call is a
:class:`Pending` (a small dataclass), so a pushpull can overlap other work (the
Trainer's buckets during backward).

Its collaborators, each owning its own state:

- a :class:`~kvstore.hostgroup.group.HostGroup` (``KVSTORE_HOST_REDUCE=1``): a
  pushpull goes to the host's leader, which sums and pushes for the group
  (through this exchange, :meth:`Exchange.join_host`);
- a :class:`~kvstore.devices.staging.Staging` (the GPU stores): device sums are
  brought to host memory before they go out, and replies for device outputs land
  in host memory that is copied to the device once they are in;
- the store's :class:`Wire`, asked for at every call: how values go on the wire
  (gradient compression) and whether the servers' optimizer needs a whole key's
  norms (LARS, LAMB: keys cut over servers take two phases, docs/protocol.md 4).

Example (what DistStore does)::

    exchange = Exchange(client, config, mode=SYNC, leads=lambda: rank == 0, wire=store_wire)
    pending = exchange.send(ops.PUSHPULL, "pushpull of key 3", [(info, grad)], [(info, [out])])
    exchange.fill(pending)          # out holds the sum (or the updated weight)
    exchange.flush("barrier")       # every call in flight completed, errors raised
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .. import precision
from ..devices import arrays
from ..errors import InvalidArgumentError, ProtocolError
from ..protocol import ops
from ..rows import lazy
from ..sharding import pieces
from ..transport.links import RequestOptions
from .plans import Routes
from .store import fill_bfloat16, fill_outputs

if TYPE_CHECKING:
    from .client import Client
    from ..compression import Compressor
    from ..config import Config
    from ..devices.staging import Staging, Staged
    from ..hostgroup.group import HostCall, HostGroup
    from ..modes import ConsistencyMode
    from ..timeline import Call as TimelineCall, Timeline
    from ..transport.links.write_in import Writer, Writing
    from ..transport.pace import Flight


@dataclass(frozen=True)
class Wire:
    """How a call's values go on the wire, as the store is set up at the call:
    ``compressor`` (None: values as they are) and ``splits_norms`` (the servers'
    optimizer needs each key's norms over all its chunks: LARS, LAMB)."""
    compressor: Compressor | None = None
    splits_norms: bool = False
    low_precision: bool = False      # float16/bfloat16 values for float32 keys (kvstore.precision)
    # a whole-model optimizer's Optimizer.model_sums (every key takes the two phases,
    # every chunk gets the sums of the whole call), None: each key's own sums
    model_sums: Callable[[list], list] | None = None

    def check(self, infos, what: str) -> None:
        """Refuse what compression cannot carry, before the first message is sent."""
        if self.compressor is not None:
            self.compressor.check(infos, what)

    def precisions(self, sources, what: str) -> dict:
        """{wire id: "float16" | "bfloat16"} for the chunks of ``sources`` [(info, flat)]
        that go in low precision (a flat whose dtype is not its key's: only
        multi-precision lets one through the argument checks). Raises
        InvalidArgumentError, before anything is sent, where compression would have
        to carry them."""
        marks: dict = {}
        if not self.low_precision:
            return marks
        for info, flat in sources:
            if flat.dtype == info.dtype:
                continue
            name = next((n for n, dt in precision.WIRE_DTYPES.items() if dt == flat.dtype), None)
            if name is None or info.dtype != precision.MASTER:     # (the argument checks make this impossible)
                raise InvalidArgumentError(f"{what}: key {info.key!r} holds {info.dtype.name}, got {flat.dtype.name}")
            if self.compressor is not None:
                raise InvalidArgumentError(f"{what}: key {info.key!r} got {name} values, which gradient "
                                           "compression does not take: push float32 or turn compression off")
            for chunk in info.chunks:
                marks[tuple(chunk.wire_id)] = name
        return marks

    def reply_precision(self, info, outs) -> str | None:
        """The precision the servers answer key ``info`` in for outputs ``outs``: its
        outputs' ("float16" | "bfloat16") when every one is of that precision and the
        key is float32 (multi-precision), else None (the key's dtype)."""
        if not self.low_precision or info.dtype != precision.MASTER:
            return None
        name = arrays.dtype_name(outs[0])
        if name not in precision.WIRE_DTYPES or any(arrays.dtype_name(o) != name for o in outs[1:]):
            return None
        return name

    def out_buffer(self, info, out) -> np.ndarray | None:
        """A float32 buffer for a float16/bfloat16 output of a float32 key (the
        reply is float32, written into ``out`` rounded once), else None."""
        if not self.low_precision or info.dtype != precision.MASTER or arrays.dtype_name(out) not in precision.WIRE_DTYPES:
            return None
        return np.empty(info.size, info.dtype)

    def compress(self, wire_ids, parts) -> list:
        """``parts`` as they go on the wire. Called per message just before it is sent,
        so compressing the next one overlaps sending this one."""
        if self.compressor is None:
            return parts
        return [self.compressor.compress(tuple(wid), part) for wid, part in zip(wire_ids, parts)]

    def fields(self) -> dict:
        return {} if self.compressor is None else {"compression": self.compressor.config}

    def layerwise(self, info) -> bool:
        """Whether pushes of ``info`` run in two phases: a key cut into chunks over
        the servers under an optimizer whose step needs the whole key's norms."""
        return self.splits_norms and (self.model_sums is not None or len(info.chunks) > 1)


@dataclass
class Sent:
    """Requests on their way, which :meth:`Exchange.fill` completes: the request ids,
    the writes into the servers' sums (each a ``Writing``, whose grant sends its
    ``written``), the pace window, what the call is, the outputs to fill from each flat
    reply buffer, and the call's timeline record (None when off)."""
    ids: list
    writes: list[Writing]
    flight: Flight
    what: str
    fills: list            # (outputs, flat buffer, whether the buffer is the output itself)
    call: TimelineCall | None = None
    keep: list = field(default_factory=list)   # host copies of device sums the servers may read
    wide: list = field(default_factory=list)   # (key, float32 buffer) of low-precision outputs, reused
    patterns: set = field(default_factory=set)  # id() of the flats that receive bfloat16 patterns (reply_precision)

    def requests(self) -> list[int]:
        """Every request of the call sent so far (a write's ``written`` once granted)."""
        return self.ids + [rid for w in self.writes for rid in w.requests()]


@dataclass
class Pending:
    """A call in flight: its requests (``sent``) or its host group's call (``host``),
    and, for device outputs, the host buffers to copy to them once filled
    (``staged``). ``keep`` holds host copies of device sums the servers may read
    in place until they answered."""
    what: str
    sent: Sent | None = None
    host: HostCall | None = None
    staged: Staged | None = None
    keep: list = field(default_factory=list)


@dataclass
class OpenRound:
    """A whole-model pushpull between its two phases (:meth:`Exchange.open_model`,
    :meth:`Exchange.close_model`): phase 1 ran, the servers hold the round open.
    ``terms``: every key's chunks' phase-1 terms, keys in the call's order, chunks in
    key order (what ``Optimizer.model_sums`` takes: a torch twin's ``[norm,
    overflowed]`` per chunk), the same on every worker."""
    what: str
    pending: Pending
    sources: list
    targets: list
    wire: Wire
    raw: dict                  # {wire id: (round number, terms)}
    terms: list
    closed: bool = False


def key_terms(sources, terms: dict) -> list:
    """Every key's chunks' terms ([[terms of chunk] per chunk] per key of
    ``sources``) from phase 1's {wire id: (round number, terms)}."""
    return [[terms[tuple(c.wire_id)][1] for c in info.chunks] for info, _ in sources]


# the bytes of a message's 'rows' bitmaps (lazy updates of row-sparse pushes on dense
# keys, kvstore.rows.lazy): within the servers' header limit (protocol MAX_HEADER_BYTES)
ROWS_HEADER_BYTES = 512 << 10


def row_marks(infos, rows: dict | None, what: str) -> dict:
    """{wire id: its chunk's ``rows`` entry} for the keys of ``infos`` in ``rows`` (a
    store's {key: unique row ids}: those a row-sparse push named, updated lazily).
    Raises InvalidArgumentError, before anything is sent, where a chunk's entry
    alone would not fit in a request's header."""
    marks: dict = {}
    if not rows:
        return marks
    for info in infos:
        named = rows.get(info.key)
        width = int(np.prod(info.shape[1:], dtype=np.int64))
        if named is None or width == 0:
            continue
        for chunk in info.chunks:
            if lazy.field_bytes(width, chunk.start, chunk.stop) > ROWS_HEADER_BYTES:
                raise InvalidArgumentError(
                    f"{what}: key {info.key!r} has {chunk.stop - chunk.start} values of rows {width} wide in one "
                    "chunk: which rows a row-sparse push named would not fit in a request; lower "
                    "KVSTORE_CHUNK_BYTES, or update it densely (the optimizer's lazy_update=False)")
            marks[tuple(chunk.wire_id)] = lazy.chunk_field(named, width, chunk.start, chunk.stop)
    return marks


def precision_fields(wire_ids, marks: dict) -> dict:
    """The ``precision`` header field of a message of these chunks ({} when all are
    in their keys' dtypes; kvstore.precision)."""
    if not marks or not any(tuple(w) in marks for w in wire_ids):
        return {}
    return {"precision": [marks.get(tuple(w)) for w in wire_ids]}


def reply_fields(wire_ids, marks: dict) -> dict:
    """The ``reply_precision`` header field of a read of these chunks ({} when every
    reply is in its key's dtype; kvstore.server.reply_precision)."""
    if not marks or not any(tuple(w) in marks for w in wire_ids):
        return {}
    return {"reply_precision": [marks.get(tuple(w)) for w in wire_ids]}


def rows_fields(wire_ids, marks: dict) -> dict:
    """The ``rows`` header field of a message of these chunks ({} when none is lazy)."""
    if not marks or not any(tuple(w) in marks for w in wire_ids):
        return {}
    return {"rows": [marks.get(tuple(w)) for w in wire_ids]}


def cut_for_rows(order: list, wire_ids: dict, marks: dict) -> list:
    """:func:`kvstore.sharding.pieces`' runs ``order`` cut further so that no message's
    ``rows`` bitmaps pass :data:`ROWS_HEADER_BYTES` (``wire_ids``: each server's)."""
    if not marks:
        return order
    out = []
    for server, lo, hi in order:
        start, size = lo, 0
        for i in range(lo, hi):
            mark = marks.get(tuple(wire_ids[server][i]))
            n = len(mark[2]) if mark is not None else 0
            if size and size + n > ROWS_HEADER_BYTES:
                out.append((server, start, i))
                start, size = i, 0
            size += n
        out.append((server, start, hi))
    return out


def by_server(infos_and_flats) -> dict[int, tuple[list, list]]:
    """{server: (wire ids, flat slices)} for (info, flat array) pairs."""
    groups: dict[int, tuple[list, list]] = {}
    for info, flat in infos_and_flats:
        for chunk in info.chunks:
            ids, parts = groups.setdefault(chunk.server, ([], []))
            ids.append(chunk.wire_id)
            # a key of one chunk is the whole array (a slice costs a view, ~5 us on cupy)
            parts.append(flat if chunk.start == 0 and chunk.stop == flat.size else flat[chunk.start:chunk.stop])
    return groups


class Exchange:
    """Sends a worker's calls to the servers and fills their outputs. ``mode``: the
    servers' (kvstore.modes: whether they take writes into their sums); ``leads()``: whether this worker acts for all at
    collective steps; ``wire()``: the store's :class:`Wire` at each call;
    ``staging``: how device values cross to the host (None: host values only)."""

    def __init__(self, client: Client, config: Config, mode: ConsistencyMode, leads: Callable[[], bool],
                 wire: Callable[[], Wire], timeline: Timeline | None = None,
                 staging: Staging | None = None):
        self._client, self._config, self._mode = client, config, mode
        self._leads, self._wire, self._timeline, self._staging = leads, wire, timeline, staging
        self.host: HostGroup | None = None
        # each server's link's writer into its sums (shared memory; None: it takes pushes only)
        self._writers: list[Writer | None] = [link.writer for link in client.links]
        # float32 reply buffers of float16/bfloat16 outputs (multi-precision), by key, while no
        # call holds them: fresh memory each call would cost its page faults every step
        self._wide: dict = {}

    # -- collaborators ---------------------------------------------------------------------
    @property
    def staging(self) -> Staging | None:
        """How device values cross to the host (None: host values only)."""
        return self._staging

    def join_host(self, host: HostGroup) -> None:
        """Hand pushpulls to ``host``'s group (formed); its leader pushes through here."""
        host.attach(self._push_for_host, self._fill_for_host, self._replied_for_host, self._client.progress)
        self.host = host

    def _push_for_host(self, what, sources, targets, group) -> Sent:
        """The leader's push of its host's sum, for every worker of the group (a sum
        on a device crosses to the host first unless the links move device memory)."""
        wire = self._wire()
        keep: list = []
        if self._staging is not None and not self._device_direct(ops.PUSHPULL, sources, wire):
            sources, keep = self._staging.to_host(sources, None)
        sent = self._send(ops.PUSHPULL, what, sources, targets, wire, paced=True, group=group)
        sent.keep = keep
        return sent

    def _fill_for_host(self, sent: Sent) -> list:
        self._fill_sent(sent)
        return [flat for _, flat, _ in sent.fills]

    def _replied_for_host(self, sent: Sent) -> bool:
        return self._client.replied(sent.requests())

    def flush(self, what: str) -> None:
        """Complete every call in flight (the host group's first) and raise their errors."""
        if self.host is not None:
            self.host.flush(what)
        self._client.flush(what)

    # -- calls -----------------------------------------------------------------------------
    def send(self, op: str, what: str, sources, targets, paced: bool = False, rows: dict | None = None,
             routes: Routes | None = None) -> Pending:
        """Send ``op`` with ``sources`` [(info, flat)] (None: no data) for ``targets``
        [(info, [outs])]; :meth:`fill` completes it. Replies that arrive in between
        are copied into the outputs' buffers whenever this worker next waits for
        anything. ``paced``: it may wait for replies to keep a window in flight
        (transport/pace.py). ``rows``: {key: row ids} of sources whose update is lazy
        (a row-sparse push on a dense key; they go with the ``rows`` field).
        ``routes``: where the chunks of ``targets`` (and of ``sources``, the same keys
        in the same order) go, from the call's plan (kvstore.worker.plans); None:
        grouped here."""
        pending = Pending(what)
        wire = self._wire()
        via_group = self.host is not None and op == ops.PUSHPULL and sources is not None
        narrowed: dict = {}
        if self._staging is not None:
            if via_group:
                # the host's group moves device values itself when all of it can; the
                # leader's outputs are filled by its servers' replies
                assert self.host is not None
                keep_sources = self.host.on_device
                outputs_on_device = keep_sources and (not self.host.leads or self._client.reads_device)
            else:
                keep_sources = outputs_on_device = self._device_direct(op, sources, wire)
            if sources is not None and not keep_sources:
                # a pushpull's sums may go to shared memory that co-located servers
                # read in place: it stays alive (``keep``) until they answered
                alloc = self._shared_bytes if op == ops.PUSHPULL else None
                sources, pending.keep = self._staging.to_host(sources, alloc)
            narrowed = self._staged_precisions(targets, wire)
            targets, pending.staged = self._staging.outputs(targets, on_device=outputs_on_device, dtypes=narrowed)
        if via_group:
            assert self.host is not None
            if not self.host.leads:     # (replicas) the leader's push carries ours: count it as ours
                self._client.pushed_by_host([chunk.wire_id for info, _ in sources for chunk in info.chunks])
            pending.host = self.host.start(what, sources, targets)    # the host sums it first
            return pending
        if (op == ops.PUSHPULL and sources is not None and wire.splits_norms
                and any(wire.layerwise(info) for info, _ in sources)):
            # keys cut over servers under LARS/LAMB: two phases, done before this returns
            wire.check([info for info, _ in sources], what)
            layered = [wire.layerwise(info) for info, _ in sources]
            self._push_layerwise(what, [s for s, lw in zip(sources, layered) if lw],
                                 [t for t, lw in zip(targets, layered) if lw], wire, rows)
            sources = [s for s, lw in zip(sources, layered) if not lw]
            targets = [t for t, lw in zip(targets, layered) if not lw]
            routes = None                       # (made for every key of the call)
        pending.sent = self._send(op, what, sources, targets, wire, paced, rows=rows, routes=routes, staged=narrowed)
        return pending

    def _staged_precisions(self, targets, wire: Wire) -> dict:
        """{key: the dtype its reply comes in} for the keys with device outputs whose
        replies the servers round (multi-precision: float16, or uint16 patterns for
        bfloat16): the staging's block for them is of that dtype. Not for the two
        phases of layer-wise optimizers, whose replies stay float32."""
        if not wire.low_precision or wire.splits_norms or self._staging is None:
            return {}
        found = {}
        for info, outs in targets:
            name = wire.reply_precision(info, outs)
            if name is not None and any(self._staging.holds(o) for o in outs):
                found[info.key] = precision.WIRE_DTYPES[name]
        return found

    def fill(self, pending: Pending) -> None:
        """Wait for ``pending``'s replies and fill its outputs."""
        if pending.host is not None:
            assert self.host is not None            # it made the call
            self.host.finish(pending.host)
        else:
            assert pending.sent is not None
            self._fill_sent(pending.sent)
        if pending.staged is not None:
            pending.staged.deliver()
        pending.keep.clear()

    def _device_direct(self, op: str, sources, wire: Wire) -> bool:
        """Whether a call to the servers keeps its device values on the devices: every
        server's link moves device memory itself (cuda_ipc: pushes by reference, replies
        device to device), and nothing needs them on the host first (compression, the
        two phases of layer-wise optimizers). A host group's calls decide by the group
        (:meth:`send`)."""
        if not self._client.reads_device or wire.compressor is not None:
            return False
        return sources is None or not (wire.splits_norms and any(wire.layerwise(info) for info, _ in sources))

    def _flat_target(self, info, out, what: str, wire: Wire) -> tuple[Any, bool]:
        """``arrays.flat_target``, a device block of the staging as it is, and a float32
        buffer for a float16/bfloat16 output of a float32 key (multi-precision)."""
        if self._staging is not None and self._staging.holds(out):
            return arrays.flat_view(out), True
        buffer = wire.out_buffer(info, out) if wire.low_precision else None
        if buffer is not None:
            return buffer, False
        return arrays.flat_target(out, what)

    def _shared_bytes(self, nbytes: int) -> np.ndarray:
        return self._client.shared_empty(nbytes, np.uint8)

    def _send(self, op: str, what: str, sources, targets, wire: Wire, paced: bool = False,
              group=None, rows: dict | None = None, routes: Routes | None = None,
              staged: dict | None = None) -> Sent:
        """The requests of one call; ``group``: the workers a host's sum speaks for;
        ``rows``, ``routes``: see :meth:`send`; ``staged``: {key: dtype} of the staging's
        blocks that receive rounded replies (:meth:`_staged_precisions`)."""
        call = self._timeline.begin(op, [info.key for info, _ in targets]) if self._timeline is not None else None
        lowp: dict = {}
        if sources is not None:
            wire.check([info for info, _ in sources], what)
            lowp = wire.precisions(sources, what)
        flats, wide = [], []
        narrow: dict = {}          # {wire id: precision} of replies the servers round (multi-precision)
        patterns: set = set()
        for info, outs in targets:
            if staged and info.key in staged:          # the staging's block, in the reply's dtype
                flats.append((info, arrays.flat_view(outs[0]), True))
                for chunk in info.chunks:
                    narrow[tuple(chunk.wire_id)] = precision.NAMES[staged[info.key]]
                continue
            name = wire.reply_precision(info, outs) if wire.low_precision else None
            if name is not None and not (self._staging is not None and self._staging.holds(outs[0])):
                flat, direct = arrays.wire_target(outs[0], name, what)
                flats.append((info, flat, direct))
                if name == precision.BFLOAT16:
                    patterns.add(id(flat))
                for chunk in info.chunks:
                    narrow[tuple(chunk.wire_id)] = name
                continue
            buffer = self._wide.pop(info.key, None) if wire.low_precision else None
            if buffer is None or buffer.size != info.size:
                buffer = wire.out_buffer(info, outs[0]) if wire.low_precision else None
            if buffer is not None and not (self._staging is not None and self._staging.holds(outs[0])):
                flats.append((info, buffer, False))
                wide.append((info.key, buffer))
            else:
                flats.append((info, *self._flat_target(info, outs[0], what, wire)))
        if routes is not None:
            dests = routes.pick([flat for _, flat, _ in flats])
            datas = routes.pick([flat for _, flat in sources]) if sources is not None else {}
        else:
            dests = by_server([(info, flat) for info, flat, _ in flats])
            datas = by_server(sources) if sources is not None else {}
        fields = wire.fields() if sources is not None else {}
        marks = row_marks([info for info, _ in sources], rows, what) if sources is not None else {}
        stage = sources is not None and wire.compressor is None
        # (a write into the servers' float32 sums cannot take low-precision chunks: they are pushed)
        # (nor can its reply be rounded: a write's values come back as they are in the sums)
        write_in = stage and not lowp and not narrow and op == ops.PUSHPULL and self._mode.write_in and group is None
        if group is not None:
            fields["group"] = group
        ids: list[int] = []
        writes: list[Writing] = []
        client = self._client
        flight = client.pace.start(dests, what, client if paced else None)
        # every worker goes in the same order: a round's second writer adds while the
        # first copies the next message, and replies start early (starting at
        # different places was slower: the first rounds complete only half-way)
        order = cut_for_rows(pieces(dests, client.pace.limits()), {s: g[0] for s, g in dests.items()}, marks)
        for server, lo, hi in order:
            wire_ids, parts = dests[server][0][lo:hi], dests[server][1][lo:hi]
            payload = wire.compress(wire_ids, datas.get(server, ([], []))[1][lo:hi])
            writer = self._writers[server] if write_in else None
            if writer is not None:
                # what the server's link can write straight into its sums (no staging
                # copy); the rest (small chunks, gradients from empty()) goes as a pushpull,
                # and so do lazy chunks: a write names every value, a pushpull its rows
                dense = [i for i, w in enumerate(wire_ids) if tuple(w) not in marks]
                writing = writer.write(what, [wire_ids[i] for i in dense], [payload[i] for i in dense],
                                       [parts[i] for i in dense]) if dense else None
                if writing is not None:
                    writes.append(writing)
                    # grants already here are written now: the other workers' turns wait on ours
                    client.progress(what)
                    rest = sorted(set(range(len(wire_ids))) - {dense[i] for i in writing.chosen})
                    wire_ids, parts, payload = ([x[i] for i in rest] for x in (wire_ids, parts, payload))
                    if not parts:
                        continue
            # pushpull waits for its replies, so gradients in our shared memory
            # (empty()) may be read by the servers in place
            flight.admit(server)
            rid, _ = client.request(server, op, what, payload,
                                    RequestOptions(stage=wire_ids, in_place=True, into=parts) if stage
                                    else RequestOptions(into=parts),
                                    chunks=wire_ids, **fields, **rows_fields(wire_ids, marks),
                                    **precision_fields(wire_ids, lowp), **reply_fields(wire_ids, narrow))
            flight.sent(server, rid)
            ids.append(rid)
        if call is not None:
            call.sent()
        return Sent(ids, writes, flight, what, [(outs, flat, direct)
                                                for (_, outs), (_, flat, direct) in zip(targets, flats)], call,
                    wide=wide, patterns=patterns)

    def _fill_sent(self, sent: Sent) -> None:
        call, what = sent.call, sent.what
        if call is not None:
            call.waiting()
        # the replies, and the grants of writes...
        self._client.wait(sent.ids + [w.request for w in sent.writes], what)
        # ...whose `written` requests they sent (none for a refused write: its error is raised)
        self._client.wait([w.written for w in sent.writes if w.written is not None], what)
        self._client.pace.done(sent.flight)   # (sizes the next calls' messages)
        if call is not None:
            call.copying()
        for outs, flat, direct in sent.fills:
            if sent.patterns and id(flat) in sent.patterns:
                fill_bfloat16(outs, flat, direct)
            else:
                fill_outputs(outs, flat, direct, what)
        self._wide.update(sent.wide)      # (free for the next call of these keys)
        if call is not None:
            call.done()

    def push(self, what: str, items, wait_sent: bool = True, rows: dict | None = None) -> None:
        """Push ``items`` [(info, flat)]; returns once the caller may reuse its buffers
        (large values are sent without a copy and waited for; ``wait_sent=False``:
        the caller keeps them). ``rows``: see :meth:`send`."""
        keep: list = []
        wire = self._wire()
        if self._staging is not None and not self._device_direct(ops.PUSH, items, wire):
            items, keep = self._staging.to_host(items, None)
        wire.check([info for info, _ in items], what)
        lowp = wire.precisions(items, what)
        layered = [item for item in items if wire.layerwise(item[0])]
        if layered:                     # keys cut over servers under LARS/LAMB: two phases
            self._push_layerwise(what, layered, None, wire, rows)
            items = [item for item in items if not wire.layerwise(item[0])]
            if not items:
                return
        call = self._timeline.begin(ops.PUSH, [info.key for info, _ in items]) if self._timeline is not None else None
        trackers = []
        fields = wire.fields()
        stage = wire.compressor is None
        groups = by_server(items)
        marks = row_marks([info for info, _ in items], rows, what)
        for server, lo, hi in cut_for_rows(pieces(groups, self._client.pace.limits()),
                                           {s: g[0] for s, g in groups.items()}, marks):
            wire_ids = groups[server][0][lo:hi]
            parts = wire.compress(wire_ids, groups[server][1][lo:hi])
            big = wait_sent and any(p.nbytes >= self._config.zero_copy_bytes for p in parts)
            _, tracker = self._client.request(server, ops.PUSH, what, parts,
                                              RequestOptions(track=big, stage=wire_ids if stage else None),
                                              chunks=wire_ids, **fields, **rows_fields(wire_ids, marks),
                                              **precision_fields(wire_ids, lowp))
            if tracker is not None:
                trackers.append(tracker)
        # the caller may reuse its gradient buffers once we return
        self._client.wait_sent(trackers, what)
        if call is not None:
            call.done()

    def init(self, what: str, flats) -> None:
        """The leader's part of a collective init: ``flats`` [(info, flat)] to their servers."""
        ids = [self._client.request(server, ops.INIT, "init", parts, chunks=wire_ids)[0]
               for server, (wire_ids, parts) in by_server(flats).items()]
        self._client.wait(ids, what)

    # -- norms across servers (LARS, LAMB on keys cut into chunks; kvstore.server.sync) --------
    def _push_layerwise(self, what: str, sources: list, targets: list | None, wire: Wire,
                        rows: dict | None = None) -> None:
        """Push ``sources`` [(info, flat)] of layer-wise keys: every worker pushes with
        ``norms`` and is answered, once each chunk's round is complete, with that
        chunk's sums of squares; the leader adds them up per key (in chunk order) and
        sends the sums (``apply_norms``), the other workers pull. Returns once the
        values are in ``targets`` [(info, outputs)] (None: a push; the leader returns
        once the servers stepped)."""
        terms = self._layerwise_terms(what, sources, wire, rows)
        whole = None
        if wire.model_sums is not None:     # every worker, from the same terms: the same sums
            whole = wire.model_sums(key_terms(sources, terms))
        self._layerwise_apply(what, sources, targets, wire, terms, whole)

    def _layerwise_terms(self, what: str, sources: list, wire: Wire, rows: dict | None = None) -> dict:
        """Phase 1: push ``sources`` with ``norms``; returns {wire id: (round number,
        terms)} of every chunk, once every chunk's round is complete (on every
        worker: each push is answered with its chunks' terms)."""
        terms: dict = {}

        def keep(wire_ids):
            def on_reply(header, values):
                rounds = header.get("rounds")
                if not isinstance(rounds, list) or len(rounds) != len(wire_ids) or len(values) != len(wire_ids):
                    raise ProtocolError(f"{what}: a layer-wise push's reply carries no terms for its chunks")
                for wid, number, a in zip(wire_ids, rounds, values):
                    terms[tuple(wid)] = (number, np.asarray(a, np.float64).reshape(-1).tolist())
            return on_reply
        groups, fields = by_server(sources), wire.fields()
        lowp = wire.precisions(sources, what)       # (the servers widen them before taking the terms)
        marks = row_marks([info for info, _ in sources], rows, what)    # LARS's lazy phase 2
        ids = []
        for server, lo, hi in cut_for_rows(pieces(groups, self._client.pace.limits()),
                                           {s: g[0] for s, g in groups.items()}, marks):
            wire_ids = groups[server][0][lo:hi]
            parts = wire.compress(wire_ids, groups[server][1][lo:hi])
            ids.append(self._client.request(server, ops.PUSH, what, parts, RequestOptions(on_reply=keep(wire_ids)),
                                            chunks=wire_ids, norms=True, **fields,
                                            **rows_fields(wire_ids, marks), **precision_fields(wire_ids, lowp))[0])
        self._client.wait(ids, what)
        return terms

    def _layerwise_apply(self, what: str, sources: list, targets: list | None, wire: Wire, terms: dict,
                         whole: list | None) -> None:
        """Phase 2: the leader sends every chunk its sums (``whole``: the same for
        every chunk, a whole-model optimizer's; None: each key's chunks' terms added
        up), the other workers pull; returns once ``targets`` are filled."""
        flats = [(info, *self._flat_target(info, outs[0], what, wire)) for info, outs in targets or ()]
        if not self._leads():
            if targets:
                self._fill_sent(self._send(ops.PULL, what, None, targets, wire))
            return
        sums: dict[Any, list] = {}
        for info, _ in sources:
            total: list = []
            for chunk in info.chunks:
                part = terms[tuple(chunk.wire_id)][1]
                total = list(part) if not total else [a + b for a, b in zip(total, part)]
            sums[info.key] = total if whole is None else whole
        groups = by_server(sources)
        dests = by_server([(info, flat) for info, flat, _ in flats]) if targets else {}
        keys = {tuple(c.wire_id): info.key for info, _ in sources for c in info.chunks}
        ids = []
        for server, (wire_ids, _) in groups.items():
            ids.append(self._client.request(
                server, ops.APPLY_NORMS, what, [], RequestOptions(into=dests[server][1] if targets else None),
                chunks=wire_ids, sums=[sums[keys[tuple(w)]] for w in wire_ids],
                rounds=[terms[tuple(w)][0] for w in wire_ids], values=bool(targets))[0])
        self._client.wait(ids, what)
        for (_, outs), (_, flat, direct) in zip(targets or (), flats):
            fill_outputs(outs, flat, direct, what)

    # -- a whole-model pushpull held open between its phases (kvstore.torch.Trainer) -----------
    def open_model(self, what: str, sources, targets) -> OpenRound:
        """Phase 1 of a whole-model pushpull (an optimizer with ``Optimizer.whole_model``,
        every key through the two phases): push ``sources`` [(info, flat)] and return,
        once every chunk's round is complete, an :class:`OpenRound` holding every
        chunk's terms; the servers wait, the round at the head of each chunk's queue,
        until :meth:`close_model` gives them the sums. Raises InvalidArgumentError
        when the store's optimizer is not a whole-model one."""
        wire = self._wire()
        if wire.model_sums is None:
            raise InvalidArgumentError(f"{what}: holding a pushpull open between its two phases needs a whole-model "
                                       "optimizer on the servers (a torch twin with clip_grad_norm or grad_scale)")
        pending = Pending(what)
        if self._staging is not None:         # the two phases read host values and answer into host memory
            sources, pending.keep = self._staging.to_host(sources, None)
            targets, pending.staged = self._staging.outputs(targets)
        wire.check([info for info, _ in sources], what)
        terms = self._layerwise_terms(what, sources, wire)
        return OpenRound(what, pending, list(sources), list(targets), wire, terms,
                         key_terms(sources, terms))

    def close_model(self, opened: OpenRound, sums: list) -> None:
        """Phase 2 of :meth:`open_model`'s round with ``sums`` (the optimizer's
        ``model_sums``, or what the caller decided from ``opened.terms``: the same on
        every worker): the leader sends them, every other worker pulls; returns once
        the outputs are filled. A round closes once."""
        if opened.closed:
            raise InvalidArgumentError(f"{opened.what}: this round's second phase was sent already")
        opened.closed = True
        self._layerwise_apply(opened.what, opened.sources, opened.targets, opened.wire, opened.raw, list(sums))
        if opened.pending.staged is not None:
            opened.pending.staged.deliver()
        opened.pending.keep.clear()
