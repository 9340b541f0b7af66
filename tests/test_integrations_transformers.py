"""PlanTrainer and a TRL SFTTrainer with PlanTrainerMixin replay a plan exactly (2 real processes).

For a pack plan with 2 micro-batches per step and a plan with steps sized by tokens
(micro-batches per step vary), both over 2 epochs: each rank trains exactly the
plan's micro-batches, step by step, and ends with the plain loop's parameters; a run
stopped inside epoch 2 and resumed from Trainer's own checkpoint (with 2 loader
workers) trains exactly the rest and ends with the same parameters.
"""

from __future__ import annotations

import numpy as np
import pytest
from _ddp_plans import sample_lengths
from _integration_worker import (
    assert_resumed,
    assert_same_params,
    integration_plans,
    planned,
    stack_runs,
)

from batchplan.formats.opening import open_plan

pytest.importorskip("transformers")


@pytest.fixture
def trainer_runs(integration_runs):
    return stack_runs(integration_runs, "trainer")


@pytest.fixture
def sft_runs(integration_runs):
    return stack_runs(integration_runs, "sft")


def assert_exact(results, plans):
    for rank, result in enumerate(results):
        for name, path in plans.items():
            runs, expected = result[name], planned(path, rank)
            assert runs["plain"]["seen"] == expected, (rank, name)
            moved = max((runs["plain"]["params"][k] - v).abs().max() for k, v in runs["plain"]["initial"].items())
            assert moved > 1e-3  # training changed the parameters: equal parameters mean something
            assert runs["full"]["seen"] == expected, (rank, name)
            assert_same_params(runs["full"]["params"], runs["plain"]["params"])
            assert runs["full"]["global_step"] == open_plan(path).num_steps


def assert_resumes(results, plans):
    for rank, result in enumerate(results):
        for name, path in plans.items():
            runs = result[name]
            assert runs["first"]["global_step"] == runs["stop"]
            assert_resumed(runs["first"], runs["rest"], runs["full"], path, rank)


@pytest.mark.slow
def test_plan_trainer_trains_exactly_the_plan_like_the_plain_loop(trainer_runs):
    assert_exact(*trainer_runs)


@pytest.mark.slow
def test_plan_trainer_resumes_inside_epoch_two_from_its_checkpoint(trainer_runs):
    assert_resumes(*trainer_runs)


@pytest.mark.slow
def test_sft_trainer_with_the_mixin_trains_exactly_the_plan(sft_runs):
    assert_exact(*sft_runs)


@pytest.mark.slow
def test_sft_trainer_with_the_mixin_resumes_from_its_checkpoint(sft_runs):
    assert_resumes(*sft_runs)


@pytest.mark.slow
def test_the_token_plan_has_steps_of_varying_size(trainer_runs):
    _, plans = trainer_runs
    rows = open_plan(plans["tokens"]).read_rank(0, 0).to_pylist()
    assert len({row["num_micro"] for row in rows}) > 1
    assert np.all(np.diff([row["step"] for row in rows]) >= 0)


# -- one process: what PlanTrainer refuses ------------------------------------------------------


@pytest.fixture
def one_process(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    from batchplan.config import PlanConfig
    from batchplan.formats.lengths import fingerprint_lengths
    from batchplan.formats.plan_writer import write_plan
    from batchplan.planning.epochs import build_plan

    lengths = sample_lengths()
    single = tmp_path / "single.arrow"  # with the lengths' fingerprint, as `batchplan build` writes it
    config = PlanConfig(max_tokens=64, world_size=1, micro_batches=2, oversize="split")
    write_plan(build_plan(lengths, config), single, lengths_fingerprint=fingerprint_lengths(lengths))
    return lengths, str(single), integration_plans(tmp_path / "plans", lengths)


def make_trainer(tmp_path, lengths, plan, **options):
    import transformers
    from _integration_worker import make_dataset, make_model

    from batchplan.integrations.transformers import PlanTrainer

    args = transformers.TrainingArguments(str(tmp_path / "out"), use_cpu=True, report_to=[], **options)
    return PlanTrainer(model=make_model(), args=args, train_dataset=make_dataset(lengths), plan=plan)


def test_a_plan_for_another_world_size_is_refused_with_the_samplers_message(one_process, tmp_path):
    from batchplan.errors import PlanMismatchError

    lengths, _, plans = one_process
    with pytest.raises(PlanMismatchError, match="built for world_size 2 but this run has world_size 1"):
        make_trainer(tmp_path, lengths, plans["pack"])


def test_gradient_accumulation_other_than_one_is_refused(one_process, tmp_path):
    from batchplan.errors import ConfigError

    lengths, single, _ = one_process
    with pytest.raises(ConfigError, match="gradient_accumulation_steps is 4.*leave it at 1"):
        make_trainer(tmp_path, lengths, single, gradient_accumulation_steps=4)


def test_a_dataset_with_other_lengths_is_refused(one_process, tmp_path):
    from batchplan.errors import PlanMismatchError

    lengths, single, _ = one_process
    other = lengths.copy()
    other[0] += 1  # same rows, one sample one token longer: the plan would slice it wrongly
    with pytest.raises(PlanMismatchError, match="lengths have fingerprint"):
        make_trainer(tmp_path, other, single)


def test_one_process_trains_the_plan_and_turns_the_cache_off(one_process, tmp_path):
    lengths, single, _ = one_process
    trainer = make_trainer(tmp_path, lengths, single, max_steps=3)
    assert trainer.model.config.use_cache is False
    trainer.train()
    assert trainer.state.global_step == 3


def test_ddp_looks_for_unused_parameters_only_when_asked(one_process, tmp_path):
    lengths, single, _ = one_process
    assert make_trainer(tmp_path, lengths, single).accelerator.ddp_handler.find_unused_parameters is False
    asked = make_trainer(tmp_path, lengths, single, ddp_find_unused_parameters=True)
    assert asked.accelerator.ddp_handler.find_unused_parameters is True


def test_one_process_training_raises_no_deprecation_warning(one_process, tmp_path):
    import warnings

    lengths, single, _ = one_process
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        trainer = make_trainer(tmp_path, lengths, single, max_steps=3)
        trainer.train()
    assert trainer.state.global_step == 3
