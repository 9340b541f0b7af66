"""One definition per statistic: the table, --json and the plot show the same numbers.

`batchplan.reports.statistics` is checked against a slow loop (hypothesis); then, on 24 plans
(pack and pad, drop-last, ramp-up, sequence-length warmup, compute costs, resharded),
every statistic of ``inspect --json`` appears, formatted the same way, in the
``inspect`` table, in the plot's summary panel and in the plot's legends and titles.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from batchplan.config import PlanConfig
from batchplan.formats.opening import open_plan
from batchplan.formats.plan_writer import write_plan
from batchplan.planning.epochs import build_plan
from batchplan.operations.reshard import reshard_plan_file
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


def plan_matrix(directory) -> list:
    rng = np.random.default_rng(5)
    lengths = np.minimum(rng.lognormal(5.0, 0.9, 700), 900).astype(np.int32) + 1
    paths = []
    options = itertools.product(
        ("pack", "pad"),
        (False, True),  # drop_last
        ("plain", "rampup", "warmup"),
        (None, 256),  # hidden size: compute costs
    )
    for mode, drop_last, schedule, hidden_size in options:
        config = PlanConfig(
            max_tokens=1024, mode=mode, world_size=4, epochs=2, micro_batches=2, drop_last=drop_last,
            hidden_size=hidden_size, seed=len(paths),
            **({"rampup_start": 4096, "rampup_tokens": 60_000} if schedule == "rampup" else {}),
            **({"seqlen_warmup_min": 128, "seqlen_warmup_tokens": 40_000} if schedule == "warmup" else {}),
        )  # fmt: skip
        path = directory / f"plan{len(paths)}.arrow"
        write_plan(build_plan(lengths, config), path)
        paths.append(path)
    resharded = directory / "resharded.arrow"
    reshard_plan_file(paths[1], resharded, world_size=3, from_step=int(open_plan(paths[1]).num_steps // 2))
    idle = directory / "idle.arrow"  # one step, every rank but 3 idle: nothing to average
    config = PlanConfig(max_tokens=64, world_size=8, hidden_size=64)
    write_plan(build_plan(np.array([10, 20, 30], np.int32), config), idle)
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


def test_the_matrix_has_twenty_plans_and_every_kind(plans):
    assert len(plans) >= 20
    summaries = [json.loads(runner.invoke(app, ["inspect", str(p), "--json"]).stdout) for p in plans]
    assert {s["mode"] for s in summaries} == {"pack", "pad"}
    assert any(s["rampup"] for s in summaries) and any(s["seqlen_warmup"] for s in summaries)
    assert any(s["resharded_from"] for s in summaries) and any(s["dropped_samples"] for s in summaries)
    imbalanced = [s for s in summaries if s["token_imbalance"] is not None]
    assert any(s["token_imbalance_last_step"] > s["token_imbalance"] for s in imbalanced)
    assert any(s["fill"] is None and s["token_imbalance"] is None and s["idle_ranks"] for s in summaries)


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
