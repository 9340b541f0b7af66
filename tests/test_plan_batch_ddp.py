"""`plan_batch` in a real 2-process DDP loop (gloo on CPU): a fresh batch every step, planned
on each rank independently, trains exactly as a single process on the token mean.

One spawn (module fixture) runs tests/_plan_batch_worker.py; the tests judge its saved results.
"""

from __future__ import annotations

import pytest
import torch
from _ddp_plans import free_port
from _plan_batch_worker import STEPS, run
from _spawn import launch

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("plan_batch_ddp")
    launch(run, (WORLD_SIZE, free_port(), str(directory)))
    return [torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


@pytest.mark.slow
def test_every_rank_plans_the_same_batch(ranks):
    for step in range(STEPS):
        (samples0, offsets0), (samples1, offsets1) = ranks[0]["plans"][step], ranks[1]["plans"][step]
        assert samples0.tolist() == samples1.tolist() and offsets0.tolist() == offsets1.tolist()


@pytest.mark.slow
def test_every_rank_runs_the_same_number_of_micro_batches_each_step(ranks):
    assert ranks[0]["micro_batches_run"] == ranks[1]["micro_batches_run"]
    assert len(ranks[0]["micro_batches_run"]) == STEPS


@pytest.mark.slow
def test_ddp_gradients_equal_the_single_process_token_mean(ranks):
    reference = ranks[0]["reference"]["first_grads"]
    for result in ranks:
        for name, grad in result["first_grads"].items():
            torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-10)


@pytest.mark.slow
def test_training_on_fresh_batches_reaches_the_single_process_parameters(ranks):
    reference = ranks[0]["reference"]["params"]
    for result in ranks:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-10)
