"""An Accelerate custom loop replays a plan exactly with prepare_plan_loader (2 real processes).

Pack (``--micro-batches 2``, loader with 2 workers) and ``--tokens-per-step`` plans, 2
epochs: each rank trains exactly the plan's micro-batches and ends with the plain
loop's parameters; ``accelerator.save_state`` inside epoch 2 and ``load_state`` in
fresh objects train exactly the rest, to the same parameters; and
``accelerator.prepare(plan loader)``, which would re-shard each rank's plan, is refused.
"""

from __future__ import annotations

import pytest
import torch
from _ddp_plans import free_port, sample_lengths
from _integration_worker import accelerate_checks
from _spawn import launch
from test_integrations_transformers import integration_plans, planned

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow
WORLD_SIZE = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("accelerate")
    lengths = sample_lengths()
    plans = integration_plans(directory / "plans", lengths)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(WORLD_SIZE)}
    launch(accelerate_checks, (plans, lengths, str(directory)), WORLD_SIZE, timeout_s=600, env=env)
    return [torch.load(directory / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)], plans


def test_each_rank_trains_exactly_the_plan_with_the_plain_loops_parameters(runs):
    results, plans = runs
    for rank, result in enumerate(results):
        for name, path in plans.items():
            assert result[name]["plain"]["seen"] == result[name]["full"]["seen"] == planned(path, rank)
            for key, value in result[name]["plain"]["params"].items():
                torch.testing.assert_close(result[name]["full"]["params"][key], value, rtol=0, atol=1e-6)


def test_save_state_inside_epoch_two_resumes_exactly(runs):
    results, plans = runs
    for rank, result in enumerate(results):
        for name, path in plans.items():
            runs_ = result[name]
            assert runs_["first"]["seen"] + runs_["rest"]["seen"] == planned(path, rank)
            for key, value in runs_["full"]["params"].items():
                torch.testing.assert_close(runs_["rest"]["params"][key], value, rtol=0, atol=1e-6)


def test_accelerator_prepare_of_a_plan_loader_is_refused(runs):
    results, _ = runs
    for result in results:
        assert result["refused"].startswith("PlanMismatchError") and "prepare_plan_loader" in result["refused"]
