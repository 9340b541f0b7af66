"""Sample lengths are held as uint16 when every one is below 2^16, and that changes nothing
a user sees: plans are byte-identical and the lengths fingerprint is the same for any dtype."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import build_and_write

import batchplan.formats.lengths as lengths_module
import batchplan.planning.entries as entries_module
from batchplan.config import PlanConfig
from batchplan.formats.lengths import fingerprint_lengths, read_lengths
from batchplan.formats.opening import open_plan
from batchplan.operations.validate import check_plan
from batchplan.plan import length_dtype
from batchplan.planning.entries import make_entries
from batchplan.planning.epochs import build_plan


def write(path, **columns):
    pq.write_table(pa.table(columns), path)
    return path


def lognormal(count: int, seed: int, longest: int = 2**16 - 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.0, 1.0, count), 1, longest).astype(np.int64)


def loss_column(lengths: np.ndarray, seed: int = 5) -> np.ndarray:
    """0..length loss tokens per sample."""
    rng = np.random.default_rng(seed)
    return (rng.random(lengths.shape[0]) * (lengths + 1)).astype(np.int64)


# -- what is held --------------------------------------------------------------------------------


def test_short_lengths_are_held_as_uint16(tmp_path, monkeypatch):
    monkeypatch.setattr(lengths_module, "_CHUNK", 5)  # hashing in chunks across file boundaries
    values = [[3, 0, 65_535, 7, 1, 2, 9], [4] * 6, [8, 65_535, 1]]
    paths = [write(tmp_path / f"{i}.parquet", length=pa.array(v, pa.int64()), loss=v) for i, v in enumerate(values)]
    read = read_lengths(paths, loss_tokens_column="loss")
    flat = sum(values, [])
    assert read.lengths.dtype == np.uint16 and read.lengths.tolist() == flat
    assert read.loss_tokens.dtype == np.uint16 and read.loss_tokens.tolist() == flat
    # A list column's lengths too.
    ids = write(tmp_path / "ids.parquet", input_ids=pa.array([[1, 2], [], [5] * 7], pa.list_(pa.int32())))
    assert read_lengths(ids).lengths.dtype == np.uint16

    config = PlanConfig(max_tokens=2**16, drop_empty=True)
    narrow = np.array(flat, dtype=np.uint16)
    entries = make_entries(narrow, config, loss_tokens=narrow)
    assert entries.length.dtype == np.uint16 and entries.loss_tokens.dtype == np.uint16
    assert entries.length.tolist() == [v for v in flat if v]
    kept = narrow[narrow > 0]
    assert make_entries(kept, config).length is kept  # no copy when the dtype fits
    for dtype in (np.int32, np.int64):
        entries = make_entries(narrow.astype(dtype), config, loss_tokens=narrow.astype(dtype))
        assert entries.length.dtype == entries.loss_tokens.dtype == np.uint16
        assert entries.length.tolist() == [v for v in flat if v]


def test_long_lengths_are_held_as_int32(tmp_path):
    path = write(tmp_path / "a.parquet", length=pa.array([3, 65_536, 7], pa.int64()), loss=[3, 60_000, 7])
    read = read_lengths(path, loss_tokens_column="loss")
    assert read.lengths.dtype == np.int32 and read.lengths.tolist() == [3, 65_536, 7]
    assert read.loss_tokens.dtype == np.uint16  # each column is narrowed on its own

    wide = np.array([3, 65_536, 7], dtype=np.int32)
    entries = make_entries(wide, PlanConfig(max_tokens=2**17))
    assert entries.length is wide
    assert make_entries(wide.astype(np.int64), PlanConfig(max_tokens=2**17)).length.dtype == np.int32
    # Dropping the oversize ones leaves lengths that fit.
    dropped = make_entries(wide, PlanConfig(max_tokens=1000, oversize="drop"))
    assert dropped.length.dtype == np.uint16 and dropped.length.tolist() == [3, 7]
    # Spans are at most max_tokens.
    split = make_entries(np.array([70_000, 5]), PlanConfig(max_tokens=30_000, oversize="split"))
    assert split.length.dtype == np.uint16 and split.length.tolist() == [30_000, 30_000, 10_000, 5]
    split = make_entries(np.array([150_000, 5]), PlanConfig(max_tokens=100_000, oversize="split"))
    assert split.length.dtype == np.int32 and split.length.tolist() == [100_000, 50_000, 5]
    assert length_dtype(2**16 - 1) == np.uint16 and length_dtype(2**16) == np.int32


def test_default_loss_tokens_of_narrow_lengths_do_not_wrap():
    """Without a loss-tokens column a sample has its length less one: 0 for a length of 1
    (uint16 lengths less one would wrap), 65,534 for 65,535."""
    lengths = np.array([1, 2, 65_535], dtype=np.uint16)
    epoch = build_plan(lengths, PlanConfig(max_tokens=2**16, world_size=1)).epochs[0]
    assert int(epoch.loss_tokens.sum()) == int(epoch.step_loss_tokens.sum()) == 0 + 1 + 65_534
    assert (epoch.loss_tokens >= 0).all()


# -- what a user sees -------------------------------------------------------------------------------


def _with_empty(values: np.ndarray) -> np.ndarray:
    values = values.copy()
    values[::97] = 0
    return values


def _case(values: np.ndarray, with_loss: bool = False, **options) -> tuple[PlanConfig, np.ndarray, bool]:
    return PlanConfig(**options), values, with_loss


CASES = {
    "pack_drop": _case(
        _with_empty(lognormal(20_000, 1)),
        max_tokens=2048,
        world_size=4,
        micro_batches=2,
        epochs=2,
        seed=3,
        oversize="drop",
        drop_empty=True,
    ),
    "pad_compute": _case(
        lognormal(12_000, 2),
        max_tokens=4096,
        mode="pad",
        world_size=3,
        epochs=2,
        batch_multiple=8,
        hidden_size=1024,
        oversize="drop",
    ),
    "pack_split": _case(lognormal(8_000, 3), max_tokens=1024, world_size=2, oversize="split", hidden_size=512),
    "pad_truncate": _case(lognormal(8_000, 4), max_tokens=1024, mode="pad", world_size=2, oversize="truncate"),
    "seqlen_warmup": _case(
        lognormal(10_000, 5),
        max_tokens=2048,
        world_size=2,
        epochs=2,
        oversize="split",
        seqlen_warmup_min=128,
        seqlen_warmup_tokens=400_000,
    ),
    "loss_tokens": _case(
        _with_empty(lognormal(10_000, 6)),
        True,
        max_tokens=2048,
        world_size=2,
        tokens_per_step=16_384,
        oversize="drop",
        drop_empty=True,
    ),
    "cost_balance": _case(
        lognormal(10_000, 7),
        max_tokens=8192,
        world_size=4,
        micro_batches=3,
        balance="compute",
        hidden_size=256,
        balance_window=4,
        oversize="truncate",
    ),
    "wide_lengths": _case(
        lognormal(3_000, 8, longest=300_000) * 40, max_tokens=100_000, world_size=2, oversize="split"
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_plans_of_narrow_and_wide_lengths_are_identical(tmp_path, monkeypatch, name):
    config, values, with_loss = CASES[name]
    loss = loss_column(values) if with_loss else None
    dtypes = [np.int32, np.int64] + ([np.uint16] if values.max() < 2**16 else [])
    written = {}
    for dtype in dtypes:
        path = tmp_path / f"{np.dtype(dtype).name}.arrow"
        loss_tokens = None if loss is None else loss.astype(dtype)
        plan = build_and_write(values.astype(dtype), config, path, loss_tokens=loss_tokens)
        assert plan.entries.length.dtype == length_dtype(int(plan.entries.length.max()))
        written[np.dtype(dtype).name] = path.read_bytes()
    # Entries held as int32 whatever they hold: the plans made before lengths were narrowed.
    monkeypatch.setattr(entries_module, "length_dtype", lambda longest: np.dtype(np.int32))
    path = tmp_path / "int32_entries.arrow"
    plan = build_and_write(values.astype(np.int32), config, path, loss_tokens=None if loss is None else loss)
    assert plan.entries.length.dtype == np.int32
    written["int32 entries"] = path.read_bytes()
    first = written["int32"]
    assert {key: data == first for key, data in written.items()} == dict.fromkeys(written, True)


def test_validate_checks_a_truncated_warmup_plan_against_narrow_lengths(tmp_path):
    # Truncate caps coverage at max_tokens, here above uint16's range; the warmup makes spans.
    values = lognormal(4_000, 9).astype(np.uint16)
    config = PlanConfig(
        max_tokens=70_000, world_size=2, oversize="truncate", seqlen_warmup_min=1000, seqlen_warmup_tokens=1_000_000
    )
    path = tmp_path / "plan.arrow"
    build_and_write(values, config, path)
    assert check_plan(open_plan(path), values) == []


# -- the fingerprint --------------------------------------------------------------------------------


def _fingerprint_as_int32(lengths, loss_tokens=None) -> str:
    """The fingerprint's definition: one hash over the values as int32."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.int64(len(lengths)).tobytes())
    digest.update(np.ascontiguousarray(lengths, dtype="<i4").data)
    if loss_tokens is not None:
        digest.update(b"loss")
        digest.update(np.ascontiguousarray(loss_tokens, dtype="<i4").data)
    return digest.hexdigest()


@pytest.mark.parametrize("chunk", [7, 100, 1 << 20])
def test_fingerprint_does_not_depend_on_the_dtype(monkeypatch, chunk):
    monkeypatch.setattr(lengths_module, "_CHUNK", chunk)  # 7 and 100 divide 700 values evenly, and 703
    for count in (0, 1, 700, 703):
        values = lognormal(count, count)
        loss = loss_column(values)
        expected = _fingerprint_as_int32(values, loss)
        assert _fingerprint_as_int32(values) != expected or count == 0
        for dtype in (np.uint16, np.int32, np.int64):
            assert fingerprint_lengths(values.astype(dtype)) == _fingerprint_as_int32(values)
            assert fingerprint_lengths(values.astype(dtype), loss.astype(dtype)) == expected
        assert fingerprint_lengths(values.astype(np.uint16)[::1], loss.astype(np.int16)) == expected
        strided = np.repeat(values, 2)[::2]  # not contiguous
        assert fingerprint_lengths(strided.astype(np.int32)[:], loss) == expected


def test_read_lengths_fingerprint_is_the_int32_one(tmp_path):
    values = lognormal(5_000, 10)
    path = write(tmp_path / "a.parquet", length=pa.array(values, pa.int32()))
    read = read_lengths(path)
    assert read.lengths.dtype == np.uint16
    assert read.fingerprint() == _fingerprint_as_int32(values)


# -- memory ---------------------------------------------------------------------------------------


def test_reading_holds_2_bytes_per_sample(tmp_path):
    # numpy reports its arrays to tracemalloc (pyarrow's buffers are its own): reading fills the
    # uint16 array (2 B/sample) from one batch of 2^20 rows at a time, never an int32 array.
    count = 3 * 2**20
    values = np.random.default_rng(11).integers(1, 4096, count, dtype=np.int32)
    path = write(tmp_path / "a.parquet", length=pa.array(values))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        read = read_lengths(path)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read.lengths.dtype == np.uint16 and np.array_equal(read.lengths, values)
    assert peak < 2 * count + 4 * 2**22, f"peak {peak / count:.2f} B/sample"  # + a batch or two
    assert held < 2 * count + 2**20, f"held {held / count:.2f} B/sample"


def test_a_larger_value_anywhere_reads_its_column_again_into_int32(tmp_path):
    """Columns are read into uint16; a value of 2^16 or more in any file (read on any thread, in
    any batch) makes that column be read again into int32, never wrapped; the other column
    stays uint16."""
    values = [[5, 6], [7] * 3, [65_536, 1], [2] * 4]
    paths = [
        write(tmp_path / f"{i}.parquet", length=pa.array(v, pa.int64()), loss=[min(x, 9) for x in v])
        for i, v in enumerate(values)
    ]
    read = read_lengths(paths, loss_tokens_column="loss")
    assert read.lengths.dtype == np.int32 and read.lengths.tolist() == sum(values, [])
    assert read.loss_tokens.dtype == np.uint16 and read.loss_tokens.tolist() == [min(x, 9) for x in sum(values, [])]
    loss_large = [write(tmp_path / "big.parquet", length=pa.array([70_000, 3]), loss=[66_000, 2])]
    read = read_lengths(loss_large, loss_tokens_column="loss")
    assert (read.lengths.dtype, read.loss_tokens.dtype) == (np.int32, np.int32)
    assert read.loss_tokens.tolist() == [66_000, 2]
