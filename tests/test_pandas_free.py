"""Inspecting, validating and resharding a plan, and the Lightning adapter's reads of it, leave
pandas out; the summary and the checks read a plan one record batch (or epoch) at a time.

Training images carry pandas, and pyarrow imports it (0.35 s and more) for ``to_numpy``,
``to_pylist`` and ``pa.array``; batchplan reads plan columns over their buffers instead
(`batchplan.formats.arrow`), whose helpers are checked here against pyarrow's own conversions.
Each pandas check runs in a fresh process, like `tests/test_layers.py`.

The Hugging Face adapter has no such check: ``transformers.Trainer`` imports ``datasets``,
which imports pandas, so the process has it whatever batchplan does; its dataset lengths
come from the list offsets (`test_trainer_dataset_lengths_come_from_the_list_offsets`).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from _modules import loaded_after
from _plan_views import RankReader

from batchplan import PlanConfig
from batchplan.formats.arrow import list_lengths, list_offsets, list_values, numpy_of
from batchplan.formats.opening import open_plan
from batchplan.formats.plan_rows import PlanRows
from batchplan.formats.plan_writer import write_plan
from batchplan.operations.validate import check_plan
from batchplan.planning.epochs import build_plan
from batchplan.reports.summary import summarize_plan


def imports_pandas(statement: str) -> bool:
    """Whether running ``statement`` in a fresh interpreter leaves pandas in ``sys.modules``."""
    return "pandas" in loaded_after(statement, watch=("pandas",))


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Its dataset (Parquet) and plans with spans and a cost column, in pad mode, and a
    resharded one: every column and layout the readers handle."""
    directory = tmp_path_factory.mktemp("pandas-free")
    lengths = np.random.default_rng(0).integers(1, 700, 1_500).astype(np.int32)
    lengths[[4, 40, 400]] = [1_500, 2_100, 1_100]
    pq.write_table(pa.table({"length": lengths}), directory / "data.parquet")
    configs = {
        "spans": PlanConfig(
            max_tokens=1024,
            world_size=4,
            epochs=2,
            oversize="split",
            hidden_size=256,
            micro_batches=2,
            seqlen_warmup_min=256,
            seqlen_warmup_tokens=50_000,
        ),
        "pad": PlanConfig(max_tokens=1024, world_size=3, epochs=2, mode="pad", oversize="truncate"),
    }
    paths = {"data": str(directory / "data.parquet")}
    for name, config in configs.items():
        paths[name] = str(directory / f"{name}.arrow")
        write_plan(build_plan(lengths, config), paths[name])
    from batchplan.operations.reshard import reshard_plan_file

    paths["resharded"] = str(directory / "resharded.arrow")
    reshard_plan_file(paths["spans"], paths["resharded"], world_size=3, from_step=5)
    return paths


needs_pandas = pytest.mark.skipif(
    importlib.util.find_spec("pandas") is None,
    reason="the check means something only where pandas is installed",
)


@pytest.mark.slow
@needs_pandas
def test_validating_and_summarising_plans_leave_pandas_out(plans):
    statement = (
        "from batchplan.formats.opening import open_plan\n"
        "from batchplan.operations.validate import validate_plan\n"
        "from batchplan.reports.summary import summarize_plan\n"
        "for name in ('spans', 'pad', 'resharded'):\n"
        f"    path = {plans!r}[name]\n"
        f"    assert validate_plan(path, {plans['data']!r}) == [] and validate_plan(path) == []\n"
        "    plan = open_plan(path)\n"
        "    plan.verify()\n"
        "    assert summarize_plan(plan)['micro_batches'] > 0"
    )
    assert not imports_pandas(statement)


@pytest.mark.slow
@needs_pandas
@pytest.mark.parametrize("command", ["inspect --json", "validate --dataset"])
def test_the_inspect_and_validate_commands_leave_pandas_out(plans, command):
    name, option = command.split()
    extra = [option, plans["data"]] if option == "--dataset" else [option]
    statement = (
        "import contextlib, io\n"
        "from batchplan_cli.main import app\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    app({[name, plans['spans'], *extra]!r}, standalone_mode=False)"
    )
    assert not imports_pandas(statement)


@pytest.mark.slow
@needs_pandas
def test_plotting_a_plan_leaves_pandas_out(plans):
    pytest.importorskip("matplotlib")
    statement = (
        "from batchplan.formats.opening import open_plan\n"
        "from batchplan.reports.plot import plan_lengths, plot_plan\n"
        f"plan = open_plan({plans['spans']!r})\n"
        "plot_plan(plan, *plan_lengths(plan))"
    )
    assert not imports_pandas(statement)


@pytest.mark.slow
@needs_pandas
def test_resharding_a_plan_leaves_pandas_out(plans, tmp_path):
    statement = (
        "from batchplan.operations.reshard import reshard_plan_file\n"
        f"reshard_plan_file({plans['spans']!r}, {str(tmp_path / 'child.arrow')!r}, world_size=2, from_step=7)"
    )
    assert not imports_pandas(statement)


LIGHTNING_FIT = """
import numpy as np
import torch
import lightning.pytorch as pl
from batchplan.integrations.lightning import PlanDataModule, plan_loss

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 4)
    def training_step(self, batch, batch_idx):
        return plan_loss(self.embed(batch["input_ids"]).sum(), batch, self.trainer)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

rows = [{{"input_ids": [i % 64] * int(n)}} for i, n in enumerate(np.load({lengths!r}))]
trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, max_epochs=2, accumulate_grad_batches=2)
trainer.fit(Tiny(), datamodule=PlanDataModule({plan!r}, rows))
assert trainer.global_step > 0
"""


@pytest.mark.slow
@needs_pandas
def test_the_lightning_adapter_reads_its_plan_without_pandas(tmp_path):
    """A fit with automatic optimisation: the data module checks the plan's steps against
    ``accumulate_grad_batches`` (reading every epoch's rows) and the sampler replays it."""
    pytest.importorskip("lightning")
    lengths = np.random.default_rng(0).integers(1, 60, 200).astype(np.int32)
    np.save(tmp_path / "lengths.npy", lengths)
    config = PlanConfig(max_tokens=128, world_size=1, epochs=2, micro_batches=2)
    write_plan(build_plan(lengths, config), tmp_path / "plan.arrow")
    statement = LIGHTNING_FIT.format(lengths=str(tmp_path / "lengths.npy"), plan=str(tmp_path / "plan.arrow"))
    assert not imports_pandas(statement)


def test_trainer_dataset_lengths_come_from_the_list_offsets():
    pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    from batchplan.formats.datasets_folder import loaded_dataset_lengths

    dataset = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in (3, 0, 7, 1)]})
    lengths = loaded_dataset_lengths(dataset)
    expected = pc.list_value_length(dataset.data.column("input_ids")).to_numpy()
    assert lengths.dtype == expected.dtype and lengths.tolist() == expected.tolist() == [3, 0, 7, 1]


# -- the buffer helpers agree with pyarrow's conversions ------------------------------------------


def chunked(arrays: list, arrow_type: pa.DataType) -> pa.ChunkedArray:
    """Chunks, one of them a slice (an offset into its buffers), and an empty one."""
    whole = pa.array(arrays, type=arrow_type)
    return pa.chunked_array([whole.slice(0, 2), whole.slice(2, 0), whole.slice(2)], type=arrow_type)


@pytest.mark.parametrize("arrow_type", [pa.int32(), pa.int64(), pa.float64()])
def test_numpy_of_a_chunked_array_equals_to_numpy(arrow_type):
    for array in (
        chunked([5, 1, 7, 2, 9], arrow_type),
        pa.chunked_array([], type=arrow_type),
        pa.chunked_array([pa.array([3, 4], type=arrow_type)]),
    ):
        expected = array.to_numpy()
        assert numpy_of(array).dtype == expected.dtype and numpy_of(array).tolist() == expected.tolist()


@pytest.mark.parametrize("arrow_type", [pa.list_(pa.int32()), pa.list_(pa.int64()), pa.large_list(pa.int64())])
def test_list_helpers_equal_pyarrows_flatten_and_lengths(arrow_type):
    rows = [[1, 2], [], [3], [4, 5, 6], [7]]
    for array in (
        chunked(rows, arrow_type),
        pa.array(rows, type=arrow_type).slice(1, 3),
        pa.chunked_array([], type=arrow_type),
    ):
        combined = array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array
        values = combined.flatten().to_numpy()
        assert list_values(array).dtype == values.dtype and list_values(array).tolist() == values.tolist()
        lengths = pc.list_value_length(array).to_numpy()
        assert list_lengths(array).dtype == lengths.dtype and list_lengths(array).tolist() == lengths.tolist()
        assert list_offsets(array).tolist() == [0, *np.cumsum(lengths).tolist()]


def test_list_lengths_of_fixed_size_lists():
    array = pa.array([[1, 2], [3, 4], [5, 6]], type=pa.list_(pa.int64(), 2))
    assert list_lengths(array).tolist() == [2, 2, 2] and list_lengths(array).dtype == np.int32


# -- one record batch or epoch at a time ----------------------------------------------------------


@pytest.mark.parametrize("name", ["spans", "pad", "resharded"])
def test_summary_and_checks_use_only_the_plan_interface(plans, name):
    plan = open_plan(plans[name])
    assert summarize_plan(RankReader(plan)) == summarize_plan(plan)
    lengths = pq.read_table(plans["data"]).column("length").to_numpy()
    assert check_plan(RankReader(plan), lengths) == []


def test_plan_rows_read_every_column_as_its_dtype(plans):
    """`PlanRows`, every reader's view of plan rows, reads columns as pyarrow would convert them."""
    table = open_plan(plans["spans"]).read_epoch(1)
    rows = PlanRows(table, plans["spans"], "epoch 1")
    for name in ("step", "tokens", "cost", "micro"):
        expected = table.column(name).to_numpy()
        assert rows.numbers(name).dtype == expected.dtype and np.array_equal(rows.numbers(name), expected)
    assert np.array_equal(rows.entries("samples"), table.column("samples").combine_chunks().flatten().to_numpy())
    assert np.array_equal(rows.offsets(), table.column("samples").combine_chunks().offsets.to_numpy())
