"""Accept numpy arrays, torch tensors (CPU or CUDA) and cupy arrays; hand numpy
(or, for the GPU stores, cupy) to the rest.

torch and cupy are optional and never imported here until a caller hands us one
of their arrays: a value is recognised by the module its type comes from, so
importing kvstore stays cheap and needs no GPU.

GPU values are exchanged without copies: a torch CUDA tensor is viewed as a cupy
array over the same memory (:func:`as_cupy`: directly, or through DLPack where the
two libraries' streams must be ordered). Copies to the host go through pinned
(page-locked) memory, and a cupy result is written into CUDA tensors and cupy
arrays on the GPU, device to device (:func:`write`).

torch bfloat16 tensors have no numpy (or cupy) dtype: they are read as float32
(:func:`shape_dtype` says float32, :func:`dtype_name` says "bfloat16"), so the
stores keep and sum bfloat16 keys in float32 and send float32 on the wire; writing
into a bfloat16 output rounds back (torch's ``copy_``).
"""

from __future__ import annotations

import sys

import numpy as np

from . import gpu
from ..errors import ArgumentTypeError


_FAMILIES: dict[type, str | None] = {}     # a type's family, found once (hot: every value, every call)


def _family(value) -> str | None:
    kind = type(value)
    try:
        return _FAMILIES[kind]
    except KeyError:
        pass
    root = kind.__module__.split(".")[0]
    if root == "cupy" and hasattr(kind, "get"):
        family: str | None = "cupy"
    elif issubclass(kind, np.ndarray):
        family = "numpy"
    elif root == "torch" and hasattr(kind, "detach"):
        family = "torch"
    else:
        family = None
    _FAMILIES[kind] = family
    return family


def is_array(value) -> bool:
    """True for the arrays the stores take: numpy arrays, torch tensors, cupy arrays."""
    return _family(value) is not None


def is_torch(value) -> bool:
    """True for torch tensors (CPU or CUDA)."""
    return _family(value) == "torch"


def is_gpu(value) -> bool:
    """True for cupy arrays and torch CUDA tensors."""
    family = _family(value)
    return family == "cupy" or (family == "torch" and value.device.type == "cuda")


def device_of(value) -> int | None:
    """The CUDA device ordinal of a GPU value, None for host values."""
    family = _family(value)
    if family == "cupy":
        return int(value.device.id)
    if family == "torch" and value.device.type == "cuda":
        index = value.device.index
        return int(index) if index is not None else int(sys.modules["torch"].cuda.current_device())
    return None


BFLOAT16 = "bfloat16"


def _is_bf16(value) -> bool:
    return _family(value) == "torch" and str(value.dtype) == "torch.bfloat16"


def _plain_tensor(value):
    """``value`` detached, without lazy conjugate/negative bits (DLPack and numpy refuse
    them), and bfloat16 upcast to float32 (numpy and cupy have no bfloat16; float32
    holds every bfloat16 exactly and sums them without bfloat16's rounding)."""
    t = value.detach().resolve_conj().resolve_neg()
    return t.float() if _is_bf16(t) else t


def as_cupy(value, what: str = "value"):
    """A cupy view of a GPU value: a cupy array as it is, a torch CUDA tensor as a view
    of its memory (no copy): made directly when both libraries use the same stream
    on the tensor's device, the current one (:func:`_direct_view`), else through
    DLPack (cupy's stream waits for torch's pending work). A bfloat16 tensor is read
    as a float32 copy on its device.
    Raises ArgumentTypeError for host values, RuntimeError when no GPU is usable."""
    family = _family(value)
    if family == "cupy":
        return value
    if family == "torch" and value.device.type == "cuda":
        cupy = gpu.cupy_module()
        import torch  # the caller handed us a tensor: torch is imported already
        device = device_of(value)
        if device == torch.cuda.current_device() == cupy.cuda.runtime.getDevice():
            direct = _direct_view(value, device, cupy, torch)
            if direct is not None:
                return direct
            return cupy.from_dlpack(_plain_tensor(value))     # (the common case: no switching)
        # torch's __dlpack__ refuses a tensor of another device than torch's current
        # one and orders streams of the current device: make both libraries agree
        with cupy.cuda.Device(device), torch.cuda.device(device):
            return cupy.from_dlpack(_plain_tensor(value))
    raise ArgumentTypeError(f"{what}: expected a cupy array or a torch CUDA tensor, "
                            f"got {type(value).__name__} on the host")


def _direct_view(t, device: int, cupy, torch):
    """A cupy array over a contiguous torch CUDA tensor's memory on the current device,
    made without a DLPack capsule (torch's ``__dlpack__`` costs ~70 us a tensor, the
    largest cost per key of a GPU pushpull of many small tensors), or None where
    DLPack is needed: cupy's current stream is not torch's (DLPack then makes cupy's
    wait), the tensor is strided, empty, bfloat16, has a lazy conjugate or negative
    bit, or a dtype cupy lacks. The view keeps the tensor alive."""
    if (not t.is_contiguous() or t.numel() == 0 or t.is_conj() or t.is_neg()
            or str(t.dtype) == "torch.bfloat16"):
        return None
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw_stream is None or int(raw_stream(device)) != int(cupy.cuda.get_current_stream().ptr):
        return None
    try:
        dtype = _torch_dtype(t.dtype, "value")
    except ArgumentTypeError:
        return None
    memory = cupy.cuda.UnownedMemory(int(t.data_ptr()), int(t.numel()) * dtype.itemsize, t, device)
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(memory, 0))


def device_address(value) -> tuple[int, int, np.dtype, int] | None:
    """``(device, address, dtype, size)`` of a C-contiguous GPU value whose memory holds
    its numpy dtype as it is (a cupy array, a torch CUDA tensor other than
    bfloat16), else None: what a kernel over raw addresses may write into
    (kvstore/devices/cuda_copies.py)."""
    family = _family(value)
    if family == "cupy":
        if value.flags.c_contiguous:
            return int(value.device.id), int(value.data.ptr), np.dtype(value.dtype), int(value.size)
        return None
    if family == "torch" and value.device.type == "cuda" and value.is_contiguous() and not _is_bf16(value):
        try:
            dtype = _torch_dtype(value.dtype, "value")
        except ArgumentTypeError:     # no numpy dtype: not for a raw copy
            return None
        index = device_of(value)
        assert index is not None
        return index, int(value.data_ptr()), dtype, int(value.numel())
    return None


def flat_view(a):
    """``a`` as a 1-D array of numpy or cupy: itself when it is one already (a reshape
    makes a new view each time, ~2 us on cupy: the copy paths call this per key)."""
    return a if a.ndim == 1 else a.reshape(-1)


def pinned_host(size: int, dtype, like=None) -> np.ndarray:
    """A flat host buffer; page-locked when ``like`` is a GPU value (fast, DMA copies)."""
    dtype = np.dtype(dtype)
    if like is None or not is_gpu(like) or size == 0:
        return np.empty(size, dtype)
    if _family(like) == "torch" and not gpu.available():
        import torch  # the caller handed us a tensor: torch is imported already
        # ``dtype``, not like.dtype: a bfloat16 output is staged as float32
        torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
        return torch.empty(size, dtype=torch_dtype, pin_memory=True).numpy()
    return gpu.pinned_empty(size, dtype)


def bfloat16_bits(value) -> np.ndarray:
    """The raw 2-byte patterns of a torch bfloat16 tensor as a flat host ``uint16``
    array (a view for a contiguous CPU tensor, else a copy): how bfloat16 travels
    on the wire (kvstore.precision), in half float32's bytes."""
    import torch  # the caller handed us a tensor: torch is imported already
    t = value.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


def wire_target(out, name: str, what: str) -> tuple[np.ndarray, bool]:
    """:func:`flat_target` for a reply that travels in precision ``name`` (a float16 or
    bfloat16 ``out`` of a float32 key, kvstore.precision): a float16 flat, or a
    bfloat16 output's ``uint16`` patterns, its own memory (``direct``) where it is a
    contiguous host array, else a host buffer to write with :func:`write_bfloat16_bits`
    (bfloat16) or :func:`write` (float16)."""
    if name != BFLOAT16:
        return flat_target(out, what)
    if out.device.type == "cpu" and out.is_contiguous():
        return bfloat16_bits(out), True          # (a view: the reply lands in out itself)
    return pinned_host(int(np.prod(tuple(out.shape), dtype=np.int64)), np.uint16, like=out), False


def bits_view(out):
    """A torch bfloat16 tensor's 2-byte patterns as an ``int16`` tensor of its memory
    (any device, any layout: a view, no copy; int16, which DLPack and cupy take
    everywhere), which takes bfloat16 patterns as they are where the tensor itself
    would convert integers; other values as they are."""
    if not _is_bf16(out):
        return out
    import torch  # the caller handed us a tensor: torch is imported already
    return out.detach().view(torch.int16)


def write_bfloat16_bits(out, bits: np.ndarray) -> None:
    """Write the bfloat16 patterns ``bits`` (flat ``uint16``, out's number of elements)
    into the torch bfloat16 tensor ``out`` (any layout or device): the patterns as they
    are, not their integer values."""
    import torch  # the caller handed us a tensor: torch is imported already
    out.detach().copy_(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(tuple(out.shape)))


def to_numpy(value, what: str) -> np.ndarray:
    """A numpy view of ``value`` where possible (torch CPU, numpy), else a host copy
    (through pinned memory for GPU values; the caller owns it)."""
    family = _family(value)
    if family == "numpy":
        return value
    if family == "torch":
        t = _plain_tensor(value)
        if t.device.type == "cuda":
            import torch
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # torch's pinned pool
            host.copy_(t)      # blocking: done when copy_ returns
            return host.numpy()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.numpy()
    if family == "cupy":
        return gpu.to_host(value) if gpu.available() else value.get()
    raise ArgumentTypeError(f"{what}: expected a numpy array, torch tensor or cupy array, "
                            f"got {type(value).__name__}")


def flat_target(out, what: str) -> tuple[np.ndarray, bool]:
    """A writable, flat numpy array whose contents can be written into ``out``.

    Returns ``(buffer, direct)``: when ``direct`` the buffer *is* out's memory
    (nothing more to do); otherwise call :func:`write` afterwards. For a GPU
    ``out`` the buffer is pinned host memory (nothing is copied from ``out``)."""
    family = _family(out)
    if family == "numpy":
        if out.flags.c_contiguous and out.flags.writeable:
            return out.reshape(-1), True
        if not out.flags.writeable:
            raise ArgumentTypeError(f"{what}: the output array is read-only")
        return np.empty(out.size, out.dtype), False
    if family == "torch" and out.device.type == "cpu" and out.is_contiguous() and not _is_bf16(out):
        return out.detach().numpy().reshape(-1), True
    shape, dtype = shape_dtype(out, what)
    return pinned_host(int(np.prod(shape, dtype=np.int64)), dtype, like=out), False


def write(out, src) -> None:
    """Copy ``src`` (a numpy or cupy array with out's number of elements) into
    ``out`` of any supported family. GPU to GPU stays on the GPUs (a peer copy
    between devices); GPU to host lands directly in a contiguous numpy ``out``."""
    family = _family(out)
    src_on_gpu = _family(src) == "cupy"
    if family == "numpy":
        if not out.flags.writeable:
            raise ArgumentTypeError("the output array is read-only")
        if not src_on_gpu:
            np.copyto(out, src.reshape(out.shape))
        elif out.flags.c_contiguous:
            gpu.to_host(src.reshape(out.shape), out=out)
        else:
            np.copyto(out, gpu.to_host(src).reshape(out.shape))
    elif family == "torch":
        import torch  # already imported by the caller, who handed us a tensor
        dst = out.detach()
        if src_on_gpu and dst.device.type == "cpu":
            if dst.is_contiguous() and not _is_bf16(dst):
                gpu.to_host(src.reshape(tuple(out.shape)), out=dst.numpy())   # straight into out
            else:
                dst.copy_(torch.from_numpy(gpu.to_host(src).reshape(tuple(out.shape))))
        elif src_on_gpu:
            import cupy
            with src.device:
                source = cupy.ascontiguousarray(src).reshape(tuple(out.shape))
                # torch's stream waits for cupy's work on ``source`` (DLPack stream handshake)
                dst.copy_(torch.from_dlpack(source))
            gpu.join_streams(int(src.device.id))   # cupy must not reuse ``source`` too early
        else:
            dst.copy_(torch.from_numpy(np.ascontiguousarray(src).reshape(tuple(out.shape))))
    elif family == "cupy":
        import cupy
        with out.device:
            if src_on_gpu and src.device.id != out.device.id:
                gpu.copy_between_devices(out, src.reshape(out.shape))   # a peer copy
            elif src_on_gpu:
                cupy.copyto(out, src.reshape(out.shape))
            elif out.flags.c_contiguous:
                # waits while a pinned ``src`` is read: callers free or reuse it next
                gpu.copy_from_host(out, np.ascontiguousarray(src).reshape(out.shape))
            else:
                out[...] = gpu.to_device(src.reshape(out.shape), int(out.device.id))
    else:
        raise ArgumentTypeError(f"cannot write into a {type(out).__name__}")


def shape_dtype(value, what: str) -> tuple[tuple, np.dtype]:
    """Shape and numpy dtype of any supported array, without copying it. The dtype is
    the one the stores keep: float32 for a torch bfloat16 tensor (see :func:`dtype_name`)."""
    family = _family(value)
    if family is None:
        raise ArgumentTypeError(f"{what}: expected a numpy array, torch tensor or cupy array, "
                                f"got {type(value).__name__}")
    if family == "torch":
        return tuple(value.shape), _torch_dtype(value.dtype, what)
    return tuple(value.shape), np.dtype(value.dtype)


_TORCH_DTYPES: dict = {}      # torch dtype -> the numpy dtype the stores keep


def _torch_dtype(dtype, what: str) -> np.dtype:
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        name = str(dtype).removeprefix("torch.")
        if name == BFLOAT16:
            found = np.dtype(np.float32)
        else:
            try:
                found = np.dtype(name)
            except TypeError:
                raise ArgumentTypeError(f"{what}: torch dtype {dtype} has no numpy equivalent") from None
        _TORCH_DTYPES[dtype] = found
    return found


_NAMES: dict = {}             # (family, a value's dtype) -> the name users see


def dtype_name(value) -> str:
    """The dtype a user sees, for messages and checks: "bfloat16" for a torch bfloat16
    tensor (kept as float32 by the stores), else the numpy name ("float32", ...)."""
    family = _family(value)
    if family is None:
        return shape_dtype(value, "value")[1].name      # raises ArgumentTypeError
    key = (family, value.dtype)      # (a numpy dtype and a torch dtype are never compared)
    name = _NAMES.get(key)
    if name is None:
        name = _NAMES[key] = BFLOAT16 if _is_bf16(value) else shape_dtype(value, "value")[1].name
    return name

