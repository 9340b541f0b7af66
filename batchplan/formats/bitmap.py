"""A set of items as a short string: the bits of a boolean mask, base64, trailing zero bytes cut.

Bit ``i % 8`` of byte ``i // 8`` is item ``i``. A resharded plan records with it which
samples its parent trained before the step it resumes from (``consumed`` in the metadata):
1 bit per sample before base64, and nothing for the zero bytes at the end.
"""

from __future__ import annotations

import base64

import numpy as np
from numpy.typing import NDArray

__all__ = ["decode_bitmap", "encode_bitmap"]


def encode_bitmap(mask: NDArray[np.bool_]) -> str:
    """Base64 of the bits of ``mask``, trailing zero bytes cut."""
    packed = np.packbits(mask, bitorder="little")
    used = np.flatnonzero(packed)
    packed = packed[: used[-1] + 1] if used.size else packed[:0]
    return base64.b64encode(packed.tobytes()).decode("ascii")


def decode_bitmap(text: str, size: int) -> NDArray[np.bool_]:
    """Inverse of `encode_bitmap`: a boolean mask of ``size`` items.

    Raises:
        ValueError: not base64 (``binascii.Error`` is one), or bits set beyond ``size``.
    """
    packed = np.frombuffer(base64.b64decode(text.encode("ascii"), validate=True), dtype=np.uint8)
    if packed.shape[0] > (size + 7) // 8 or np.unpackbits(packed, bitorder="little")[size:].any():
        raise ValueError(f"the bitmap holds more than {size:,} items")
    # Pad the cut zero bytes back ourselves: unpackbits' own padding past its input is not zeroed.
    full = np.zeros((size + 7) // 8, dtype=np.uint8)
    full[: packed.shape[0]] = packed
    return np.unpackbits(full, count=size, bitorder="little").astype(bool)
