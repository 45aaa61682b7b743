"""The device layer: the few operations that differ between a GPU and the host,
behind one small interface (:class:`~kvstore.devices.base.Device`).

- :class:`~kvstore.devices.cuda.CudaDevice`: one NVIDIA GPU through CuPy (a
  non-blocking stream, pinned staging, events). CI cannot execute it: keep it thin.
- :class:`~kvstore.devices.host.HostDevice`: the same interface on numpy, with
  "device" memory kept distinct from the caller's arrays and every copy explicit,
  so that the code above the layer (the GPU server backend) runs in CI and a
  rename, a wrong shape or a missing copy fails there, not on the next GPU loan.

Everything above this layer is one code path: the GPU server's
(kvstore/server/backend.py's ``DeviceBackend`` over a :class:`Device`) and the
GPU stores' (kvstore/devices/staging.py over :class:`Accelerators`: the
process's GPUs with the caller's values on them; :class:`HostAccelerators` on
numpy in CI). Example::

    from kvstore.devices import HostDevice
    backend = DeviceBackend(HostDevice())       # the GPU server's logic, on the CPU
"""

from .base import Accelerators, Device, Event
from .host import HostAccelerators, HostDevice


def worker_accelerators() -> Accelerators | None:
    """The GPUs the worker stores (``device``, ``dist_device_sync``) use: CUDA
    through CuPy when the probe finds a usable GPU (kvstore.devices.gpu), else None (they
    work on the host). Tests replace it with a :class:`HostAccelerators`."""
    from . import gpu
    if not gpu.available():
        return None
    from .cuda import CudaAccelerators
    return CudaAccelerators()


__all__ = ["Accelerators", "Device", "Event", "HostAccelerators", "HostDevice", "worker_accelerators"]
