"""Balancing ranks by compute: the cost column, the targets, and randomness kept.

Targets (world size 8, max_tokens 8,192, hidden size 4,096, pack): cost imbalance
<= 0.5 % with one micro-batch per rank per step and <= 0.2 % with four, token imbalance
<= 0.5 %; random step composition (balance_window 1) is several times worse. The order
of steps stays random: step index and mean sample length are uncorrelated.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from batchplan import ConfigError
from batchplan.config import PlanConfig
from batchplan.formats.opening import open_plan
from batchplan.formats.plan_writer import write_plan
from batchplan.operations.build import build_plan_file
from batchplan.operations.validate import check_plan
from batchplan.planning.cost import attention_coefficient, micro_batch_costs
from batchplan.planning.epochs import build_plan
from batchplan.reports.summary import summarize_plan

DATA = Path(__file__).resolve().parent.parent / "data"
FILES = ["sharegpt_dialogues_cl100k", "sharegpt_segments_cl100k", "squad11_bert384", "wikipedia_bert512_1m"]


def lognormal(num_samples: int = 100_000) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(np.log(300), 1.0, num_samples), 1, 8192).astype(np.int32)


def summary_of(tmp_path, source, **options) -> dict:
    config = PlanConfig(max_tokens=8192, world_size=8, oversize="split", hidden_size=4096, **options)
    plan = tmp_path / "plan.arrow"
    if isinstance(source, str):
        build_plan_file(DATA / f"{source}.parquet", plan, config)
    else:
        write_plan(build_plan(source, config), plan)
    return summarize_plan(open_plan(plan))


@pytest.mark.parametrize("source", [*FILES, "lognormal"])
@pytest.mark.parametrize(("micro_batches", "target"), [(1, 0.005), (4, 0.002)])
def test_compute_balancing_meets_its_targets(tmp_path, source, micro_batches, target):
    lengths = lognormal() if source == "lognormal" else source
    balanced = summary_of(tmp_path, lengths, micro_batches=micro_batches)
    assert balanced["balance"] == "compute"
    assert balanced["cost_imbalance"] <= target
    assert balanced["token_imbalance"] <= 0.005


@pytest.mark.parametrize("source", ["sharegpt_dialogues_cl100k", "lognormal"])
def test_random_steps_are_much_worse(tmp_path, source):
    """The win is real: with random step composition the same plan is several times worse."""
    lengths = lognormal() if source == "lognormal" else source
    balanced = summary_of(tmp_path, lengths)
    random = summary_of(tmp_path, lengths, balance_window=1)
    token_only = summary_of(tmp_path, lengths, balance="tokens")
    assert random["cost_imbalance"] > 5 * balanced["cost_imbalance"]
    assert token_only["cost_imbalance"] > 5 * balanced["cost_imbalance"]


def test_step_order_stays_random():
    """Balancing groups similar micro-batches into steps but the steps are shuffled:
    averaged over epochs, step index and mean sample length are uncorrelated."""
    config = PlanConfig(max_tokens=8192, world_size=8, micro_batches=4, hidden_size=4096, epochs=8)
    correlations = []
    for epoch in build_plan(lognormal(), config).epochs:
        steps = epoch.num_steps - 1  # the last step is completed by splitting: leave it out
        samples = np.bincount(epoch.step, weights=np.diff(epoch.offsets), minlength=epoch.num_steps)[:steps]
        tokens = np.bincount(epoch.step, weights=epoch.tokens, minlength=epoch.num_steps)[:steps]
        correlations.append(np.corrcoef(np.arange(steps), tokens / samples)[0, 1])
    assert abs(np.mean(correlations)) < 0.05
    assert max(abs(c) for c in correlations) < 0.25


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_cost_column_is_the_cost_model_and_validates(tmp_path, mode):
    lengths = lognormal(20_000)
    config = PlanConfig(max_tokens=8192, mode=mode, world_size=4, hidden_size=1024, epochs=2)
    path = tmp_path / "plan.arrow"
    write_plan(build_plan(lengths, config), path)
    plan = open_plan(path)
    assert plan.metadata["hidden_size"] == 1024
    assert plan.metadata["attention_coefficient"] == attention_coefficient(1024)
    rows = plan.read_rank(1, 2)
    samples = rows.column("samples")
    offsets = samples.offsets.to_numpy().astype(np.int64)
    expected = micro_batch_costs(lengths[samples.values.to_numpy()], offsets, mode, 1 / (12 * 1024))
    np.testing.assert_allclose(rows.column("cost").to_numpy(), expected, rtol=1e-9)
    assert check_plan(plan, lengths) == []


def test_plans_without_hidden_size_have_no_cost_column(tmp_path):
    path = tmp_path / "plan.arrow"
    write_plan(build_plan(lognormal(1000), PlanConfig(max_tokens=8192)), path)
    plan = open_plan(path)
    assert "cost" not in plan.schema.names
    assert summarize_plan(plan)["cost_imbalance"] is None


def test_balance_defaults_and_errors():
    assert PlanConfig(max_tokens=8).balance == "tokens"
    assert PlanConfig(max_tokens=8, hidden_size=64).balance == "compute"
    assert PlanConfig(max_tokens=8, hidden_size=64, balance="tokens").balance == "tokens"
    with pytest.raises(ConfigError, match="needs the attention term"):
        PlanConfig(max_tokens=8, balance="compute")
    with pytest.raises(ConfigError, match="`balance_window` must be >= 1"):
        PlanConfig(max_tokens=8, balance_window=0)
    with pytest.raises(ConfigError, match="`hidden_size` must be >= 1"):
        PlanConfig(max_tokens=8, hidden_size=0)


def test_attention_coefficient_can_be_given_directly(tmp_path):
    """A coefficient fitted to measured times (bench/balance.py) instead of a width: the same
    plan as the width that implies it, and the metadata records it."""
    lengths = lognormal(20_000)
    by_width = PlanConfig(max_tokens=8192, world_size=8, hidden_size=1024)
    by_value = PlanConfig(max_tokens=8192, world_size=8, attention_coefficient=1 / (12 * 1024))
    assert by_value.balance == "compute" and by_value.cost_coefficient == by_width.cost_coefficient
    first, second = build_plan(lengths, by_width), build_plan(lengths, by_value)
    np.testing.assert_array_equal(first.epochs[0].cost, second.epochs[0].cost)
    path = tmp_path / "plan.arrow"
    write_plan(second, path)
    plan = open_plan(path)
    assert plan.metadata["hidden_size"] is None
    assert plan.metadata["attention_coefficient"] == pytest.approx(1 / (12 * 1024))
    assert check_plan(plan, lengths) == []
    with pytest.raises(ConfigError, match="both given"):
        PlanConfig(max_tokens=8, hidden_size=64, attention_coefficient=0.001)
    with pytest.raises(ConfigError, match="finite number >= 0"):
        PlanConfig(max_tokens=8, attention_coefficient=-1.0)
