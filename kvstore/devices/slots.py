"""Exportable device buffers that peers read by reference, each busy until its
holder says the peer is done: the device twin of :class:`kvstore.transport.shm.Slots`.

Used where this process hands device values to a co-located peer without a host
copy: the cuda_ipc link's requests (kvstore/transport/links/cuda_ipc_link.py; a
holder is a request id) and a host group's sums and results
(kvstore/hostgroup/group.py; a holder is a call). Example::

    slots = DeviceSlots(acc)                       # acc.sharing must not be None
    places = slots.stage(17, keys, device_values)  # (segment, offset, "dev") each
    ...                                            # send them; the peer reads them
    slots.release(17)                              # its answer came: reusable
"""

from __future__ import annotations

from typing import NamedTuple

from .arrays import flat_view
from .base import Accelerators

# the most key lists whose slots are remembered (:class:`Chosen`); then it starts again empty
CHOSEN_LIMIT = 256


class Chosen(NamedTuple):
    """The slots a list of keys was staged into last, on one device: taken again as
    they are when all are free and every value is on that device with its slot's
    size and dtype (a training step stages the same keys every call)."""
    device: int
    slots: list
    ids: frozenset          # id() of each slot
    places: list


class DeviceSlots:
    def __init__(self, acc: Accelerators):
        if acc.sharing is None:
            raise ValueError("DeviceSlots needs accelerators whose memory can be exported")
        self._acc = acc
        self._sharing = acc.sharing
        self._slots: dict = {}         # key -> [(slot, its device), ...] (one per holder in flight)
        self._held: dict = {}          # holder -> the slots it holds
        self._busy: set = set()        # id() of every slot some holder holds
        self._places: dict = {}        # id() of a slot -> its reference (slots are never dropped but by clear)
        self._chosen: dict[tuple, Chosen] = {}   # a list of keys -> the slots it was staged into last

    def stage(self, holder, keys, values) -> list:
        """Copy each device array of ``values`` (on its device) into a free slot of its
        key, wait for those devices' streams (a peer reads the slots on its own), and
        hold the slots for ``holder``. Returns each value's ``(segment, offset, "dev")``,
        a reference for protocol.encode."""
        listed = tuple(keys)
        chosen = self._chosen.get(listed)
        if chosen is not None and self._busy.isdisjoint(chosen.ids) and self._fits(chosen, values):
            return self._again(holder, chosen, values)
        acc = self._acc
        mine = self._held.setdefault(holder, [])
        local: dict[int, tuple[list, list]] = {}      # device -> the copies within it
        slots = []
        for key, a in zip(keys, values):
            index = acc.index_of(a)
            slot = self._free(key, a, index)          # (on a's device: a copy within it)
            mine.append(slot)
            slots.append(slot)
            copies = local.get(index)
            if copies is None:
                copies = local[index] = ([], [])
            copies[0].append(slot)
            copies[1].append(flat_view(a))
        for index, (dsts, srcs) in sorted(local.items()):
            if dsts:
                with acc.on(index):
                    acc.copy_many(dsts, srcs)      # one kernel for the request's chunks on a GPU
            self._sharing.publish(index)
        places = [self._place(slot) for slot in slots]
        if len(local) == 1 and len({id(slot) for slot in slots}) == len(slots):
            if len(self._chosen) >= CHOSEN_LIMIT:
                self._chosen.clear()
            self._chosen[listed] = Chosen(next(iter(local)), slots, frozenset(map(id, slots)), places)
        return places

    def _fits(self, chosen: Chosen, values) -> bool:
        """Whether ``values`` go into ``chosen``'s slots as they are: as many, each on
        its device with its slot's size and dtype."""
        if len(values) != len(chosen.slots):
            return False
        acc, index = self._acc, chosen.device
        for a, slot in zip(values, chosen.slots):
            if a.size != slot.size or a.dtype != slot.dtype or acc.index_of(a) != index:
                return False
        return True

    def _again(self, holder, chosen: Chosen, values) -> list:
        """:meth:`stage` into the slots it chose for these keys last time (all free)."""
        acc = self._acc
        with acc.on(chosen.device):
            acc.copy_many(chosen.slots, [flat_view(a) for a in values])
        self._sharing.publish(chosen.device)
        self._busy.update(chosen.ids)
        self._held.setdefault(holder, []).extend(chosen.slots)
        return list(chosen.places)

    def _place(self, slot) -> tuple:
        """A slot's reference, exported once (a slot lives as long as this holds it)."""
        place = self._places.get(id(slot))
        if place is None:
            exported = self._sharing.export(slot)
            assert exported is not None          # made by sharing.empty
            place = self._places[id(slot)] = (*exported, "dev")
        return place

    def places(self, holder, keys, values) -> list:
        """:meth:`stage` for the device arrays among ``values`` (host ones travel as
        frames): a reference per device value, None per host value, in order."""
        device = [i for i, v in enumerate(values) if self._acc.holds(v)]
        places: list = [None] * len(values)
        for i, ref in zip(device, self.stage(holder, [keys[i] for i in device], [values[i] for i in device])):
            places[i] = ref
        return places

    def _free(self, key, a, index: int):
        """A slot of ``key`` on device ``index`` (``a``'s) for ``a`` that no holder holds
        (a new one if none is free), marked busy."""
        held = self._slots.get(key)
        if held is None:
            held = self._slots[key] = []
        busy = self._busy
        for slot, where in held:            # (each slot with the device it was made on)
            if id(slot) not in busy and where == index and slot.size == a.size and slot.dtype == a.dtype:
                break
        else:
            slot = self._sharing.empty(index, a.size, a.dtype)
            held.append((slot, index))
        busy.add(id(slot))
        return slot

    def release(self, holder) -> None:
        """The peer is done with what ``holder`` holds: its slots are free again."""
        for slot in self._held.pop(holder, ()):
            self._busy.discard(id(slot))

    def holders(self) -> list:
        return list(self._held)

    def forget(self) -> None:
        """Forget which slots each key list took last (each is chosen again)."""
        self._chosen.clear()

    def clear(self) -> None:
        self._chosen.clear()
        self._places.clear()
        self._slots.clear()
        self._held.clear()
        self._busy.clear()
