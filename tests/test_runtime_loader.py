"""`plan_loader` is the hand-assembled ``DataLoader(PlanDataset, batch_sampler=PlanSampler,
collate_fn=<the mode's collator>)``: same batches, same records, for pack and pad plans."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _ddp_plans import make_dataset
from torch.utils.data import DataLoader

from batchplan.errors import ConfigError, PlanMismatchError
from batchplan.formats.opening import open_plan
from batchplan.runtime import PackCollator, PadCollator, PlanDataset, PlanSampler, plan_loader


def plain(value):
    """A batch or record as lists and numbers, comparable with ``==``."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [plain(item) for item in value]
    return value


def every_batch(loader) -> list:
    """Every epoch of the loader's plan: each batch with its record."""
    sampler, batches = loader.batch_sampler, []
    while not sampler.finished:
        batches += [(plain(dict(batch)), plain(batch.record)) for batch in loader]
    return batches


@pytest.mark.parametrize(("name", "collator"), [("pack", PackCollator), ("pad", PadCollator)])
@pytest.mark.parametrize("rank", [0, 1])
def test_plan_loader_yields_the_hand_assembled_loaders_batches(plans, name, collator, rank):
    dataset = make_dataset()
    by_hand = DataLoader(
        PlanDataset(dataset), batch_sampler=PlanSampler(plans[name], rank=rank, world_size=2), collate_fn=collator()
    )
    loader = plan_loader(dataset, plans[name], rank=rank, world_size=2)
    expected = every_batch(by_hand)
    assert len(expected) > 2
    assert every_batch(loader) == expected


def test_plan_loader_picks_the_collator_of_the_plans_mode(plans):
    dataset = make_dataset()
    assert type(plan_loader(dataset, plans["pack"], rank=0, world_size=2).collate_fn) is PackCollator
    assert type(plan_loader(dataset, plans["pad"], rank=0, world_size=2).collate_fn) is PadCollator


def test_collate_kwargs_reach_the_collator(plans):
    dataset = make_dataset()
    by_hand = DataLoader(
        PlanDataset(dataset),
        batch_sampler=PlanSampler(plans["pad"], rank=1, world_size=2),
        collate_fn=PadCollator(pad_token_id=-7),
    )
    loader = plan_loader(dataset, plans["pad"], rank=1, world_size=2, collate_kwargs={"pad_token_id": -7})
    assert loader.collate_fn.pad_token_id == -7
    batches = every_batch(loader)
    assert batches == every_batch(by_hand)
    assert any(-7 in row for batch, _ in batches for row in batch["input_ids"])  # some micro-batch is padded


def test_plan_loader_takes_an_opened_plan_and_uses_it(plans):
    opened = open_plan(plans["pack"])
    loader = plan_loader(make_dataset(), opened, rank=0, world_size=2)
    assert loader.batch_sampler.plan is opened
    by_path = plan_loader(make_dataset(), plans["pack"], rank=0, world_size=2)
    assert every_batch(loader) == every_batch(by_path)


def test_plan_sampler_takes_an_opened_plan(plans):
    opened = open_plan(plans["pad"])
    sampler = PlanSampler(opened, rank=1, world_size=2)
    assert sampler.plan is opened
    assert [list(rows) for rows in sampler] == [list(rows) for rows in PlanSampler(plans["pad"], rank=1, world_size=2)]


def test_a_custom_collate_fn_replaces_the_plans_collator(plans):
    collate = PadCollator(pad_token_id=3)
    loader = plan_loader(make_dataset(), plans["pack"], rank=0, world_size=2, collate_fn=collate)
    assert loader.collate_fn is collate


def test_dataloader_options_pass_through(plans):
    loader = plan_loader(make_dataset(), plans["pack"], rank=0, world_size=2, pin_memory=True, timeout=5)
    assert loader.pin_memory and loader.timeout == 5


@pytest.mark.parametrize("option", ["batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"])
def test_batching_options_are_refused(plans, option):
    with pytest.raises(ConfigError, match=f"plan_loader got {option}, but the plan decides every micro-batch"):
        plan_loader(make_dataset(), plans["pack"], rank=0, world_size=2, **{option: None})


def test_collate_kwargs_the_collator_does_not_take_are_refused(plans):
    with pytest.raises(ConfigError, match=r"collate_kwargs \['use_cache'\] do not fit PadCollator"):
        plan_loader(make_dataset(), plans["pad"], rank=0, world_size=2, collate_kwargs={"use_cache": False})


def test_collate_fn_with_collate_kwargs_is_refused(plans):
    with pytest.raises(ConfigError, match="both collate_fn and collate_kwargs"):
        plan_loader(
            make_dataset(),
            plans["pack"],
            rank=0,
            world_size=2,
            collate_fn=PackCollator(),
            collate_kwargs={"pad_token_id": 1},
        )


def test_a_dataset_of_another_size_is_refused_before_any_row_is_read(plans):
    lengths = np.ones(49, dtype=np.int64)
    with pytest.raises(PlanMismatchError):
        plan_loader(make_dataset(lengths), plans["pack"], rank=0, world_size=2)
