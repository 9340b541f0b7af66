"""One reader of plan rows: above formats/, batchplan reads a plan's columns only through
`PlanRows` (`OpenedPlan.rank_rows`, `OpenedPlan.epoch_rows`), whose one null policy makes a
null in a plan column a `PlanFormatError` for every reader."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchplan.config import PlanConfig
from batchplan.errors import PlanFormatError
from batchplan.formats.opening import open_plan
from batchplan.formats.plan_rows import PlanRows
from batchplan.formats.plan_writer import write_plan
from batchplan.mixture import Mixture, MixtureSource
from batchplan.operations.build_mixture import build_mixture_plan_file
from batchplan.operations.mixture_checks import check_mixture
from batchplan.operations.reshard import reshard_plan
from batchplan.operations.validate import check_plan
from batchplan.planning.epochs import build_plan
from batchplan.reports.mixture import step_source_tokens
from batchplan.reports.plot import plan_lengths
from batchplan.reports.summary import summarize_plan

ROOT = Path(__file__).resolve().parent.parent
# The code above formats/: what reads plans there reads them through `PlanRows`.
ABOVE_FORMATS = ("batchplan/operations", "batchplan/reports", "batchplan/runtime", "batchplan/integrations", "cli")
# Arrow as such: pyarrow, formats' numpy-over-Arrow helpers, and the plan methods that hand
# out record batches and tables (public, for users; batchplan's own readers take `PlanRows`).
ARROW_MODULES = ("pyarrow", "batchplan.formats.arrow", "batchplan.formats.arrow_file")
ARROW_METHODS = ("read_rank", "read_epoch", "read_all")

LENGTHS = np.random.default_rng(3).integers(1, 120, 300).astype(np.int32)


def arrow_reads(source: str, name: str) -> list[str]:
    """Every import of `ARROW_MODULES` and call of `ARROW_METHODS` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        arrow = [module for module in modules if any(module == m or module.startswith(f"{m}.") for m in ARROW_MODULES)]
        if arrow:
            found.append(f"{name}:{node.lineno} imports {arrow[0]}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ARROW_METHODS:
            found.append(f"{name}:{node.lineno} calls .{node.func.attr}()")
    return found


def test_no_module_above_formats_reads_plan_columns_but_through_plan_rows():
    found = []
    for folder in ABOVE_FORMATS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += arrow_reads(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []


def test_the_scan_finds_arrow_reads():
    source = (
        "import pyarrow.compute as pc\n"
        "from batchplan.formats import arrow\n"
        "from batchplan.formats.arrow import numpy_of\n"
        "def steps(plan):\n"
        "    return numpy_of(plan.read_rank(0, 0).column('step'))\n"
    )
    assert arrow_reads(source, "x.py") == [
        "x.py:1 imports pyarrow.compute",
        "x.py:2 imports batchplan.formats.arrow",
        "x.py:3 imports batchplan.formats.arrow",
        "x.py:5 calls .read_rank()",
    ]


# -- the view -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """pack (spans, cost, two epochs), pad, and a mixture of two sources."""
    directory = tmp_path_factory.mktemp("plans")
    configs = {
        "pack": PlanConfig(max_tokens=96, world_size=2, epochs=2, oversize="split", hidden_size=256),
        "pad": PlanConfig(max_tokens=256, world_size=2, mode="pad"),
    }
    paths = {}
    for name, config in configs.items():
        paths[name] = directory / f"{name}.arrow"
        write_plan(build_plan(LENGTHS, config), paths[name])
    sources = []
    for index, lengths in enumerate((LENGTHS[:200], LENGTHS[200:])):
        pq.write_table(pa.table({"length": lengths}), directory / f"source{index}.parquet")
        sources.append(MixtureSource(name=f"s{index}", paths=(str(directory / f"source{index}.parquet"),), weight=0.5))
    paths["mixture"] = directory / "mixture.arrow"
    config = PlanConfig(max_tokens=256, world_size=2, micro_batches=2)
    build_mixture_plan_file(Mixture(sources=tuple(sources), tokens=40_000), paths["mixture"], config)
    return paths


def test_columns_read_as_pyarrow_converts_them(plans):
    plan = open_plan(plans["pack"])
    batch, rows = plan.read_rank(1, 1), plan.rank_rows(1, 1)
    for name in ("step", "micro", "tokens", "cost"):
        expected = batch.column(name).to_numpy()
        assert rows.numbers(name).dtype == expected.dtype and np.array_equal(rows.numbers(name), expected)
    for name in ("samples", "starts", "lengths"):
        lists = batch.column(name).to_pylist()
        assert rows.entries(name).tolist() == [value for row in lists for value in row]
        assert rows.counts(name).tolist() == [len(row) for row in lists]
        assert rows.offsets(name).dtype == np.int64 and rows.offsets(name)[0] == 0


def test_an_epoch_reads_as_its_ranks_one_after_another(plans):
    plan = open_plan(plans["pack"])
    epoch = plan.epoch_rows(1)
    ranks = [plan.rank_rows(1, rank) for rank in range(plan.world_size)]
    assert np.array_equal(epoch.numbers("tokens"), np.concatenate([r.numbers("tokens") for r in ranks]))
    assert np.array_equal(epoch.entries("starts"), np.concatenate([r.entries("starts") for r in ranks]))
    assert np.array_equal(epoch.counts("samples"), np.concatenate([r.counts("samples") for r in ranks]))
    assert epoch.offsets()[-1] == epoch.entries().shape[0]


def test_padded_tokens_are_the_tokens_of_a_pack_plan_and_the_column_of_a_pad_plan(plans):
    pack, pad = open_plan(plans["pack"]).rank_rows(0, 0), open_plan(plans["pad"]).rank_rows(0, 0)
    assert "padded_tokens" not in pack and np.array_equal(pack.numbers("padded_tokens"), pack.numbers("tokens"))
    longest = [LENGTHS[samples].max(initial=0) for samples in np.split(pad.entries(), pad.offsets()[1:-1])]
    assert "padded_tokens" in pad and np.array_equal(pad.numbers("padded_tokens"), pad.counts() * longest)


def test_a_missing_column_is_a_format_error(plans):
    rows = open_plan(plans["pad"]).rank_rows(0, 1)
    with pytest.raises(PlanFormatError, match="epoch 0 rank 1 has no column 'cost'"):
        rows.numbers("cost")


# -- one null policy ----------------------------------------------------------------------------


def nulled(column: pa.Array) -> pa.Array:
    """``column`` with its first value null: a number, or the first entry of the lists."""
    if pa.types.is_list(column.type):
        values = column.values.to_pylist()
        return pa.ListArray.from_arrays(column.offsets, pa.array([None] + values[1:], column.type.value_type))
    return pa.array([None] + column.to_pylist()[1:], column.type)


def write_with_nulls(source: Path, target: Path, names: list[str] | None = None) -> Path:
    """``source`` with a null in each of ``names`` (default: every column) of every record batch
    that has rows, as a damaged file could hold them (the batches' checksums left out)."""
    reader = pa.ipc.open_file(pa.memory_map(str(source)))
    with pa.ipc.new_file(str(target), reader.schema) as writer:
        for index in range(reader.num_record_batches):
            batch = reader.get_batch(index)
            if batch.num_rows and batch.column("samples").values.to_pylist():
                columns = zip(batch.schema.names, batch.columns)
                nulls = [nulled(c) if names is None or name in names else c for name, c in columns]
                batch = pa.RecordBatch.from_arrays(nulls, schema=reader.schema)
            writer.write_batch(batch)
    return target


@pytest.mark.parametrize("name", ["tokens", "step", "padded_tokens", "samples", "starts"])
def test_a_null_in_a_plan_column_is_a_format_error_naming_it(plans, tmp_path, name):
    source = plans["pad"] if name == "padded_tokens" else plans["pack"]
    path = write_with_nulls(source, tmp_path / "nulls.arrow", [name])
    rows = open_plan(path).rank_rows(0, 0)
    read = rows.numbers if name in ("tokens", "step", "padded_tokens") else rows.entries
    with pytest.raises(PlanFormatError, match=rf"{re.escape(str(path))}: epoch 0 rank 0: column '{name}' holds 1 null"):
        read(name)


def test_a_null_list_is_a_format_error(plans):
    batch = open_plan(plans["pack"]).read_rank(0, 0)
    samples = batch.column("samples")
    mask = pa.array([True] + [False] * (len(samples) - 1))
    null_first = pa.ListArray.from_arrays(samples.offsets, samples.values, mask=mask)
    rows = PlanRows(batch.set_column(batch.schema.get_field_index("samples"), "samples", null_first), "p", "rows")
    with pytest.raises(PlanFormatError, match="column 'samples' holds 1 null value"):
        rows.offsets()


def check_accumulation(path: Path) -> None:
    """Lightning's check of ``accumulate_grad_batches`` against the plan's steps."""
    pytest.importorskip("lightning")
    from batchplan.integrations.lightning import _check_accumulation
    from batchplan.runtime import PlanSampler

    _check_accumulation(types.SimpleNamespace(accumulate_grad_batches=2), PlanSampler(path, rank=0, world_size=2))


def replay(path: Path) -> None:
    from batchplan.runtime import PlanSampler

    list(PlanSampler(path, rank=0, world_size=2))


def step_tokens(path: Path) -> None:
    from batchplan.runtime.lr_schedule import read_step_tokens

    read_step_tokens(path)


# Every reader of plan rows above formats/, with the plan it reads.
READERS = {
    "sampler": ("pack", replay),
    "sampler, pad": ("pad", replay),
    "token LR schedule": ("pack", step_tokens),
    "summary (inspect)": ("pad", lambda path: summarize_plan(open_plan(path))),
    "summary of a mixture": ("mixture", lambda path: summarize_plan(open_plan(path))),
    "plot's lengths": ("pack", lambda path: plan_lengths(open_plan(path))),
    "reshard": ("pack", lambda path: reshard_plan(open_plan(path), world_size=1, from_step=1)),
    "mixture shares": ("mixture", lambda path: step_source_tokens(open_plan(path))),
    "mixture checks": ("mixture", lambda path: check_mixture(open_plan(path))),
    "lightning": ("pack", check_accumulation),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_a_null_is_a_clear_format_error_through_every_reader(plans, tmp_path, reader):
    plan, read = READERS[reader]
    path = write_with_nulls(plans[plan], tmp_path / "nulls.arrow")
    where = rf"^{re.escape(str(path))}: epoch \d+( rank \d+)?: column '\w+' holds 1 null value\(s\)"
    with pytest.raises(PlanFormatError, match=where):
        read(path)


@pytest.mark.parametrize("plan", ["pack", "mixture"])
def test_validate_reports_a_null_as_unreadable_rows(plans, tmp_path, plan):
    path = write_with_nulls(plans[plan], tmp_path / "nulls.arrow")
    found = [str(v) for v in check_plan(open_plan(path)) if v.guarantee == "integrity"]
    assert any("null value" in message and "unreadable" in message for message in found), found
