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
# the dtype of the keys (and of the servers' values and state) that take them
MASTER = np.dtype(np.float32)


def parse(field, count: int) -> list:
    """A message's ``precision`` field checked: a list of ``count`` entries, each None
    or one of :data:`WIRE_DTYPES`' names. Raises ProtocolError otherwise."""
    if not isinstance(field, list) or len(field) != count:
        raise ProtocolError(f"'precision' must be a list with one entry (or null) per chunk ({count})")
    for name in field:
        if name is not None and name not in WIRE_DTYPES:
            raise ProtocolError(f"'precision' entry {name!r} is not one of {', '.join(WIRE_DTYPES)} (or null)")
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
