"""The bytes of an Arrow IPC file that batchplan relies on; pyarrow reads and writes the rest.

An Arrow IPC file is ``ARROW1`` padded to 8 bytes, the schema message (``0xFFFFFFFF``, its
length as int32, its flatbuffer), the record batches, the footer (a flatbuffer holding the
schema again), the footer's length as int32, and ``ARROW1``. Two things use this layout: telling
a file cut short from another damage (the magic at both ends, `ARROW_MAGIC`), and
`replace_in_schema`, with which the writer puts a plan's content hash into a file it has just
written (the hash is computed while the batches are written; `batchplan.formats.plan_writer`).
A pyarrow release that lays files out otherwise breaks both; tests/test_arrow_layout.py checks
them against the installed pyarrow.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa

__all__ = ["ARROW_MAGIC", "SMALLEST_ARROW_FILE", "replace_in_schema"]

ARROW_MAGIC = b"ARROW1"
# "ARROW1" padded to 8 bytes, then (at the end) the footer's length (4 bytes) and "ARROW1".
SMALLEST_ARROW_FILE = 8 + 4 + len(ARROW_MAGIC)
_SCHEMA_AT = 8  # the schema message follows the padded leading magic
_FOOTER_LENGTH_FROM_END = 4 + len(ARROW_MAGIC)


def replace_in_schema(path: Path, old: bytes, new: bytes) -> None:
    """Write ``new`` over ``old`` in both copies of the schema of the Arrow IPC file at ``path``:
    the schema message after the leading magic and the footer before the trailing one. Only
    those two messages are read (their lengths are in the file); nothing moves, so ``new`` is
    as long as ``old``, and the file is then byte for byte the one pyarrow writes with ``new``
    in the schema from the start.

    Raises:
        AssertionError: ``new`` is not as long as ``old``, or ``old`` is not exactly once in
            each copy: the installed pyarrow lays files out otherwise.
    """
    if len(new) != len(old):
        raise AssertionError(f"{new!r} is not as long as {old!r}")
    with open(path, "rb+") as file:
        size = os.fstat(file.fileno()).st_size
        # 0xFFFFFFFF, then the schema flatbuffer's length
        schema_length = int.from_bytes(os.pread(file.fileno(), 8, _SCHEMA_AT)[4:8], "little")
        footer_length = int.from_bytes(os.pread(file.fileno(), 4, size - _FOOTER_LENGTH_FROM_END), "little")
        footer_at = size - _FOOTER_LENGTH_FROM_END - footer_length
        for start, length in ((_SCHEMA_AT + 8, schema_length), (footer_at, footer_length)):
            message = os.pread(file.fileno(), length, start)
            if message.count(old) != 1:
                raise AssertionError(
                    f"{path}: {old!r} is not once in the schema where Arrow IPC files put it; pyarrow "
                    f"{pa.__version__} lays files out otherwise (tests/test_arrow_layout.py)"
                )
            os.pwrite(file.fileno(), new, start + message.index(old))
