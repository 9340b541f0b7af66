"""What the object-storage tests share: a small corpus of Parquet files (nested folders, among
them ``a`` and ``a-b``, whose keys sort differently as strings and as paths, and one non-Parquet
file beside them), and the check that a plan built from a store equals the one from disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchplan.config import PlanConfig
from batchplan.formats.opening import open_plan
from batchplan.operations.build import build_plan_file

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


def assert_plans_equal(source: str, local: Path, directory: Path, name: str | None = None) -> None:
    """Plans built from URI ``source`` and from ``local`` differ in nothing but the file names,
    which start with ``name`` (default: ``source``; a URI's credentials and query are not part of
    the names)."""
    config = PlanConfig(max_tokens=64, world_size=2, epochs=2)
    remote = build_plan_file(source, directory / "remote.arrow", config, loss_tokens_column="loss")
    copy = build_plan_file(local, directory / "local.arrow", config, loss_tokens_column="loss")
    assert all(file.startswith(f"{name or source}/") for file, _ in remote["dataset"]["files"])
    assert remote["lengths_fingerprint"] == copy["lengths_fingerprint"]
    unnamed = [{**meta, "dataset": {**meta["dataset"], "files": None}} for meta in (remote, copy)]
    for meta in unnamed:
        meta.pop("content_hash", None)  # hashes the metadata, names included
    assert unnamed[0] == unnamed[1]
    opened = open_plan(directory / "remote.arrow"), open_plan(directory / "local.arrow")
    for epoch in range(config.epochs):
        for rank in range(config.world_size):
            assert opened[0].read_rank(epoch, rank).equals(opened[1].read_rank(epoch, rank))
