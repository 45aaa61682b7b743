"""Accept numpy arrays, torch tensors and cupy arrays; hand numpy to the rest.

torch and cupy are optional and never imported here: a value is recognised by
the module its type comes from, so importing kvstore stays cheap.
"""

from __future__ import annotations

import numpy as np

from .errors import ArgumentTypeError


def _family(value) -> str | None:
    if isinstance(value, np.ndarray):
        return "numpy"
    root = type(value).__module__.split(".")[0]
    if root == "torch" and hasattr(value, "detach"):
        return "torch"
    if root == "cupy" and hasattr(value, "get"):
        return "cupy"
    return None


def is_array(value) -> bool:
    return _family(value) is not None


def to_numpy(value, what: str) -> np.ndarray:
    """A numpy view of ``value`` where possible (torch CPU, numpy), else a host copy."""
    family = _family(value)
    if family == "numpy":
        return value
    if family == "torch":
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.resolve_conj().resolve_neg().numpy()
    if family == "cupy":
        return value.get()
    raise ArgumentTypeError(f"{what}: expected a numpy array, torch tensor or cupy array, "
                            f"got {type(value).__name__}")


def flat_target(out, what: str) -> tuple[np.ndarray, bool]:
    """A writable, flat numpy array whose contents can be written into ``out``.

    Returns ``(buffer, direct)``: when ``direct`` the buffer *is* out's memory
    (nothing more to do); otherwise call :func:`write` afterwards."""
    family = _family(out)
    if family == "numpy":
        if out.flags.c_contiguous and out.flags.writeable:
            return out.reshape(-1), True
        if not out.flags.writeable:
            raise ArgumentTypeError(f"{what}: the output array is read-only")
        return np.empty(out.size, out.dtype), False
    if family == "torch" and out.device.type == "cpu" and out.is_contiguous():
        return out.detach().numpy().reshape(-1), True
    view = to_numpy(out, what)
    return np.empty(view.size, view.dtype), False


def write(out, src: np.ndarray) -> None:
    """Copy ``src`` (same number of elements) into ``out`` of any supported family."""
    family = _family(out)
    if family == "numpy":
        np.copyto(out, src.reshape(out.shape))
    elif family == "torch":
        import torch  # already imported by the caller, who handed us a tensor
        out.detach().copy_(torch.from_numpy(np.ascontiguousarray(src).reshape(tuple(out.shape))))
    elif family == "cupy":
        out.set(np.ascontiguousarray(src).reshape(out.shape))
    else:
        raise ArgumentTypeError(f"cannot write into a {type(out).__name__}")


def shape_dtype(value, what: str) -> tuple[tuple, np.dtype]:
    """Shape and numpy dtype of any supported array, without copying it."""
    family = _family(value)
    if family is None:
        raise ArgumentTypeError(f"{what}: expected a numpy array, torch tensor or cupy array, "
                                f"got {type(value).__name__}")
    if family == "torch":
        name = str(value.dtype).removeprefix("torch.")
        try:
            return tuple(value.shape), np.dtype(name)
        except TypeError:
            raise ArgumentTypeError(f"{what}: torch dtype {value.dtype} has no numpy equivalent") from None
    return tuple(value.shape), np.dtype(value.dtype)
