"""PlanDataModule replays a plan exactly under Lightning's DDP (2 real processes, gloo).

For a pack plan with 2 micro-batches per step (automatic optimisation,
``accumulate_grad_batches=2``) and a plan with steps sized by tokens (manual
optimisation), both over 2 epochs: each rank trains exactly the plan's
micro-batches and ends with the plain loop's parameters; a fit stopped inside epoch
2 and resumed from Lightning's checkpoint (with 2 loader workers for the pack plan)
trains exactly the rest and ends with the same parameters, and so does one resumed
from a checkpoint at the end of epoch 1; reloading the loader every epoch replays
nothing; Lightning's default ``use_distributed_sampler=True`` is a clear error.

Fast tests (one process): a trainer that cannot replay the plan (accumulation that
does not match its steps, more epochs or steps than it has, another world size) is
a clear error, and importing the integration without Lightning says how to install it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _ddp_plans import sample_lengths, write_test_plan
from _integration_worker import assert_resumed, assert_same_params, planned, stack_runs

from batchplan.errors import ConfigError, PlanMismatchError
from batchplan.formats.opening import open_plan

# The 2-process tests are slow; the import test below is not (a module-wide mark would hide it).
slow = pytest.mark.slow


@pytest.fixture
def lightning_runs(integration_runs):
    return stack_runs(integration_runs, "lightning")


@slow
def test_plan_data_module_trains_exactly_the_plan_like_the_plain_loop(lightning_runs):
    results, plans = lightning_runs
    for rank, result in enumerate(results):
        for name, path in plans.items():
            runs, expected = result[name], planned(path, rank)
            assert runs["plain"]["seen"] == expected, (rank, name)
            assert runs["full"]["seen"] == expected, (rank, name)
            assert runs["full"]["global_step"] == open_plan(path).num_steps
            assert_same_params(runs["full"]["params"], runs["plain"]["params"])


def check_resumed(lightning_runs, first: str, rest: str, stopped_at: str) -> None:
    """Every rank and plan: the first run stopped at ``stopped_at``'s step, and the run resumed
    from its checkpoint trained the rest exactly."""
    results, plans = lightning_runs
    for rank, result in enumerate(results):
        for name, path in plans.items():
            runs = result[name]
            assert runs[first]["global_step"] == runs[stopped_at]
            assert_resumed(runs[first], runs[rest], runs["full"], path, rank)


@slow
def test_plan_data_module_resumes_inside_epoch_two_from_a_lightning_checkpoint(lightning_runs):
    check_resumed(lightning_runs, "first", "rest", "stop")


@slow
def test_plan_data_module_resumes_from_a_checkpoint_at_the_end_of_epoch_one(lightning_runs):
    check_resumed(lightning_runs, "first_at_end", "rest_after_end", "end")


@slow
def test_reloading_the_loader_every_epoch_replays_nothing(lightning_runs):
    results, plans = lightning_runs
    for rank, result in enumerate(results):
        assert result["reload"]["seen"] == planned(plans["pack"], rank)
        assert_same_params(result["reload"]["params"], result["pack"]["full"]["params"])


@slow
def test_lightning_replacing_the_batch_sampler_is_a_clear_error(lightning_runs):
    results, _ = lightning_runs
    for result in results:
        assert "use_distributed_sampler=False" in result["replaced_sampler"]


@pytest.mark.slow
def test_importing_the_integration_without_lightning_says_how_to_install_it():
    code = (
        "import sys; sys.modules['lightning'] = None\n"
        "from batchplan.errors import ConfigError\n"
        "try:\n"
        "    import batchplan.integrations.lightning\n"
        "except ConfigError as error:\n"
        "    print(error)\n"
        "else:\n"
        "    raise SystemExit('imported without lightning')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "needs 'lightning'" in done.stdout and "pip install" in done.stdout


def fit_single_process(plan, *, manual: bool = False, **options):
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    import lightning.pytorch as pl
    from _integration_worker import make_dataset
    from _lightning_worker import module_class

    from batchplan.integrations.lightning import PlanDataModule

    options = {"max_epochs": 2, "accumulate_grad_batches": 2, **options}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **options,
    )
    module, threads = module_class()(manual), torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: many threads only contend (other tests run beside this one)
    try:
        trainer.fit(module, datamodule=PlanDataModule(plan, make_dataset(sample_lengths())))
    finally:
        torch.set_num_threads(threads)
    return module, trainer


@pytest.fixture(scope="module")
def single_plans(tmp_path_factory):
    directory, lengths = tmp_path_factory.mktemp("lightning-single"), sample_lengths()
    options = dict(max_tokens=64, world_size=1, epochs=2, oversize="split", seed=3)
    return {
        "pack": str(write_test_plan(directory / "pack.arrow", lengths, micro_batches=2, **options)),
        "tokens": str(write_test_plan(directory / "tokens.arrow", lengths, tokens_per_step=300, **options)),
        "two_ranks": str(
            write_test_plan(directory / "two.arrow", lengths, micro_batches=2, **{**options, "world_size": 2})
        ),
    }


@pytest.mark.parametrize(
    ("plan", "options", "message"),
    [
        ("tokens", {}, "use manual optimisation with plan_backward"),
        ("pack", {"accumulate_grad_batches": 1}, "pass accumulate_grad_batches=2"),
        ("pack", {"max_epochs": 3}, "pass max_epochs=2"),
        ("pack", {"max_epochs": 2, "max_steps": 1000}, "max_steps is 1,000"),
    ],
)
def test_a_trainer_that_cannot_replay_the_plan_is_a_clear_error(single_plans, plan, options, message):
    with pytest.raises(ConfigError, match=message):
        fit_single_process(single_plans[plan], **options)


def test_a_plan_of_another_world_size_is_a_clear_error(single_plans):
    with pytest.raises(PlanMismatchError, match="built for world_size 2 but this run has world_size 1"):
        fit_single_process(single_plans["two_ranks"])


def test_one_process_trains_the_plan_step_by_step(single_plans):
    # The single-process path (no DDP wrapper: plan_backward without no_sync), 3 steps.
    module, trainer = fit_single_process(single_plans["tokens"], manual=True, accumulate_grad_batches=1, max_steps=3)
    assert trainer.global_step == 3
    assert module.seen == [row for row in planned(single_plans["tokens"], 0) if row[1] < 3]
