"""Collators, loss helpers and attention masks: Hugging Face conventions, spans, exact token counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _ddp_plans import make_dataset, make_model, write_test_plan
from hypothesis import given
from hypothesis import strategies as st

from batchplan.errors import DatasetError
from batchplan.runtime import (
    PackCollator,
    PadCollator,
    PlanDataset,
    PlanSampler,
    SpanItem,
    count_loss_tokens,
    document_causal_mask,
    padding_causal_mask,
    token_loss_sum,
)


def flattening_reference(features: list[dict]) -> dict:
    """Hugging Face DataCollatorWithFlattening(return_flash_attn_kwargs=True), restated in lists."""
    ids, labels, positions, cu = [], [], [], [0]
    for feature in features:
        tokens = list(feature["input_ids"])
        ids += tokens
        labels += [-100] + list(feature.get("labels", tokens))[1:]
        positions += list(range(len(tokens)))
        cu.append(cu[-1] + len(tokens))
    return {
        "input_ids": [ids],
        "labels": [labels],
        "position_ids": [positions],
        "cu": cu,
        "max_length": max(len(f["input_ids"]) for f in features),
    }


# -- PackCollator -------------------------------------------------------------------


def test_pack_collator_follows_data_collator_with_flattening():
    items = [{"input_ids": [5, 6, 7]}, {"input_ids": np.array([8, 9])}, {"input_ids": torch.tensor([4])}]
    batch = PackCollator()(items)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 6]
    assert batch["cu_seq_lens_q"].dtype == batch["cu_seq_lens_k"].dtype == batch["cu_seq_lens"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == batch["max_length"] == 3
    assert all(batch[k].dtype == torch.int64 for k in ("input_ids", "labels", "position_ids"))


@given(st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=20), min_size=1, max_size=6), st.booleans())
def test_pack_collator_matches_the_hugging_face_reference(sequences, with_labels):
    features = [{"input_ids": s, **({"labels": [t % 7 - 1 for t in s]} if with_labels else {})} for s in sequences]
    batch, expected = PackCollator()(features), flattening_reference(features)
    assert batch["input_ids"].tolist() == expected["input_ids"]
    assert batch["labels"].tolist() == expected["labels"]
    assert batch["position_ids"].tolist() == expected["position_ids"]
    assert batch["cu_seq_lens_k"].tolist() == expected["cu"]
    assert batch["max_length_k"] == expected["max_length"]


def test_items_may_be_bare_token_sequences_and_keys_are_configurable():
    assert PackCollator()([[1, 2], np.array([3])])["input_ids"].tolist() == [[1, 2, 3]]
    batch = PackCollator(input_key="tokens", labels_key="targets")([{"tokens": [1, 2, 3], "targets": [0, 0, 9]}])
    assert batch["labels"].tolist() == [[-100, 0, 9]]


def test_spans_slice_token_ids_and_labels():
    item = {"input_ids": list(range(10, 20)), "labels": list(range(100, 110))}
    batch = PackCollator()([SpanItem(item, 2, 3), SpanItem(item, 8, 2)])
    assert batch["input_ids"].tolist() == [[12, 13, 14, 18, 19]]
    assert batch["labels"].tolist() == [[-100, 103, 104, -100, 109]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]


def test_a_span_past_the_sample_says_the_dataset_does_not_match():
    with pytest.raises(DatasetError, match=r"tokens \[8, 12\) of a sample that has only 10"):
        PackCollator()([SpanItem({"input_ids": list(range(10))}, 8, 4)])


def test_bad_items_are_dataset_errors():
    with pytest.raises(DatasetError, match="no tokens"):
        PackCollator()([{"input_ids": []}])
    with pytest.raises(DatasetError, match="one label per token"):
        PackCollator()([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(DatasetError, match="flat sequence"):
        PadCollator()([{"input_ids": [[1, 2]]}])


@pytest.mark.parametrize("collator", [PackCollator(pad_token_id=3), PadCollator(pad_token_id=3)])
def test_an_empty_micro_batch_is_a_zero_weight_dummy(collator):
    batch = collator([])
    assert batch["input_ids"].tolist() == [[3]] and batch["labels"].tolist() == [[-100]]
    model = make_model()
    loss = token_loss_sum(model(**batch), batch)
    loss.backward()
    assert loss.item() == 0.0 and count_loss_tokens(batch) == 0
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() and not g.any() for g in grads)


# -- PadCollator --------------------------------------------------------------------


def test_pad_collator_pads_right_and_masks_labels():
    batch = PadCollator(pad_token_id=0)([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]
    assert count_loss_tokens(batch) == 2


# -- whole plans: every micro-batch has exactly the planned tokens ------------------


@pytest.mark.parametrize(("name", "collator"), [("pack", PackCollator()), ("pad", PadCollator())])
def test_every_collated_micro_batch_has_the_planned_token_counts(plans, name, collator):
    dataset = PlanDataset(make_dataset())
    for rank in (0, 1):
        sampler = PlanSampler(plans[name], rank=rank, world_size=2)
        for epoch in range(sampler.num_epochs):
            sampler.set_epoch(epoch)
            for record, indices in zip(sampler.schedule(), sampler):
                batch = collator([dataset[i] for i in indices])
                assert count_loss_tokens(batch) == record.loss_tokens
                real = batch["attention_mask"].sum() if name == "pad" else batch["input_ids"].numel()
                assert int(real) == record.tokens
                if name == "pad":
                    assert batch["input_ids"].numel() == record.padded_tokens


def test_a_loss_tokens_column_plan_matches_item_labels(tmp_path):
    """SFT: labels -100 on the prompt; the plan's loss tokens come from a column."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 30, 40).astype(np.int32)
    prompts = (lengths * rng.random(40)).astype(np.int32)
    items = []
    for length, prompt in zip(lengths, prompts):
        ids = rng.integers(0, 50, length)
        labels = np.where(np.arange(length) < prompt, -100, ids)
        items.append({"input_ids": ids, "labels": labels})
    loss_tokens = np.array([(item["labels"][1:] != -100).sum() for item in items], dtype=np.int32)
    from batchplan.config import PlanConfig
    from batchplan.formats.plan_writer import write_plan
    from batchplan.planning.epochs import build_plan

    write_plan(build_plan(lengths, PlanConfig(max_tokens=64), loss_tokens=loss_tokens), tmp_path / "sft.arrow")
    sampler = PlanSampler(tmp_path / "sft.arrow")
    for record, indices in zip(sampler.schedule(), sampler):
        assert count_loss_tokens(PackCollator()([items[i] for i in indices])) == record.loss_tokens


# -- loss and attention ----------------------------------------------------------------


def test_token_loss_sum_is_the_shifted_cross_entropy_sum():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64)
    labels = torch.tensor([[-100, 3, 4, -100, 1], [-100, 2, -100, -100, -100]])
    expected = sum(
        -torch.log_softmax(logits[b, t - 1], dim=-1)[labels[b, t]]
        for b in range(2)
        for t in range(1, 5)
        if labels[b, t] != -100
    )
    torch.testing.assert_close(token_loss_sum(logits, labels), expected)
    torch.testing.assert_close(token_loss_sum(logits, {"labels": labels}), expected)
    assert count_loss_tokens(labels) == 4
    assert token_loss_sum(logits.to(torch.bfloat16), labels).dtype == torch.float32


def test_document_causal_mask_is_block_diagonal_and_causal():
    mask = document_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32))
    expected = torch.zeros(5, 5, dtype=torch.bool)
    expected[:2, :2] = torch.ones(2, 2).tril().bool()
    expected[2:, 2:] = torch.ones(3, 3).tril().bool()
    assert torch.equal(mask, expected)
    padded = padding_causal_mask(torch.tensor([[1, 1, 0]]))
    assert padded.shape == (1, 1, 3, 3) and padded[0, 0, 2].tolist() == [True, True, False]


@pytest.mark.parametrize("attention", ["documents", "mask"])
def test_packed_and_padded_logits_equal_each_sample_alone(attention):
    model = make_model(attention=attention)
    items = [{"input_ids": list(range(i, i + n))} for i, n in ((1, 7), (20, 3), (40, 12))]
    alone = [model(**PackCollator()([item]))[0] for item in items]
    packed = model(**PackCollator()(items))[0]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-10, atol=1e-10)
    padded = model(**PadCollator()(items))
    for row, expected in enumerate(alone):
        torch.testing.assert_close(padded[row, : expected.shape[0]], expected, rtol=1e-10, atol=1e-10)


def test_plans_without_spans_need_no_wrapper(tmp_path):
    path = write_test_plan(tmp_path / "p.arrow", np.arange(1, 30, dtype=np.int32), max_tokens=64)
    dataset = make_dataset(np.arange(1, 30))
    assert PlanDataset(dataset)[3] is not None and len(PlanDataset(dataset)) == 29
    sampler = PlanSampler(path)
    for record, indices in zip(sampler.schedule(), sampler):
        assert count_loss_tokens(PackCollator()([dataset[i] for i in indices])) == record.loss_tokens
