"""One definition per statistic: the table, --json and the plot show the same numbers.

`batchplan.reports.statistics` is checked against a slow loop (hypothesis); then, on 24 plans
(pack and pad, drop-last, ramp-up, sequence-length warmup, compute costs, resharded),
every statistic of ``inspect --json`` appears, formatted the same way, in the
``inspect`` table, in the plot's summary panel and in the plot's legends and titles.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from batchplan.config import PlanConfig
from batchplan.formats.opening import open_plan
from batchplan.formats.plan_writer import write_plan
from batchplan.operations.reshard import reshard_plan_file
from batchplan.planning.epochs import build_plan
from batchplan.reports.statistics import last_steps_of, rank_imbalance
from batchplan_cli.main import app

runner = CliRunner()


# -- the definitions against a loop ---------------------------------------------------------


def loop_imbalance(per_rank, last_steps):
    regular, ends = [], []
    for index, row in enumerate(per_rank.tolist()):
        mean = sum(row) / len(row)
        if mean <= 0:
            continue
        (ends if index in set(last_steps.tolist()) else regular).append(max(row) / mean - 1)
    if not regular:  # nothing to average: None, shown as "n/a"
        return None, None, None, (sum(ends) / len(ends) if ends else None)
    last = sum(ends) / len(ends) if ends else None
    return sum(regular) / len(regular), float(np.percentile(regular, 99)), max(regular), last


@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=4),
    st.integers(1, 5),
    st.integers(0, 2**32 - 1),
)
def test_rank_imbalance_equals_a_loop(steps_per_epoch, world_size, seed):
    num_steps = sum(steps_per_epoch)
    rng = np.random.default_rng(seed)
    per_rank = rng.integers(0, 4, (num_steps, world_size)).astype(np.float64)  # idle steps and ranks too
    last = last_steps_of(steps_per_epoch)
    found = rank_imbalance(per_rank, last)
    expected = loop_imbalance(per_rank, last)
    for value, wanted in zip((found.mean, found.p99, found.max, found.last_step), expected):
        assert value == (None if wanted is None else pytest.approx(wanted))


# -- table = JSON = plot ------------------------------------------------------------------


MATRIX_LENGTHS = np.minimum(np.random.default_rng(5).lognormal(5.0, 0.9, 700), 900).astype(np.int32) + 1
IDLE_LENGTHS = np.array([10, 20, 30], np.int32)  # one step of 8 ranks: 5 idle


def plan_matrix(directory) -> list:
    lengths = MATRIX_LENGTHS
    paths = []
    options = itertools.product(
        ("pack", "pad"),
        (False, True),  # drop_last
        ("plain", "rampup", "warmup"),
        (None, 256),  # hidden size: compute costs
    )
    for mode, drop_last, schedule, hidden_size in options:
        config = PlanConfig(
            max_tokens=1024,
            mode=mode,
            world_size=4,
            epochs=2,
            micro_batches=2,
            drop_last=drop_last,
            hidden_size=hidden_size,
            seed=len(paths),
            **({"rampup_start": 4096, "rampup_tokens": 60_000} if schedule == "rampup" else {}),
            **({"seqlen_warmup_min": 128, "seqlen_warmup_tokens": 40_000} if schedule == "warmup" else {}),
        )
        path = directory / f"plan{len(paths)}.arrow"
        write_plan(build_plan(lengths, config), path)
        paths.append(path)
    resharded = directory / "resharded.arrow"
    reshard_plan_file(paths[1], resharded, world_size=3, from_step=int(open_plan(paths[1]).num_steps // 2))
    idle = directory / "idle.arrow"  # one step, every rank but 3 idle: nothing to average
    config = PlanConfig(max_tokens=64, world_size=8, hidden_size=64)
    write_plan(build_plan(IDLE_LENGTHS, config), idle)
    return [*paths, resharded, idle]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    return plan_matrix(tmp_path_factory.mktemp("statistics"))


def shown(summary: dict) -> dict[str, str]:
    """Each statistic as every output formats it."""
    names = ["fill", "padding_fraction", "token_imbalance", "token_imbalance_p99", "token_imbalance_max"]
    names += ["token_imbalance_last_step"]
    if summary["hidden_size"] is not None:
        names += ["cost_imbalance", "cost_imbalance_p99", "cost_imbalance_max", "cost_imbalance_last_step"]
    return {name: "n/a" if summary[name] is None else f"{summary[name]:.3%}" for name in names}


def counted_from_rows(path, lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Each rank's tokens over the whole plan, and the samples an epoch does not train whole
    (all or some of their pieces left out; one sample short in two epochs counts twice),
    from the rows and the lengths alone."""
    plan = open_plan(path)
    tokens = np.zeros(plan.world_size, np.int64)
    short = 0
    for epoch in range(plan.num_epochs):
        covered = np.zeros(lengths.size, np.int64)
        for rank in range(plan.world_size):
            rows = plan.read_rank(epoch, rank)
            tokens[rank] += int(np.asarray(rows.column("tokens")).sum())
            samples = np.asarray(rows.column("samples").flatten())
            has_spans = "lengths" in rows.schema.names  # pieces of samples
            np.add.at(covered, samples, np.asarray(rows.column("lengths").flatten()) if has_spans else lengths[samples])
        short += int((covered < lengths).sum())
    return tokens, short


def test_inspect_json_says_how_each_plan_was_built(plans):
    """The summary's mode, ramp-up, warmup, parent, drops and idle ranks agree with the build
    options the plan records and with its rows, on every plan of the matrix (which holds
    each kind: a summary field that is never set fails here)."""
    kinds = Counter()
    for path in plans:
        summary = json.loads(runner.invoke(app, ["inspect", str(path), "--json"]).stdout)
        metadata = open_plan(path).metadata
        config = metadata["config"]
        assert summary["mode"] == config["mode"]
        rampup, warmup = summary["rampup"], summary["seqlen_warmup"]
        assert (rampup is not None) == (config["rampup_start"] is not None)
        if rampup is not None:
            assert (rampup["start_tokens"], rampup["ramp_tokens"]) == (config["rampup_start"], config["rampup_tokens"])
            assert rampup["first_step_tokens"] <= config["rampup_start"]
        assert (warmup is not None) == (config["seqlen_warmup_min"] is not None)
        parent = metadata.get("resharded_from")
        assert (summary["resharded_from"] is None) == (parent is None)
        if parent is not None:
            shown_keys = ("content_hash", "world_size", "from_step", "epoch")
            assert summary["resharded_from"] == {key: parent[key] for key in shown_keys}
        tokens, short = counted_from_rows(path, IDLE_LENGTHS if path.name == "idle.arrow" else MATRIX_LENGTHS)
        assert summary["idle_ranks"] == int((tokens == 0).sum())
        if summary["resharded_from"] is None:  # a resharded plan holds what its parent had left
            assert summary["dropped_samples"] == short
        kinds["pad"] += config["mode"] == "pad"
        kinds["rampup"] += rampup is not None
        kinds["warmup"] += warmup is not None
        kinds["resharded"] += summary["resharded_from"] is not None
        kinds["drops"] += summary["dropped_samples"] > 0
        kinds["idle"] += summary["idle_ranks"] > 0
    assert len(plans) >= 20 and min(kinds.values()) > 0, kinds


def test_table_json_and_plot_show_the_same_numbers(plans):
    pytest.importorskip("matplotlib")
    from batchplan.reports.plot import plot_plan
    from batchplan.reports.summary import summarize_plan

    for path in plans:
        result = runner.invoke(app, ["inspect", str(path), "--json"])
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout)
        assert summary == json.loads(json.dumps(summarize_plan(open_plan(path))))
        table = runner.invoke(app, ["inspect", str(path)], env={"COLUMNS": "200"}).stdout
        figure = plot_plan(open_plan(path))
        texts = [text.get_text() for ax in figure.axes for text in ax.texts]
        texts += [ax.get_title() for ax in figure.axes]
        texts += [t.get_text() for ax in figure.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        plot_text = "\n".join(texts)
        for name, value in shown(summary).items():
            assert value in table, (path.name, name, value)
            assert value in plot_text, (path.name, name, value)
        legend = [t for t in texts if t.startswith("tokens (mean")][0]
        assert f"mean {shown(summary)['token_imbalance']}" in legend
        import matplotlib.pyplot as plt

        plt.close(figure)
