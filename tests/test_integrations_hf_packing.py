"""Packed PackCollator batches into a Hugging Face LlamaForCausalLM give per-sample losses and gradients.

The documented path (``model(**batch)`` then ``token_loss_sum(output, batch)``) on a
tiny random-init model with its default config (``use_cache=True``): PackCollator's
``use_cache=False`` lets transformers find the samples from ``position_ids``, so the
packed loss and gradients equal those of each sample run alone (sdpa and eager).
"""

from __future__ import annotations

import pytest
import torch
from _ddp_plans import sample_lengths
from _integration_worker import make_dataset, make_model

from batchplan.runtime import PackCollator, count_loss_tokens, token_loss_sum

pytest.importorskip("transformers")


def loss_and_grads(model, batches):
    model.zero_grad()
    total = sum(token_loss_sum(model(**batch), batch) for batch in batches)
    total.backward()
    return total.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_batches_equal_each_sample_alone(attention):
    items = [make_dataset(sample_lengths())[i] for i in range(6)]
    model = make_model(attention)
    assert model.config.use_cache  # the default: the collator, not the config, keeps packing safe
    packed = PackCollator()(items)
    alone = [PackCollator()([item]) for item in items]
    assert count_loss_tokens(packed) == sum(count_loss_tokens(b) for b in alone)
    loss, grads = loss_and_grads(model, [packed])
    reference_loss, reference = loss_and_grads(model, alone)
    torch.testing.assert_close(loss, reference_loss, rtol=0, atol=1e-5)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5)


def test_with_a_kv_cache_packed_samples_attend_to_each_other():
    """Why use_cache=False is the collator's default: with a cache, the loss is wrong."""
    items = [make_dataset(sample_lengths())[i] for i in range(6)]
    model = make_model("sdpa")
    cached = PackCollator(use_cache=None)([*items])
    alone = [PackCollator()([item]) for item in items]
    with torch.no_grad():
        wrong = token_loss_sum(model(**cached), cached)
        right = sum(token_loss_sum(model(**b), b) for b in alone)
    assert abs(wrong - right) > 1e-3
