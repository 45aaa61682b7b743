"""Summing on the host before pushing (``KVSTORE_HOST_REDUCE=1``, dist_sync only).

With k workers on one machine (one process per GPU, as torchrun starts them) each
would push its whole gradient, so the machine's link carries k times the
gradient. Here the workers of a host hand their ``pushpull`` gradients to the
lowest rank among them, the *leader*, which sums them and pushes the host's sum
once, naming the workers it speaks for (the header field ``group``: a server's
round counts all of them, kvstore.server.state). The reply comes to the leader,
which hands the pulled values back. BytePS does the same.

Who is together: every worker that has it on binds a ZeroMQ ROUTER (ipc, and tcp
on loopback) before it registers, and registers that advert (with its host
identity, kvstore.transport.endpoints) as its address; the registration lists
every worker's. Workers whose identities match form a group (elastic jobs do not:
their members change). A worker with it off, or alone on its host, pushes as
before, and mixing is fine: a server counts whoever a push names.

Messages between a member (DEALER) and its leader (ROUTER) are the data plane's
frames (kvstore.protocol.codec), their ops named in kvstore.hostgroup.wire: ``hello``
and ``welcome`` when the group forms, ``sum`` (a member's gradients) and ``result``
or ``error`` (the leader's answer) at each pushpull, ``bye`` at a member's close.

On GPUs (``dist_device_sync`` whose GPUs can export memory, every worker of the
group alike: ``hello`` and ``welcome`` carry ``devices``), the gradients and the
results stay on the devices: a member copies its device sums into exportable
slots (kvstore.devices.slots) and sends ``dev`` references (docs/protocol.md 2.7);
the leader sums them on its GPU straight from the members' memory, pushes the
host's sum (by reference too over the cuda_ipc transport), and hands the results
out as references to its own slots, which members copy device to device. Each
side waits for its stream before the other may read, and a member says in every
message which results it has copied (``consumed``), so the leader reuses a result
slot only then. No host memory on the way, unless the leader's servers need it
(the exchange stages the sum then).

The leader never blocks at a call's start (a member may wait for an earlier
result first): whenever it waits for anything host-related it *pumps*: takes in
members' gradients, pushes every call whose gradients are all in (in call
order), and hands out the results of calls whose replies are in. Every wait is
bounded and watches the peers (kvstore.hostgroup.link). Members whose calls differ
from the leader's (keys, shapes, dtypes) all get an InvalidArgumentError and
nothing is pushed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from ..devices import arrays as _arrays
from ..devices.base import Accelerators
from ..devices.slots import DeviceSlots
from ..devices.staging import copy_into
from .. import errors
from ..errors import DeadlineError, InvalidArgumentError, KVStoreError, NodeFailedError, ProtocolError
from . import wire
from .link import SLICE, HostLink, names, pid_of
from ..worker.store import fill_outputs
from ..transport import endpoints

log = logging.getLogger(__name__)

LINGER = 2000         # ms a member's close may take to deliver its bye
PARTS_POLL = 0.002    # seconds a leader waits for members at a time while replies may come
# the holders of device slots (kvstore.devices.slots): a member's sums by call, the
# leader's results by (RESULTS, call), reused once every member copied them
SUMS, RESULTS = "sums", "results"
RAISED = {name: getattr(errors, name) for name in (
    "InvalidArgumentError", "NodeFailedError", "DeadlineError", "RemoteError", "ProtocolError")}


@dataclass
class HostCall:
    seq: int
    what: str
    sig: str
    keys: str
    sources: list = field(default_factory=list)   # [(info, flat)] (the leader's own)
    targets: list = field(default_factory=list)   # [(info, outs)]
    parts: dict = field(default_factory=dict)     # (leader) member rank -> its arrays
    sent: object = None                           # (leader) the store's handle, once pushed
    done: bool = False                            # (leader) filled and handed out
    error: BaseException | None = None
    result: list | None = None                    # (member) the pulled values


class HostGroup:
    """This worker's part in its host's group. Example (what DistStore does)::

        group = HostGroup(config)                 # binds; register group.advert
        if group.form(registration, membership):  # False: alone (or elastic); closed
            group.attach(push, fill, replied, progress)   # the store's side
            call = group.start(what, sources, targets)
            group.finish(call)
    """

    def __init__(self, config, accelerators: Accelerators | None = None):
        self._config = config
        self._link = HostLink(config)
        self.advert = self._link.advert
        self.ranks: tuple = ()
        self.leader: int | None = None
        self._rank = None
        # the worker's GPUs, when they can export memory: the group may then keep
        # device values on the devices (on_device, decided when it forms)
        self._acc = accelerators if accelerators is not None and accelerators.sharing is not None else None
        self._slots = DeviceSlots(self._acc) if self._acc is not None else None
        self.on_device = False
        self._consumed = 0            # (member) the last call whose results it copied
        self._consumed_by: dict = {}  # (leader) member rank -> its last copied call
        self._peers: dict = {}        # (leader) member rank -> its ROUTER identity
        self._ranks_of: dict = {}     # (leader) and back
        self._seq = 0
        self._calls: dict = {}        # seq -> HostCall not yet finished by the caller
        self._early: dict = {}        # (leader) (rank, seq) -> arrays that came before the call
        self._byes: set = set()       # (leader) members that closed cleanly

    @property
    def bytes_sent(self) -> int:      # to the others of the group
        return self._link.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self._link.bytes_received

    @property
    def leads(self) -> bool:
        return self._rank == self.leader

    # -- forming -------------------------------------------------------------------
    def form(self, registration, membership) -> bool:
        """Find this worker's group in ``registration`` (every worker's advert) and
        connect it; False (and closed) when there is none to form. ``membership``:
        the job's (its abort flag ends every wait)."""
        self._rank = registration.rank
        mine = endpoints.Advert.parse(self.advert).host
        adverts = {}
        for rank, text in enumerate(registration.worker_addrs):
            if text:
                advert = endpoints.Advert.parse(text)
                if advert.host == mine:
                    adverts[rank] = advert
        self.ranks = tuple(sorted(adverts))
        if registration.elastic is not None or len(self.ranks) < 2:
            log.info("[worker:%d] KVSTORE_HOST_REDUCE: %s; pushing directly", self._rank,
                     "not in elastic jobs" if registration.elastic is not None
                     else "no other worker with it on this host")
            self.close()
            return False
        self.leader = self.ranks[0]
        self._link.watch(membership, {r: pid_of(registration.workers[r]) for r in self.ranks})
        deadline = time.monotonic() + self._config.timeout
        able = self._acc is not None
        if self.leads:
            devices = {}
            while set(self._peers) != set(self.ranks[1:]):
                ident, header, _ = self._link.receive(deadline, "forming the host group",
                                                      [r for r in self.ranks[1:] if r not in self._peers])
                if header["op"] == wire.HELLO and header.get("rank") in self.ranks[1:]:
                    self._peers[header["rank"]] = ident
                    self._ranks_of[ident] = header["rank"]
                    devices[header["rank"]] = header.get("devices") is True
                else:
                    log.warning("host group: unexpected %r before the group formed; ignored", header["op"])
            # device values by reference only if every worker of the group can
            self.on_device = able and all(devices.values())
            for rank, ident in self._peers.items():
                self._link.send(ident, {"op": wire.WELCOME, "id": 0, "devices": self.on_device}, to=[rank])
        else:
            self._link.connect(adverts[self.leader])
            self._link.send(None, {"op": wire.HELLO, "id": 0, "rank": self._rank, "devices": able},
                            to=[self.leader])
            _, header, _ = self._link.receive(deadline, "joining the host group", [self.leader])
            if header["op"] != wire.WELCOME:
                raise ProtocolError(f"host group: expected welcome from worker {self.leader}, got {header['op']!r}")
            self.on_device = able and header.get("devices") is True
        if self.on_device:
            assert self._acc is not None and self._acc.sharing is not None
            sharing, index = self._acc.sharing, self._acc.current()
            sharing.allow([pid for pid in self._link.pids.values() if pid is not None])
            self._link.resolve = {"dev": lambda seg, off, dtype, shape: sharing.open(index, seg, off, dtype, shape)}
        log.info("[worker:%d] host group %s: worker %d sums and pushes for %s%s", self._rank,
                 list(self.ranks), self.leader, "them" if self.leads else "this worker",
                 " (device values by reference)" if self.on_device else "")
        return True

    # -- calls ---------------------------------------------------------------------
    def attach(self, push, fill, replied, progress) -> None:
        """The store's side (used by the leader): ``push(what, sources, targets,
        group)`` sends a pushpull and returns its handle; ``fill(handle)`` completes
        it and returns the filled flat arrays; ``replied(handle)``: whether every
        reply of it is in; ``progress(what, timeout)`` takes replies in, waiting up
        to ``timeout`` for the first."""
        self._push, self._fill, self._replied, self._progress = push, fill, replied, progress

    def start(self, what: str, sources, targets) -> HostCall:
        """A pushpull's start: the gradients go to the leader (from a member), or
        out as the host's sum once every member's is in (the leader)."""
        self._seq += 1
        sig, keys = _signature(sources, targets)
        call = HostCall(self._seq, what, sig, keys, sources, targets)
        self._calls[call.seq] = call
        if self.leads:
            for rank in self.ranks[1:]:
                if (rank, call.seq) in self._early:
                    call.parts[rank] = self._early.pop((rank, call.seq))
            self._pump(0, None, what)
        else:
            # not copied: the caller leaves ``sources`` alone until finish, and the
            # leader has read them before it answers; device values go by reference
            # from our slots, held until then
            flats = [flat for _, flat in sources]
            shared = None
            if self.on_device:
                assert self._slots is not None
                shared = self._slots.places(call.seq, [(SUMS, repr(info.key)) for info, _ in sources], flats)
            self._link.send(None, {"op": wire.SUM, "id": call.seq, "sig": sig, "keys": keys,
                                   "consumed": self._consumed}, flats, copy=False, to=[self.leader],
                            shared=shared)
        return call

    def finish(self, call: HostCall) -> None:
        """Wait until ``call`` completed; its outputs are filled."""
        try:
            self._await(call, call.what)
        finally:
            self._calls.pop(call.seq, None)
        if call.error is not None:
            raise call.error
        if not self.leads:
            devices = self._write(call.targets, call.result, call.what)
            if self.on_device:
                assert self._acc is not None and self._acc.sharing is not None
                # the copies out of the leader's slots are done: it may reuse them
                for index in sorted(devices):
                    self._acc.sharing.publish(index)
                self._consumed = max(self._consumed, call.seq)

    def flush(self, what: str) -> None:
        """Complete every call started (before a barrier, checkpoint or close); their
        own errors are raised by their ``finish``."""
        for call in list(self._calls.values()):
            try:
                self._await(call, what)
            except BaseException:
                self._calls.pop(call.seq, None)
                raise

    def _await(self, call: HostCall, what: str) -> None:
        deadline = time.monotonic() + self._config.timeout
        while not self._complete(call):
            if self.leads:
                self._pump(SLICE, deadline, what)
            else:
                self._take(self._link.receive(deadline, what, [self.leader]))

    def _complete(self, call: HostCall) -> bool:
        return call.done if self.leads else (call.result is not None or call.error is not None)

    # -- the leader ----------------------------------------------------------------
    def _pump(self, timeout: float, deadline: float | None, what: str) -> None:
        """Take in members' gradients (waiting up to ``timeout``), push the calls whose
        gradients are all in, hand out the results of calls the servers answered."""
        waiting = self._waiting_for()
        if deadline is not None and time.monotonic() > deadline:
            raise DeadlineError(f"{what}: {names(waiting) if waiting else 'the servers'} did not "
                                f"complete the host's sum within {self._config.timeout:g}s")
        # members' gradients come on our socket, the servers' replies on the store's:
        # wait on the one that is due (briefly on ours while both are)
        if self._link.ready(min(timeout, PARTS_POLL) if waiting else 0):
            while self._link.ready(0):
                self._take(self._link.receive(None, what, []))
        self._progress(what, 0 if waiting else timeout)
        self._link.check_alive(what, self._waiting_for())
        for call in sorted(self._calls.values(), key=lambda c: c.seq):
            if call.sent is None and not call.done:
                if len(call.parts) < len(self.ranks) - 1:
                    break          # calls go out in order
                self._push_sum(call)
        for call in list(self._calls.values()):
            if call.sent is not None and not call.done and self._replied(call.sent):
                self._hand_out(call)

    def _waiting_for(self) -> list:
        open_calls = [c for c in self._calls.values() if c.sent is None and not c.done]
        return sorted({r for c in open_calls for r in self.ranks[1:] if r not in c.parts})

    def _push_sum(self, call: HostCall) -> None:
        try:
            for rank, (sig, keys, arrays) in sorted(call.parts.items()):
                if sig != call.sig:
                    raise InvalidArgumentError(
                        f"{call.what}: worker {rank} (on this host) made a different call: it pushed "
                        f"{keys} where worker {self._rank} pushed {call.keys}; nothing was sent")
                if len(arrays) != len(call.sources) or any(
                        a.size != flat.size or a.dtype != flat.dtype for a, (_, flat) in zip(arrays, call.sources)):
                    raise ProtocolError(f"{call.what}: worker {rank} (on this host) sent gradients that do "
                                        f"not match its own description ({keys}); nothing was sent")
            # the members' parts in rank order, whatever their arrival: the same bits every run
            ranked = [arrays for _, (_, _, arrays) in sorted(call.parts.items())]
            sums = [(info, self._sum(flat, [arrays[i] for arrays in ranked], call.what))
                    for i, (info, flat) in enumerate(call.sources)]
            if self._acc is not None and any(self._acc.holds(total) for _, total in sums):
                assert self._acc.sharing is not None
                # the members' slots are read: they may reuse them once answered
                for index in {self._acc.index_of(t) for _, t in sums if self._acc.holds(t)}:
                    self._acc.sharing.publish(index)
            call.sent = self._push(call.what, sums, call.targets, list(self.ranks))
        except BaseException as e:
            self._failed(call, e)

    def _sum(self, own, parts: list, what: str):
        """The leader's ``own`` flat value plus the members' ``parts``: on the device of
        ``own`` when it is on one (members' device memory read in place, host parts
        uploaded), else on the host."""
        acc = self._acc
        if acc is None or not acc.holds(own):
            if any(acc is not None and acc.holds(p) for p in parts):
                raise ProtocolError(f"{what}: a member sent device memory for a value this leader "
                                    "holds on the host")
            total = np.array(own, copy=True)
            for p in parts:
                total += p.reshape(-1)
            return total
        index = acc.index_of(own)
        with acc.on(index):
            total = acc.empty(index, own.size, own.dtype)
            acc.copy(total, own.reshape(-1))
            for p in parts:
                if not acc.holds(p):
                    term = acc.to_device(np.ascontiguousarray(p).reshape(-1), index)
                elif acc.index_of(p) != index:
                    term = acc.empty(index, p.size, p.dtype)
                    acc.peer_copy(term, p.reshape(-1))
                else:
                    term = p.reshape(-1)
                acc.add_into(total, term)
        return total

    def _hand_out(self, call: HostCall) -> None:
        try:
            flats = self._fill(call.sent)
        except BaseException as e:
            return self._failed(call, e)
        try:
            shared = None
            if self.on_device:
                # the outputs may change once the call is done: members read our slots,
                # reused once every member says it copied them (``consumed``)
                assert self._slots is not None
                shared = self._slots.places((RESULTS, call.seq), [(RESULTS, i) for i in range(len(flats))], flats)
            for rank in self.ranks[1:]:   # copied: the caller may change its outputs once done
                self._link.send(self._peers[rank], {"op": wire.RESULT, "id": call.seq}, flats, to=[rank],
                                shared=shared)
        except NodeFailedError as e:
            call.error = e
        call.done = True

    def _consumed_from(self, rank: int, header: dict) -> None:
        """(leader) A member's message says which results it has copied: result slots
        every member has copied are free again."""
        consumed = header.get("consumed")
        if not isinstance(consumed, int) or self._slots is None:
            return
        self._consumed_by[rank] = max(self._consumed_by.get(rank, 0), consumed)
        done = min(self._consumed_by.get(r, 0) for r in self.ranks[1:])
        for holder in self._slots.holders():
            if isinstance(holder, tuple) and holder[0] == RESULTS and holder[1] <= done:
                self._slots.release(holder)

    def _failed(self, call: HostCall, error: BaseException) -> None:
        call.error, call.done = error, True
        header = {"op": wire.ERROR, "id": call.seq, "type": type(error).__name__, "message": str(error)}
        for rank in self.ranks[1:]:
            try:
                self._link.send(self._peers[rank], header, to=[rank])
            except KVStoreError:     # that member is gone (or stuck): its own error says so
                pass

    # -- messages ------------------------------------------------------------------
    def _take(self, message) -> None:
        ident, header, arrays = message
        seq = header["id"]
        if self.leads:
            rank = self._ranks_of.get(ident)
            if rank is not None:
                self._consumed_from(rank, header)
            if header["op"] == wire.BYE and rank is not None:
                self._byes.add(rank)
                return
            if header["op"] != wire.SUM or rank is None:
                log.warning("host group: unexpected %r from %r; ignored", header["op"], rank)
                return
            call = self._calls.get(seq)
            part = (header.get("sig"), header.get("keys"), arrays)
            if call is None:
                self._early[(rank, seq)] = part
            else:
                call.parts[rank] = part
            return
        call = self._calls.get(seq)
        if call is None:
            return
        if self._slots is not None:
            self._slots.release(call.seq)     # the leader has read our sums (or failed the call)
        if header["op"] == wire.RESULT:
            call.result = arrays
        elif header["op"] == wire.ERROR:
            kind = RAISED.get(header.get("type"), KVStoreError)
            call.error = kind(f"{header.get('message')} (from worker {self.leader}, which sums this host's pushes)")

    def leave(self, what: str) -> None:
        """A clean close, after :meth:`flush`: a member says bye (it has every result);
        the leader waits for every member's, since closing drops what it still queues."""
        if not self.leads:
            self._link.send(None, {"op": wire.BYE, "id": 0, "consumed": self._consumed}, to=[self.leader])
            self._link.linger = LINGER
            return
        deadline = time.monotonic() + self._config.timeout
        while len(self._byes) < len(self.ranks) - 1:
            self._take(self._link.receive(deadline, what, sorted(set(self.ranks[1:]) - self._byes)))

    def _write(self, targets, results, what: str) -> set:
        """(member) The leader's results into the call's outputs: device to device for
        results by reference into device outputs, uploaded or downloaded across.
        Returns the devices that copies were queued on."""
        if len(results) != len(targets):
            raise ProtocolError(f"{what}: the host's leader returned {len(results)} values for "
                                f"{len(targets)} keys")
        acc = self._acc
        devices: set = set()
        for (info, outs), value in zip(targets, results):
            if value.size != info.size or value.dtype != info.dtype:
                raise ProtocolError(f"{what}: the host's leader returned {value.dtype.name} x {value.size} "
                                    f"for key {info.key!r} ({info.dtype.name} x {info.size})")
            if acc is not None and (acc.holds(value) or any(acc.holds(o) for o in outs)):
                devices |= {acc.index_of(a) for a in (value, *outs) if acc.holds(a)}
                for out in outs:
                    copy_into(acc, out, value)
                continue
            flat, direct = _arrays.flat_target(outs[0], what)
            np.copyto(flat, value.reshape(-1))
            fill_outputs(outs, flat, direct, what)
        return devices

    def close(self) -> None:
        self._link.close()


def _signature(sources, targets) -> tuple[str, str]:
    """(digest, readable) of what a call pushes and pulls: keys, sizes, dtypes."""
    parts: list[tuple] = [(repr(info.key), int(flat.size), flat.dtype.str) for info, flat in sources]
    parts += [("out", repr(info.key), int(info.size), info.dtype.str) for info, _ in targets]
    keys = [f"{k} ({n} x {np.dtype(d).name})" for k, n, d in parts[:len(sources)]]
    text = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
    return hashlib.sha1(repr(parts).encode()).hexdigest(), text


