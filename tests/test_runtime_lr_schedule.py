"""Learning rate by tokens: exact per-step token positions from the plan, LambdaLR-ready."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from batchplan.errors import ConfigError
from batchplan.formats.opening import open_plan
from batchplan.runtime import PlanSampler, read_step_tokens, token_lr_scheduler
from batchplan.runtime.lr_schedule import token_lr_factor, token_lr_lambda


def test_factor_warms_up_linearly_then_decays_to_the_minimum():
    shape = {"warmup_tokens": 100, "total_tokens": 1100, "min_lr_ratio": 0.1}
    assert token_lr_factor(0, **shape) == 0.0
    assert token_lr_factor(50, **shape) == pytest.approx(0.5)
    assert token_lr_factor(100, **shape) == pytest.approx(1.0)
    assert token_lr_factor(600, **shape) == pytest.approx(0.55)  # cosine midpoint
    assert token_lr_factor(1100, **shape) == pytest.approx(0.1)
    assert token_lr_factor(5000, **shape) == pytest.approx(0.1)
    assert token_lr_factor(600, decay="linear", **shape) == pytest.approx(0.55)
    assert token_lr_factor(350, decay="linear", **shape) == pytest.approx(0.1 + 0.9 * 0.75)
    assert token_lr_factor(900, decay="constant", **shape) == 1.0


def test_step_tokens_chain_across_epochs_and_sum_to_the_plan(plans):
    before, tokens = read_step_tokens(plans["pack"])
    plan = open_plan(plans["pack"])
    assert before.shape[0] == tokens.shape[0] == plan.num_steps
    assert before[0] == 0
    np.testing.assert_array_equal(before[1:], before[:-1] + tokens[:-1])
    assert before[-1] + tokens[-1] == sum(plan.read_all().column("tokens").to_pylist())


def test_lambda_uses_the_tokens_done_at_the_end_of_each_step(plans):
    before, tokens = read_step_tokens(plans["pack"])
    seen = before + tokens
    total = int(seen[-1])
    warmup = int(seen[1])  # warmup ends exactly after step 1
    f = token_lr_lambda(plans["pack"], warmup_tokens=warmup, min_lr_ratio=0.2)
    assert 0 < f(0) < 1 and f(0) == pytest.approx(seen[0] / warmup)
    assert f(1) == pytest.approx(1.0)
    progress = (seen[4] - warmup) / (total - warmup)
    assert f(4) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * progress)))
    last = len(seen) - 1
    assert f(last) == pytest.approx(0.2)
    assert f(last + 1) == f(last) == f(10**9)  # LambdaLR asks once past the end


def test_plan_path_plan_file_and_sampler_give_the_same_schedule(plans):
    sampler = PlanSampler(plans["pack"], rank=1, world_size=2)
    functions = [token_lr_lambda(p, warmup_tokens=500) for p in (plans["pack"], open_plan(plans["pack"]), sampler)]
    for step in range(sampler.num_steps + 1):
        assert len({f(step) for f in functions}) == 1


def test_scheduler_drives_the_optimizer_and_its_state_stays_small(plans):
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.5)
    scheduler = token_lr_scheduler(optimizer, plans["pack"], warmup_tokens=400, decay="linear")
    f = token_lr_lambda(plans["pack"], warmup_tokens=400, decay="linear")
    for step in range(open_plan(plans["pack"]).num_steps):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * f(step))
        optimizer.step()
        scheduler.step()
    assert len(pickle.dumps(scheduler.state_dict())) < 1000


@pytest.mark.parametrize(
    "options",
    [{"warmup_tokens": -1}, {"warmup_tokens": 1.5}, {"decay": "step"}, {"min_lr_ratio": 2.0}, {"total_tokens": 0}],
)
def test_bad_schedule_options_are_config_errors(plans, options):
    with pytest.raises(ConfigError):
        token_lr_lambda(plans["pack"], **options)
