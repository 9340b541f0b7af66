"""A small corpus of Parquet files for the object-storage tests: nested folders, among them
``a`` and ``a-b`` (whose keys sort differently as strings and as paths), and one non-Parquet
file beside them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FOLDERS = ["", "a/", "a-b/", "a/deep/", "b/"]


def write_corpus(root: Path, num_files: int, seed: int = 0) -> Path:
    """``num_files`` Parquet files of 1-5 rows (length, loss, text) and one non-Parquet file."""
    rng = np.random.default_rng(seed)
    for index in range(num_files):
        rows = int(rng.integers(1, 6))
        length = rng.integers(1, 60, rows).astype(np.int32)
        loss = (length * rng.random(rows)).astype(np.int32)
        path = root / f"{FOLDERS[index % len(FOLDERS)]}shard-{index:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"length": length, "loss": loss, "text": ["x"] * rows}), path)
    (root / "README.txt").write_text("not parquet: listed, never read")
    return root
