"""numpy <-> Arrow for the plan's columns, straight over the buffers.

Not ``pa.array``, ``Array.to_numpy`` or ``ChunkedArray.to_numpy``: pyarrow imports pandas
for them when pandas is installed (0.35-0.7 s, as in most training images), and building,
reading, inspecting or checking a plan needs none of it (`tests/test_layers.py` and
`tests/test_pandas_free.py` check that these leave pandas out).

Numeric columns read as their values (`numpy_of`); list columns as the numbers of entries
per row (`list_lengths`), CSR offsets from 0 (`list_offsets`) and the entries one list after
another (`list_values`). Each takes an ``Array`` (a view of its buffers) or a
``ChunkedArray`` (its chunks one after another: a view for one chunk, else a copy).
"""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

__all__ = ["arrow_array", "list_lengths", "list_offsets", "list_values", "numpy_of", "valid"]

# numpy dtypes of the plan's primitive Arrow types.
_NUMPY_TYPES = {pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64, pa.float64(): np.float64}

ArrowColumn: TypeAlias = pa.Array | pa.ChunkedArray


def arrow_array(values: NDArray, arrow_type: pa.DataType) -> pa.Array:
    """``values`` as an Arrow array of ``arrow_type`` (int16, int32, int64 or float64), over the same
    memory when the dtype matches."""
    values = np.ascontiguousarray(values, dtype=_NUMPY_TYPES[arrow_type])
    return pa.Array.from_buffers(arrow_type, values.shape[0], [None, pa.py_buffer(values)])


def numpy_of(array: ArrowColumn) -> np.ndarray:
    """A numeric array's values (a null reads as 0), viewed from its data buffer."""
    dtype = _numpy_type(array.type)
    if isinstance(array, pa.ChunkedArray):
        return _joined([numpy_of(chunk) for chunk in array.chunks], dtype)
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


def list_lengths(array: ArrowColumn) -> np.ndarray:
    """Entries in each row's list: int32 for ``list`` and ``fixed_size_list``, int64 for
    ``large_list`` (as ``pyarrow.compute.list_value_length``); a null list counts the
    difference of its offsets (0 as pyarrow writes it)."""
    dtype = np.dtype(np.int64 if pa.types.is_large_list(array.type) else np.int32)
    if isinstance(array, pa.ChunkedArray):
        return _joined([list_lengths(chunk) for chunk in array.chunks], dtype)
    if pa.types.is_fixed_size_list(array.type):
        return np.full(len(array), array.type.list_size, dtype=dtype)
    if len(array) == 0:
        return np.empty(0, dtype=dtype)
    return np.diff(numpy_of(array.offsets))


def list_offsets(array: ArrowColumn) -> NDArray[np.int64]:
    """Shape (rows + 1,), from 0: row ``i`` holds ``list_values(array)[offsets[i]:offsets[i + 1]]``."""
    lengths = list_lengths(array)
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def list_values(array: ArrowColumn) -> np.ndarray:
    """The entries of every row's list, one list after another, in the value type's dtype."""
    dtype = _numpy_type(array.type.value_type)
    if isinstance(array, pa.ChunkedArray):
        return _joined([list_values(chunk) for chunk in array.chunks], dtype)
    if len(array) == 0:
        return np.empty(0, dtype=dtype)
    offsets = numpy_of(array.offsets)  # into ``array.values``, which ignores the array's own offset
    return numpy_of(array.values)[offsets[0] : offsets[-1]]


def _numpy_type(arrow_type: pa.DataType) -> np.dtype:
    return np.dtype(str(arrow_type))  # pyarrow's names are numpy's: int8 ... uint64, float, double


def _joined(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """The chunks' arrays one after another: the array itself for one chunk."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
