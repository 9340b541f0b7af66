"""Real multi-process DDP (2 processes, gloo on CPU): the runtime keeps training exact.

One spawn (module fixture, ~10 s) runs every check in tests/_ddp_worker.py; the
tests below judge its saved results:
(1) across ranks, each epoch's micro-batches are exactly the plan's, in lockstep;
(2) DDP gradients of one step with several micro-batches per rank equal a single
    process's mean token loss over the step (float64, rel. error <= 1e-5), for
    pack and pad (per-sample / causal and explicitly masked attention), and a step
    with an empty micro-batch;
(3) resume from a mid-epoch state dict replays exactly the rest, same parameters;
(4) loaders with num_workers=2 (the resumed run) give the same batches.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from _ddp_plans import free_port, standard_plans
from _ddp_worker import RESUME_AFTER_STEPS, run_checks
from _spawn import launch

from batchplan.formats.opening import open_plan

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ddp")
    plans = standard_plans(directory / "plans")
    launch(run_checks, (WORLD_SIZE, free_port(), {k: str(v) for k, v in plans.items()}, str(directory)))
    results = [torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    return results, plans


@pytest.mark.slow
def test_each_rank_replays_exactly_its_rows_of_the_plan(ddp):
    results, plans = ddp
    plan = open_plan(plans["pack"])
    for rank, result in enumerate(results):
        expected = []
        for epoch in range(plan.num_epochs):
            for row in plan.read_rank(epoch, rank).to_pylist():
                expected.append(
                    (
                        epoch,
                        row["step"],
                        row["micro"],
                        row["num_micro"],
                        tuple(row["samples"]),
                        tuple(row["starts"]),
                        tuple(row["lengths"]),
                    )
                )
        assert [entry[:7] for entry in result["coverage"]] == expected


@pytest.mark.slow
def test_all_ranks_together_cover_every_micro_batch_once_per_epoch(ddp):
    results, plans = ddp
    plan = open_plan(plans["pack"])
    for epoch in range(plan.num_epochs):
        ran = sorted(
            (entry[1], tuple(zip(entry[4], entry[5], entry[6])))
            for result in results
            for entry in result["coverage"]
            if entry[0] == epoch
        )
        table = plan.read_epoch(epoch).to_pylist()
        planned = sorted((row["step"], tuple(zip(row["samples"], row["starts"], row["lengths"]))) for row in table)
        assert ran == planned


@pytest.mark.slow
def test_every_rank_runs_the_same_number_of_micro_batches_each_step(ddp):
    results, _ = ddp
    counts = [defaultdict(int) for _ in results]
    for rank, result in enumerate(results):
        for entry in result["coverage"]:
            counts[rank][entry[1]] += 1
            assert entry[3] >= 1
    assert counts[0] == counts[1]
    assert max(counts[0].values()) > 1  # the plan really has several micro-batches per step


@pytest.mark.slow
def test_collated_batches_match_the_records(ddp):
    results, _ = ddp
    for result in results:
        for entry in result["coverage"]:
            tokens, counted_loss, planned_loss = entry[7], entry[8], entry[9]
            assert tokens == max(sum(entry[6]), 1)  # an empty micro-batch is a 1-token dummy
            assert counted_loss == planned_loss


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pack", "pack-mask", "pad", "pad-mask", "single"])
def test_ddp_gradients_equal_the_single_process_token_mean(ddp, name):
    results, _ = ddp
    check = [result["grads"][name] for result in results]
    assert check[0]["num_micro"] == check[1]["num_micro"]
    if name != "single":
        assert check[0]["num_micro"] > 1
    counted, step_loss_tokens = check[0]["reference_loss_tokens"]
    assert counted == step_loss_tokens
    reference = check[0]["reference"]
    for grads in (check[0]["grads"], check[1]["grads"]):
        for param, expected in reference.items():
            error = (grads[param] - expected).norm() / expected.norm().clamp_min(1e-300)
            assert error <= 1e-5, f"{name}: {param} relative error {error:.3e}"


@pytest.mark.slow
def test_resume_mid_epoch_replays_the_rest_and_reaches_the_same_parameters(ddp):
    results, plans = ddp
    for result in results:
        resume = result["resume"]
        full, first, rest = resume["full"]["seen"], resume["first"], resume["rest"]["seen"]
        assert len(first) < open_plan(plans["pack"]).metadata["rows_per_rank"][0]  # stopped mid-epoch
        assert first == full[: len(first)]
        assert rest == full[len(first) :]
        assert resume["sampler_state"]["position"] == len(first)
        assert {entry[1] for entry in first} == set(range(RESUME_AFTER_STEPS))
        for name, value in resume["full"]["params"].items():
            torch.testing.assert_close(resume["rest"]["params"][name], value, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_params_are_the_same_on_both_ranks_after_training(ddp):
    results, _ = ddp
    for name, value in results[0]["resume"]["full"]["params"].items():
        assert torch.equal(results[1]["resume"]["full"]["params"][name], value)
