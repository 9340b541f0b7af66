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

from batchplan.config import PlanConfig
from batchplan.errors import BatchPlanError, PlanMismatchError
from batchplan.formats.opening import open_plan
from batchplan.operations.build import build_plan_file
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
    assert found[0].startswith("tokens per micro-batch (no dataset given)")
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
    assert lengths.shape == (88_641,) and label == "sample lengths (from the dataset)"
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
    assert label == "entry lengths (oversize samples: split)" and lengths.max() <= 8192
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
    with pytest.raises(BatchPlanError, match=r"pip install -e '\.\[plot\]'"):
        plot_plan(open_plan(squad_plan))
    result = runner.invoke(app, ["inspect", str(squad_plan), "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 1 and "pip install -e '.[plot]'" in result.stderr


@pytest.mark.slow
def test_plotting_modules_load_matplotlib_only_when_drawing():
    code = (
        "import sys, batchplan.reports.plot, batchplan.reports.figure, batchplan.reports.compare, batchplan_cli.main; "
        "print(sorted(m for m in ('matplotlib', 'numba') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "matplotlib" not in loaded


def test_compare_without_matplotlib_fails_before_computing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setattr("batchplan.reports.compare.compare_strategies", lambda *a, **k: pytest.fail("computed"))
    result = runner.invoke(
        app, ["compare", str(SQUAD), "--max-tokens", "4096", "--world-size", "2", "--plot", str(tmp_path / "c.png")]
    )
    assert result.exit_code == 1 and "pip install -e '.[plot]'" in result.stderr


def test_a_resharded_plan_plots(tmp_path):
    """Steps of a resharded plan start at its first_step; the figure handles that."""
    from batchplan.formats.plan_writer import write_plan
    from batchplan.operations.reshard import reshard_plan_file
    from batchplan.planning.epochs import build_plan

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
    config = PlanConfig(
        max_tokens=1024,
        world_size=2,
        tokens_per_step=8192,
        rampup_start=2048,
        rampup_tokens=200_000,
        seqlen_warmup_min=128,
        seqlen_warmup_tokens=100_000,
    )
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


def micro_batch_values(plan) -> dict[str, np.ndarray]:
    """The per-micro-batch values the histograms count, read row by row (the slow reference)."""
    batches = [plan.read_rank(e, r) for e in range(plan.num_epochs) for r in range(plan.world_size)]
    tokens = np.concatenate([b.column("tokens").to_numpy() for b in batches])
    padded_name = "padded_tokens" if "padded_tokens" in plan.schema.names else "tokens"  # pack: no padding
    padded = np.concatenate([b.column(padded_name).to_numpy() for b in batches])
    counts = np.array([len(samples) for b in batches for samples in b.column("samples").to_pylist()], np.int64)
    nonempty = counts > 0
    return {
        "tokens": tokens,
        "padded": padded,
        "nonempty_tokens": tokens[nonempty],
        "longest": padded[nonempty] // counts[nonempty],
    }


def drawn_histograms(monkeypatch, plan) -> list[tuple[np.ndarray, np.ndarray]]:
    """(counts, bin edges) of every `Axes.hist` that `plot_plan` draws, in order."""
    from matplotlib.axes import Axes

    drawn, hist = [], Axes.hist

    def recording(self, *args, **kwargs):
        counts, edges, patches = hist(self, *args, **kwargs)
        drawn.append((np.asarray(counts), np.asarray(edges)))
        return counts, edges, patches

    monkeypatch.setattr(Axes, "hist", recording)
    figure = plot_plan(plan)
    bars = [p.get_height() for p in figure.axes[0].patches]
    assert bars == list(drawn[0][0])  # the lengths panel's bars are the counts recorded
    return drawn


def lengths_bins(values: np.ndarray) -> np.ndarray | int:
    """The lengths panel's bins over the positive per-micro-batch values themselves."""
    if values.size and values.max() > 20 * max(1.0, float(np.median(values))):
        return np.geomspace(max(1, values.min()), values.max() + 1, 60)
    return 60


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_histograms_count_exactly_the_micro_batch_values(tmp_path, monkeypatch, mode):
    """Drawn from counts of each integer, every histogram has the counts and bins of one drawn
    over the per-micro-batch values; pad lengths with a wide spread take geometric bins."""
    from batchplan.formats.plan_writer import write_plan
    from batchplan.planning.epochs import build_plan

    rng = np.random.default_rng(7)
    cap, lengths = 4096, rng.integers(1, 700, 4000)
    if mode == "pad":  # mostly short samples, a few long: the longest per micro-batch spreads widely
        cap, lengths = 512, np.where(rng.random(4000) < 0.995, rng.integers(1, 9, 4000), rng.integers(200, 513, 4000))
    path = tmp_path / f"{mode}.arrow"
    config = PlanConfig(max_tokens=cap, world_size=3, micro_batches=2, epochs=2, mode=mode)
    write_plan(build_plan(lengths.astype(np.int32), config), path)
    plan = open_plan(path)
    drawn = drawn_histograms(monkeypatch, plan)
    values = micro_batch_values(plan)
    shown = values["longest" if mode == "pad" else "nonempty_tokens"]
    shown = shown[shown > 0]
    bins = lengths_bins(shown)
    assert isinstance(bins, np.ndarray) == (mode == "pad")  # geometric bins in pad mode only
    fill_bins = np.linspace(0, 100, 51)
    expected = [np.histogram(shown, bins=bins), np.histogram(100.0 * values["tokens"] / cap, fill_bins)]
    if mode == "pad":
        expected.append(np.histogram(100.0 * values["padded"] / cap, fill_bins))
    assert len(drawn) == len(expected)
    for (counts, edges), (want_counts, want_edges) in zip(drawn, expected):
        np.testing.assert_array_equal(edges, want_edges)
        np.testing.assert_array_equal(counts, want_counts)
    assert drawn[1][0].sum() == values["tokens"].size  # every micro-batch lies in 0..100 %


def test_scan_memory_does_not_grow_with_micro_batches(tmp_path):
    """The scan for the figure holds per-step numbers and counts of 0..max_tokens + 1, nothing
    per micro-batch."""
    from batchplan.formats.plan_writer import write_plan
    from batchplan.planning.epochs import build_plan
    from batchplan.reports.summary import scan_plan

    lengths = np.random.default_rng(1).integers(1, 100, 20_000).astype(np.int32)
    path = tmp_path / "many.arrow"
    write_plan(build_plan(lengths, PlanConfig(max_tokens=256, world_size=4, micro_batches=2, mode="pad")), path)
    plan = open_plan(path)
    scan = scan_plan(plan, histograms=True)
    assert scan.micro_batches > 10 * (256 + 2) and scan.micro_batches > 4 * plan.num_steps
    assert sorted(scan.histograms) == ["longest", "nonempty_tokens", "padded", "tokens"]
    for counts in scan.histograms.values():
        assert counts.shape == (256 + 2,) and counts.dtype == np.int64
    assert scan.histograms["tokens"].sum() == scan.micro_batches
    arrays = [v for v in vars(scan).values() if isinstance(v, np.ndarray) and v.ndim]
    assert arrays and all(a.size <= max(plan.num_steps, 256 + 2) for a in arrays)
    assert scan_plan(plan).histograms is None


def test_values_above_max_tokens_count_in_the_last_bucket(squad_plan, tmp_path):
    """A corrupt plan (a micro-batch over max_tokens) still plots, and the note counts it."""
    from batchplan.reports.summary import scan_plan

    reader = pa.ipc.open_file(pa.memory_map(str(squad_plan)))
    batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    tokens = batches[0].column("tokens").to_numpy().copy()
    tokens[0] = 4096 + 5
    index = batches[0].schema.get_field_index("tokens")
    batches[0] = batches[0].set_column(index, batches[0].schema.field(index), pa.array(tokens, pa.int64()))
    corrupt = tmp_path / "corrupt.arrow"
    with pa.OSFile(str(corrupt), "wb") as sink, pa.ipc.new_file(sink, reader.schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    scan = scan_plan(open_plan(corrupt), histograms=True)
    assert scan.histograms["tokens"][-1] == scan.histograms["nonempty_tokens"][-1] == 1
    notes = [t.get_text() for t in plot_plan(open_plan(corrupt)).axes[0].texts]
    assert any("1 > max_tokens" in note for note in notes)


def test_a_mixture_plan_draws_each_sources_share_of_the_steps(tmp_path):
    from batchplan import PlanConfig
    from batchplan.operations.build_mixture import build_mixture_plan_file
    from batchplan.reports.mixture import step_source_tokens

    path = tmp_path / "mix.arrow"
    mixture = Path(__file__).resolve().parent.parent / "data" / "mixture.yaml"
    build_mixture_plan_file(mixture, path, PlanConfig(max_tokens=8192, world_size=8, micro_batches=4, oversize="split"))
    plan = open_plan(path)
    figure = plot_plan(plan)
    panel = figure.axes[4]
    assert panel.get_title().startswith("share of each step, per source")
    assert [line.get_label() for line in panel.get_lines()][:1] == ["chat"]
    per_step = step_source_tokens(plan)
    counted = np.zeros_like(per_step)  # the same tokens recounted from the rows' samples
    bounds = np.array([s["offset"] for s in plan.metadata["mixture"]["sources"]] + [plan.num_samples])
    for rank in range(plan.world_size):
        for row in plan.read_rank(0, rank).to_pylist():
            if row["samples"]:
                counted[row["step"], np.searchsorted(bounds, row["samples"][0], side="right") - 1] += row["tokens"]
    assert (counted == per_step).all()
