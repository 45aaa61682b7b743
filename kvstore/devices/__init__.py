"""The device layer: the few operations that differ between a GPU and the host,
behind one small interface (:class:`~kvstore.devices.base.Device`).

- :class:`~kvstore.devices.cuda.CudaDevice`: one NVIDIA GPU through CuPy (a
  non-blocking stream, pinned staging, events). CI cannot execute it: keep it thin.
- :class:`~kvstore.devices.host.HostDevice`: the same interface on numpy, with
  "device" memory kept distinct from the caller's arrays and every copy explicit,
  so that the code above the layer (the GPU server backend) runs in CI and a
  rename, a wrong shape or a missing copy fails there, not on the next GPU loan.

Everything above this layer is one code path (kvstore/server/backend.py's
``DeviceBackend``). Example::

    from kvstore.devices import HostDevice
    backend = DeviceBackend(HostDevice())       # the GPU server's logic, on the CPU
"""

from .base import Device, Event
from .host import HostDevice

__all__ = ["Device", "Event", "HostDevice"]
