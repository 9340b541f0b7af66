"""`inspect --plot` and `compare --plot`: the figures exist and hold the expected panels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from batchplan.operations.build import build_plan_file
from batchplan.config import PlanConfig
from batchplan.errors import BatchPlanError, PlanMismatchError
from batchplan.formats.plan_file import open_plan
from batchplan_cli.main import app

pytest.importorskip("matplotlib")

from batchplan.reports.plot import PLAN_PANELS, plan_lengths, plot_plan  # noqa: E402
from batchplan.reports.plot_compare import plot_comparison  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "data"
DIALOGUES = DATA / "sharegpt_dialogues_cl100k.parquet"
SQUAD = DATA / "squad11_bert384.parquet"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
runner = CliRunner()


@pytest.fixture(scope="module")
def squad_plan(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "squad.arrow"
    build_plan_file(SQUAD, path, PlanConfig(max_tokens=4096, world_size=4, micro_batches=2, epochs=2, drop_last=True))
    return path


def titles(figure) -> list[str]:
    return [ax.get_title() for ax in figure.axes]


def test_plan_figure_has_six_titled_panels(squad_plan):
    plan = open_plan(squad_plan)
    figure = plot_plan(plan)
    assert len(figure.axes) == len(PLAN_PANELS) == 6
    found = titles(figure)
    assert found[0].startswith("tokens per micro-batch (no lengths: --dataset)")
    assert found[1].startswith("micro-batch fill: ")
    assert found[2].startswith("tokens per step: mean")
    assert found[3] == "rank imbalance per step (max / mean - 1): tokens (no cost column)"
    # Every step has 2 micro-batches per rank: the panel says so and draws the tokens seen.
    assert found[4].startswith("tokens seen; micro-batches per step: always 2 per rank")
    assert found[5] == "summary"
    for ax in figure.axes[:5]:
        assert ax.get_xlabel() and ax.get_ylabel()
    assert "(%)" in figure.axes[3].get_ylabel()
    settings = figure.get_suptitle()
    for expected in ("squad.arrow", "pack", "max_tokens 4,096", "world_size 4", "2 micro-batch(es)", "2 epoch(s)"):
        assert expected in settings


def test_lengths_come_from_the_dataset_when_given(squad_plan):
    plan = open_plan(squad_plan)
    lengths, label = plan_lengths(plan, SQUAD)
    assert lengths.shape == (88_641,) and label == "sample lengths (from --dataset)"
    figure = plot_plan(plan, lengths, label)
    assert titles(figure)[0] == label
    assert figure.axes[0].get_ylabel() == "samples"
    with pytest.raises(PlanMismatchError, match="pass the plan's own dataset"):
        plan_lengths(plan, DIALOGUES)


def test_spans_give_entry_lengths_and_pad_mode_shows_padding(tmp_path):
    path = tmp_path / "pad.arrow"
    build_plan_file(DIALOGUES, path, PlanConfig(max_tokens=8192, world_size=8, mode="pad", oversize="split"))
    plan = open_plan(path)
    lengths, label = plan_lengths(plan)
    assert label == "entry lengths (samples cut by --oversize split)" and lengths.max() <= 8192
    assert ", padding " in titles(plot_plan(plan, lengths, label))[1]
    path = tmp_path / "pad_whole.arrow"
    build_plan_file(SQUAD, path, PlanConfig(max_tokens=4096, world_size=2, mode="pad"))
    assert plan_lengths(open_plan(path)) == (None, "")
    assert titles(plot_plan(open_plan(path)))[0].startswith("longest sample per micro-batch")


def test_cost_column_is_drawn_when_present(squad_plan, tmp_path):
    """Plans with a per-row ``cost`` column (compute balancing) show cost imbalance too."""
    reader = pa.ipc.open_file(pa.memory_map(str(squad_plan)))
    batches = []
    for i in range(reader.num_record_batches):
        batch = reader.get_batch(i)
        cost = pa.array(batch.column("tokens").to_numpy() * 1.25 + np.arange(batch.num_rows), pa.float64())
        batches.append(pa.RecordBatch.from_arrays([*batch.columns, cost], names=[*batch.schema.names, "cost"]))
    schema = batches[0].schema.with_metadata(reader.schema.metadata)
    with_cost = tmp_path / "cost.arrow"
    with pa.OSFile(str(with_cost), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    figure = plot_plan(open_plan(with_cost))
    assert titles(figure)[3] == "rank imbalance per step (max / mean - 1): tokens and cost"
    labels = [line.get_label() for line in figure.axes[3].get_lines()]
    assert any(label.startswith("cost (mean") for label in labels)


def test_cli_writes_png_and_keeps_json_clean(squad_plan, tmp_path):
    image = tmp_path / "plan.png"
    result = runner.invoke(app, ["inspect", str(squad_plan), "--plot", str(image)])
    assert result.exit_code == 0, result.output
    assert f"wrote {image}" in " ".join(result.stdout.split())
    assert image.read_bytes()[:8] == PNG_MAGIC
    image.unlink()
    result = runner.invoke(app, ["inspect", str(squad_plan), "--json", "--plot", str(image), "-d", str(SQUAD)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["num_samples"] == 88_641
    assert image.read_bytes()[:8] == PNG_MAGIC
    result = runner.invoke(app, ["inspect", str(squad_plan), "--plot", str(tmp_path / "no" / "p.png")])
    assert result.exit_code == 1 and "does not exist" in result.stderr


def test_comparison_figure_has_four_bar_panels():
    from batchplan.reports.compare import compare_strategies

    lengths = np.random.default_rng(0).integers(1, 300, 2000)
    figure = plot_comparison(compare_strategies(lengths, max_tokens=1024, world_size=4))
    assert len(figure.axes) == 4
    assert titles(figure)[0].startswith("predicted epoch time")
    assert [len(ax.get_xticklabels()) for ax in figure.axes] == [5, 5, 5, 5]
    assert "max_tokens 1,024" in figure.get_suptitle()


def test_missing_matplotlib_is_a_clear_error(squad_plan, monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` fail
    with pytest.raises(BatchPlanError, match=r"pip install 'batchplan\[plot\]'"):
        plot_plan(open_plan(squad_plan))
    result = runner.invoke(app, ["inspect", str(squad_plan), "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 1 and "pip install 'batchplan[plot]'" in result.stderr


def test_plotting_modules_load_matplotlib_only_when_drawing():
    code = ("import sys, batchplan.reports.plot, batchplan.reports.compare, batchplan_cli.main; "
            "print(sorted(m for m in ('matplotlib', 'numba') if m in sys.modules))")  # fmt: skip
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "matplotlib" not in loaded


def test_compare_without_matplotlib_fails_before_computing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setattr("batchplan.reports.compare.compare_strategies", lambda *a, **k: pytest.fail("computed"))
    result = runner.invoke(app, ["compare", str(SQUAD), "--max-tokens", "4096", "--world-size", "2",
                                 "--plot", str(tmp_path / "c.png")])  # fmt: skip
    assert result.exit_code == 1 and "pip install 'batchplan[plot]'" in result.stderr


def test_a_resharded_plan_plots(tmp_path):
    """Steps of a resharded plan start at its first_step; the figure handles that."""
    from batchplan.formats.plan_writer import write_plan
    from batchplan.planning.epochs import build_plan
    from batchplan.operations.reshard import reshard_plan_file

    lengths = np.random.default_rng(0).integers(1, 200, 5000).astype(np.int32)
    parent, child = tmp_path / "parent.arrow", tmp_path / "child.arrow"
    write_plan(build_plan(lengths, PlanConfig(max_tokens=512, world_size=4, epochs=2)), parent)
    reshard_plan_file(parent, child, world_size=3, from_step=50)
    plan = open_plan(child)
    assert len(plot_plan(plan, *plan_lengths(plan, None)).axes) == 6


def test_varying_micro_batches_per_step_and_schedule_ends_are_drawn(tmp_path):
    from batchplan.formats.plan_writer import write_plan
    from batchplan.planning.epochs import build_plan

    lengths = np.random.default_rng(3).integers(20, 900, 3000).astype(np.int32)
    config = PlanConfig(max_tokens=1024, world_size=2, tokens_per_step=8192, rampup_start=2048,
                        rampup_tokens=200_000, seqlen_warmup_min=128, seqlen_warmup_tokens=100_000)  # fmt: skip
    path = tmp_path / "ramp.arrow"
    write_plan(build_plan(lengths, config), path)
    figure = plot_plan(open_plan(path))
    panel = figure.axes[4]
    assert panel.get_title().startswith("micro-batches per step: ")
    labels = [t.get_text() for t in panel.get_legend().get_texts()]
    assert any(label.startswith("ramp-up ends") for label in labels)
    assert any(label.startswith("warmup ends") for label in labels)
    imbalance = [t.get_text() for t in figure.axes[3].get_legend().get_texts()]
    assert any(label.startswith("each epoch's last step") for label in imbalance)
