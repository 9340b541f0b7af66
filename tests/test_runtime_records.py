"""Each batch carries its plan record through every path a DataLoader batch takes.

Workers (pickle), pin_memory, device moves (Accelerate's ``send_to_device``,
Lightning's ``move_data_to_device``), copies, Hugging Face ``datasets`` datasets,
and torchdata's ``StatefulDataLoader`` (whose own ``state_dict`` resumes exactly,
with and without workers).
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from _ddp_plans import make_dataset, sample_lengths, write_test_plan
from torch.utils.data import DataLoader

from batchplan.errors import ConfigError
from batchplan.runtime import (
    PackCollator,
    PadCollator,
    PlanBatch,
    PlanDataset,
    PlanSampler,
    record_of,
    token_loss_sum,
    with_record,
)

pytestmark = pytest.mark.usefixtures("no_launcher_environment")


def expected_records(path, rank=0):
    sampler = PlanSampler(path, rank=rank, world_size=2)
    out = []
    while not sampler.finished:
        out += [planned.record for planned in sampler]
    return out


def loader_for(path, *, dataset=None, collate=None, loader_cls=DataLoader, **options):
    sampler = PlanSampler(path, rank=0, world_size=2)
    collate = collate or (PackCollator() if sampler.mode == "pack" else PadCollator())
    dataset = PlanDataset(make_dataset() if dataset is None else dataset)
    return sampler, loader_cls(dataset, batch_sampler=sampler, collate_fn=collate, **options)


def walk(sampler, loader) -> list:
    records = []
    while not sampler.finished:
        records += [batch.record for batch in loader]
    return records


@pytest.mark.parametrize("mode", ["pack", "pad"])
@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # workers are processes
def test_every_batch_carries_its_record_in_order(plans, mode, num_workers):
    workers = {"num_workers": num_workers, "multiprocessing_context": "fork"} if num_workers else {}
    sampler, loader = loader_for(plans[mode], **workers)
    batches = []
    while not sampler.finished:
        batches += list(loader)
    assert [b.record for b in batches] == expected_records(plans[mode])
    for batch in batches:
        assert isinstance(batch, PlanBatch) and record_of(batch) is batch.record
        assert batch["labels"].ne(-100)[..., 1:].sum() == batch.record.loss_tokens


def test_the_record_survives_pickle_copy_to_and_pin_memory(plans, monkeypatch):
    _, loader = loader_for(plans["pack"])
    batch = next(iter(loader))
    assert pickle.loads(pickle.dumps(batch)).record == batch.record
    assert copy.copy(batch).record == batch.record
    moved = batch.to("cpu", non_blocking=True)
    assert moved.record == batch.record and torch.equal(moved["input_ids"], batch["input_ids"])
    # DataLoader(pin_memory=True) calls torch's pin_memory on each batch; on a CPU-only
    # machine a tensor cannot be pinned, so pinning is stood in by a copy.
    from torch.utils.data._utils.pin_memory import pin_memory

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self.clone())
    pinned = pin_memory(batch)
    assert isinstance(pinned, PlanBatch) and pinned.record == batch.record


def test_accelerate_and_lightning_device_moves_keep_the_record(plans):
    accelerate = pytest.importorskip("accelerate.utils")
    lightning = pytest.importorskip("lightning.fabric.utilities.apply_func")
    _, loader = loader_for(plans["pack"])
    batch = next(iter(loader))
    assert accelerate.send_to_device(batch, torch.device("cpu")).record == batch.record
    assert lightning.move_data_to_device(batch, torch.device("cpu")).record == batch.record


def test_a_rebuilt_mapping_loses_the_record_and_says_so(plans):
    _, loader = loader_for(plans["pack"])
    batch = next(iter(loader))
    rebuilt = type(batch)({k: v for k, v in batch.items()})  # what Trainer._prepare_input does
    with pytest.raises(ConfigError, match="carries no plan record.*PlanDataset"):
        _ = rebuilt.record
    with pytest.raises(ConfigError, match="with_record"):
        record_of(dict(batch))


def test_a_dataset_not_wrapped_gives_batches_without_a_record(plans):
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    loader = DataLoader(make_dataset(), batch_sampler=sampler, collate_fn=PackCollator())
    batch = next(iter(loader))
    assert not batch.has_record
    with pytest.raises(ConfigError, match="wrap the dataset in PlanDataset"):
        _ = batch.record


def test_with_record_gives_any_collate_function_the_record(tmp_path):
    transformers = pytest.importorskip("transformers")
    lengths = np.minimum(sample_lengths(), 64)  # no spans: a plain collator takes whole samples
    plan = write_test_plan(tmp_path / "plain.arrow", lengths, max_tokens=64, world_size=2, micro_batches=2)
    collate = with_record(transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True))
    sampler, loader = loader_for(plan, dataset=_hf_items(lengths), collate=collate)
    batches = list(loader)
    assert [b.record for b in batches] == expected_records(plan)[: len(batches)]
    for batch in batches:
        assert batch["input_ids"].shape[1] == batch.record.tokens
    with pytest.raises(ConfigError, match="returns a mapping"):
        with_record(lambda items: items)(batches[0].record.indices)


def _hf_items(lengths=None):
    base = make_dataset(lengths)
    return [{"input_ids": base[i]["input_ids"].tolist()} for i in range(len(base))]


def test_a_hugging_face_dataset_through_plan_dataset(plans):
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"input_ids": [item["input_ids"] for item in _hf_items()]})
    for fmt in (None, "torch", "numpy"):
        sampler, loader = loader_for(plans["pack"], dataset=hf.with_format(fmt))
        for batch, expected in zip(walk_batches(sampler, loader), walk_batches(*loader_for(plans["pack"]))):
            assert batch.record == expected.record
            assert torch.equal(batch["input_ids"], expected["input_ids"])


def walk_batches(sampler, loader):
    while not sampler.finished:
        yield from loader


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # workers are processes
def test_stateful_dataloader_resumes_exactly_from_its_own_state(plans, num_workers):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    workers = {"num_workers": num_workers, "multiprocessing_context": "fork"} if num_workers else {}
    expected = expected_records(plans["pack"])
    for stop in (1, 5, len(expected) // 2, len(expected) // 2 + 3, len(expected) - 1):
        sampler, loader = loader_for(plans["pack"], loader_cls=stateful.StatefulDataLoader, **workers)
        trained, state = [], None
        batches = walk_batches(sampler, loader)
        for batch in batches:
            trained.append(batch.record)
            if len(trained) == stop:
                state = loader.state_dict()
                break
        del batches
        sampler, loader = loader_for(plans["pack"], loader_cls=stateful.StatefulDataLoader, **workers)
        loader.load_state_dict(state)
        rest = [batch.record for batch in walk_batches(sampler, loader)]
        assert trained + rest == expected, f"stopped after {stop}"


def test_token_loss_sum_takes_a_model_output_with_logits():
    transformers = pytest.importorskip("transformers")
    logits = torch.randn(1, 5, 11)
    labels = torch.tensor([[-100, 1, 2, 3, 4]])
    output = transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)
    assert torch.equal(token_loss_sum(output, labels), token_loss_sum(logits, labels))
    with pytest.raises(TypeError, match=r"logits \(a tensor\) or a model output with .logits"):
        token_loss_sum((logits,), labels)


def test_pack_batches_turn_the_kv_cache_off_unless_asked(plans):
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    items = [make_dataset()[i] for i in range(3)]
    assert PackCollator()(items)["use_cache"] is False
    assert "use_cache" not in PackCollator(use_cache=None)(items)
    assert "use_cache" not in PadCollator()(items)
    assert len(sample_lengths()) == sampler.plan.num_samples


def test_loss_scale_uses_the_plans_world_size_and_refuses_another(tmp_path):
    """``mb.loss_scale()`` needs no argument: the record knows its plan's ranks; another world
    size would scale every step's mean by the wrong ratio, so it is refused."""
    from batchplan.config import PlanConfig
    from batchplan.errors import ConfigError
    from batchplan.formats.plan_writer import write_plan
    from batchplan.planning.epochs import build_plan
    from batchplan.runtime import PlanSampler

    path = tmp_path / "plan.arrow"
    write_plan(build_plan(np.arange(1, 200, dtype=np.int32), PlanConfig(max_tokens=512, world_size=4)), path)
    record = next(iter(PlanSampler(path, rank=1, world_size=4))).record
    assert record.world_size == 4
    assert record.loss_scale() == record.loss_scale(4) == 4 / record.step_loss_tokens
    with pytest.raises(ConfigError, match="plan of 4 ranks"):
        record.loss_scale(2)
    with pytest.raises(ConfigError, match="pass loss_scale"):
        record._replace(world_size=None).loss_scale()
