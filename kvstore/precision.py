"""Mixed precision on the wire (MXNet's ``multi_precision``, PyTorch DDP's
``bf16_compress_hook``): float16 and bfloat16 gradients pushed as they are, in
half the bytes, to float32 keys, which the servers keep, sum and update in float32.

A store opts in with ``kv.set_multi_precision(True)`` (kvstore.worker.store); without
it a value whose dtype is not its key's is refused, as always. A push message names
the chunks that travel in low precision in its ``precision`` header field (one entry
per chunk: ``"bfloat16"``, ``"float16"`` or None, docs/protocol.md); the servers widen
them with :func:`widen` before anything else sees them, so sums (deterministic ones
included) and optimizer steps are float32 and exact: every float16 and bfloat16
value is a float32 value.

bfloat16 has no numpy dtype: it travels as its raw 2-byte patterns (``uint16``
buffers, the upper half of the float32 pattern), which :func:`widen` shifts back.
:func:`widen` uses only array methods, so it serves numpy and cupy arrays alike
(the GPU servers widen device buffers). Pure array code, no I/O.

Example::

    payload = np.array([0x3F80, 0xC000], np.uint16)       # bfloat16 1.0, -2.0
    widen("bfloat16", payload, 2, "chunk w:0")            # -> array([ 1., -2.], dtype=float32)
"""

from __future__ import annotations

import numpy as np

from .errors import InvalidArgumentError, ProtocolError

BFLOAT16 = "bfloat16"
FLOAT16 = "float16"
# the low precisions a float32 key takes, and the numpy dtype each travels as
WIRE_DTYPES = {BFLOAT16: np.dtype(np.uint16), FLOAT16: np.dtype(np.float16)}
NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}      # and back
# the dtype of the keys (and of the servers' values and state) that take them
MASTER = np.dtype(np.float32)


def parse(field, count: int, label: str = "precision") -> list:
    """A message's ``precision`` field (or ``reply_precision``: ``label``) checked: a
    list of ``count`` entries, each None or one of :data:`WIRE_DTYPES`' names. Raises
    ProtocolError otherwise."""
    if not isinstance(field, list) or len(field) != count:
        raise ProtocolError(f"'{label}' must be a list with one entry (or null) per chunk ({count})")
    for name in field:
        if name is not None and name not in WIRE_DTYPES:
            raise ProtocolError(f"'{label}' entry {name!r} is not one of {', '.join(WIRE_DTYPES)} (or null)")
    return field


def widen(name: str, payload, size: int, label: str, dtype=MASTER):
    """The float32 values ``payload`` carries in precision ``name`` for a chunk of
    ``size`` values of ``dtype`` (named ``label`` in errors): exact (bfloat16's pattern
    shifted into the upper half of float32's; float16 converted). Raises
    InvalidArgumentError when the chunk is not float32 or the payload has another
    dtype or length than the precision and the chunk need."""
    if np.dtype(dtype) != MASTER:
        raise InvalidArgumentError(f"{label} holds {np.dtype(dtype).name}: {name} pushes go to float32 keys only")
    want = WIRE_DTYPES[name]
    if np.dtype(payload.dtype) != want or payload.size != size:
        raise InvalidArgumentError(f"{label}: a {name} push of {payload.size} x {np.dtype(payload.dtype).name}; "
                                   f"expected {size} x {want.name}")
    flat = payload.reshape(-1)
    if name == FLOAT16:
        return flat.astype(MASTER)
    if isinstance(flat, np.ndarray):        # one pass (astype, then a shift: two)
        return np.left_shift(flat, 16, dtype=np.uint32).view(MASTER)
    return (flat.astype(np.uint32) << 16).view(MASTER)


# bfloat16's pattern of every NaN: c10::BFloat16's scalar conversion (torch's vectorised CPU
# path writes 0xFFFF, CUDA's 0x7FFF: a NaN either way; the payload is not kept)
BFLOAT16_NAN = 0x7FC0
# values narrowed per numpy pass (the temporaries stay in cache: 512 KiB of uint32)
_BLOCK = 1 << 17
_LITTLE = np.little_endian


def narrow(name: str, values, out=None):
    """The float32 ``values`` in precision ``name`` as they travel: float16, or
    bfloat16's ``uint16`` patterns, each rounded to nearest even (ties to even), as
    torch's ``.to(torch.float16)`` and ``.to(torch.bfloat16)`` round, overflow to
    infinity included; a NaN stays a NaN (its pattern: torch's on the host where torch
    is installed, which converts host arrays; else bfloat16's :data:`BFLOAT16_NAN`).
    Written into ``out`` (flat, ``values.size`` elements of the wire dtype) when given,
    else into a new array of ``values``' kind. Array methods otherwise (numpy in
    blocks, cupy). Raises InvalidArgumentError for values that are not float32.

    Example::

        narrow("bfloat16", np.array([1.0, 1.00390625], np.float32))   # -> [0x3F80, 0x3F80] (a tie: even)
    """
    if np.dtype(values.dtype) != MASTER:
        raise InvalidArgumentError(f"{name} values are narrowed from float32, got {np.dtype(values.dtype).name}")
    want = WIRE_DTYPES[name]
    flat = values.reshape(-1)
    if out is None:
        out = np.empty_like(flat, dtype=want)      # (cupy's for a cupy array: __array_function__)
    elif np.dtype(out.dtype) != want or out.size != flat.size:
        raise InvalidArgumentError(f"a {name} output of {out.size} x {np.dtype(out.dtype).name} for "
                                   f"{flat.size} values; expected {flat.size} x {want.name}")
    dest = out.reshape(-1)
    if isinstance(flat, np.ndarray) and _torch() is not None:
        # torch's own conversion where it is installed: one vectorised pass (numpy's
        # below takes 2-4x as long for bfloat16, 4x for float16, on these machines)
        torch = _torch()
        wide = torch.from_numpy(np.asarray(flat))
        into = torch.from_numpy(np.asarray(dest).view(np.int16 if name == BFLOAT16 else np.float16))
        (into.view(torch.bfloat16) if name == BFLOAT16 else into).copy_(wide)
        return out
    _narrow_arrays(name, flat, dest)
    return out


def _narrow_arrays(name: str, flat, dest) -> None:
    """:func:`narrow` by array methods: numpy in blocks (where torch is missing), cupy."""
    want = WIRE_DTYPES[name]
    if name == FLOAT16:                    # (numpy and cupy round to nearest even)
        if isinstance(flat, np.ndarray):
            with np.errstate(over="ignore"):         # past 65504: infinity, as torch's
                np.copyto(dest, flat, casting="same_kind")
        else:
            dest[...] = flat.astype(want)
        return
    if not isinstance(flat, np.ndarray):   # cupy: one elementwise pass each, on the device
        bits = flat.view(np.uint32)
        dest[...] = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(want)
        dest[flat != flat] = BFLOAT16_NAN
        return
    bits = flat.view(np.uint32)
    temp = np.empty(min(flat.size, _BLOCK), np.uint32)
    for lo in range(0, flat.size, _BLOCK):
        b = bits[lo:lo + _BLOCK]
        t = temp[:b.size]
        np.right_shift(b, 16, out=t)         # the lowest bit kept, for ties to even
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(t, b, out=t)                  # (a NaN's may wrap: it is replaced below)
        d = dest[lo:lo + _BLOCK]
        np.copyto(d, t.view(np.uint16)[1::2] if _LITTLE else t.view(np.uint16)[0::2])   # the upper halves
        nan = np.isnan(flat[lo:lo + _BLOCK])
        if nan.any():
            d[nan] = BFLOAT16_NAN


_TORCH: list = []


def _torch():
    """torch when it is installed (imported at the first use, once), else None."""
    if not _TORCH:
        try:
            import torch
        except ImportError:
            torch = None
        _TORCH.append(torch)
    return _TORCH[0]
