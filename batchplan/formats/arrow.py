"""numpy <-> Arrow for the plan's primitive columns, straight over the buffers.

Not ``pa.array`` or ``Array.to_numpy``: pyarrow imports pandas for them when pandas is
installed (0.35-0.7 s, as in most training images), and building, reading or checking a
plan needs none of it (`tests/test_layers.py` checks that a build leaves pandas out).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

__all__ = ["arrow_array", "numpy_of", "valid"]

# numpy dtypes of the plan's primitive Arrow types.
_NUMPY_TYPES = {pa.int32(): np.int32, pa.int64(): np.int64, pa.float64(): np.float64}


def arrow_array(values: NDArray, arrow_type: pa.DataType) -> pa.Array:
    """``values`` as an Arrow array of ``arrow_type`` (int32, int64 or float64), over the same
    memory when the dtype matches."""
    values = np.ascontiguousarray(values, dtype=_NUMPY_TYPES[arrow_type])
    return pa.Array.from_buffers(arrow_type, values.shape[0], [None, pa.py_buffer(values)])


def numpy_of(array: pa.Array) -> np.ndarray:
    """A numeric array's values (a null reads as 0), viewed from its data buffer."""
    dtype = np.dtype(str(array.type))  # pyarrow's names are numpy's: int8 ... uint64, float, double
    if len(array) == 0:
        return np.empty(0, dtype=dtype)
    values = np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)
    return np.where(valid(array), values, 0) if array.null_count else values


def valid(array: pa.Array) -> np.ndarray:
    """Which entries are not null (bool per entry), from the validity bitmap."""
    if array.null_count == 0:
        return np.ones(len(array), dtype=bool)
    bits = np.unpackbits(np.frombuffer(array.buffers()[0], dtype=np.uint8), bitorder="little")
    return bits[array.offset : array.offset + len(array)].astype(bool)
