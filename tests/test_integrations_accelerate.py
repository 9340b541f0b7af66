"""An Accelerate custom loop replays a plan exactly with prepare_plan_loader (2 real processes).

Pack (``--micro-batches 2``, loader with 2 workers) and ``--tokens-per-step`` plans, 2
epochs: each rank trains exactly the plan's micro-batches and ends with the plain
loop's parameters; ``accelerator.save_state`` inside epoch 2 and ``load_state`` in
fresh objects train exactly the rest, to the same parameters; and
``accelerator.prepare(plan loader)``, which would re-shard each rank's plan, is refused.
"""

from __future__ import annotations

import pytest
from _integration_worker import assert_resumed, assert_same_params, planned, stack_runs

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow


@pytest.fixture
def runs(integration_runs):
    return stack_runs(integration_runs, "accelerate")


def test_each_rank_trains_exactly_the_plan_with_the_plain_loops_parameters(runs):
    results, plans = runs
    for rank, result in enumerate(results):
        for name, path in plans.items():
            assert result[name]["plain"]["seen"] == result[name]["full"]["seen"] == planned(path, rank)
            assert_same_params(result[name]["full"]["params"], result[name]["plain"]["params"])


def test_save_state_inside_epoch_two_resumes_exactly(runs):
    results, plans = runs
    for rank, result in enumerate(results):
        for name, path in plans.items():
            assert_resumed(result[name]["first"], result[name]["rest"], result[name]["full"], path, rank)


def test_accelerator_prepare_of_a_plan_loader_is_refused(runs):
    results, _ = runs
    for result in results:
        assert result["refused"].startswith("PlanMismatchError") and "prepare_plan_loader" in result["refused"]
