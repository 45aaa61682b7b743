"""Data-plane wire protocol: a versioned msgpack header followed by raw buffers.

This package knows headers and arrays, never sockets. See docs/protocol.md.
"""

from .codec import VERSION, decode, encode, error_header, chunk_label
from . import ops

__all__ = ["VERSION", "decode", "encode", "error_header", "chunk_label", "ops"]
