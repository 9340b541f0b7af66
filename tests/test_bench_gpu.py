"""bench/gpu.py: its CPU mode runs end to end, and its attention paths keep samples apart.

The GPU kernels themselves (FlashAttention varlen, compiled FlexAttention) need CUDA; here the
same glue runs with the CPU stand-in, and the FlexAttention document mask is checked token by token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from batchplan.runtime import PackCollator, document_causal_mask

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("transformers")
gpu = pytest.importorskip("bench.gpu")


@pytest.mark.slow
def test_tiny_run_reports_every_method_and_the_balance(tmp_path):
    report_path = tmp_path / "gpu.json"
    options = ["--tiny", "--seconds", "0.3", "--balance-seconds", "1", "--json", str(report_path)]
    command = [sys.executable, "-m", "bench.gpu", *options]
    # One torch thread: a width-64 model gains nothing from two, on cores another test shares.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert "| method | attention kernel | real tokens/s |" in done.stdout
    assert report["stopped"] is None
    assert report["command"].startswith("python -m bench.gpu --tiny")
    assert report["model"]["layers"] == 2 and report["model"]["width"] == 64 and report["model"]["parameters"] > 0
    methods = report["methods"]
    assert list(methods) == ["baseline", "pad", "pack-varlen", "pack-mask"]
    for name, result in methods.items():
        assert result["error"] is None, (name, result["error"])
        assert result["tokens_per_s"] > 0 and result["micro_batches"] > 0 and result["kernel"]
        assert 0 < result["real_tokens"] <= result["computed_tokens"]
        assert result["peak_memory_gib"] is None  # CPU: no GPU memory to report
    for name in ("pad", "pack-varlen", "pack-mask"):  # real tokens are the plan's tokens: no pad counted
        assert methods[name]["real_tokens"] == methods[name]["plan_tokens"]
    for name in ("pack-varlen", "pack-mask"):  # a packed row has no padding
        assert methods[name]["real_tokens"] == methods[name]["computed_tokens"]
    balance = report["balance"]
    assert balance["method"] == "pack-varlen" and balance["packs"] >= balance["packs_timed"] >= 3
    assert isinstance(balance["r2_cost_model"], float) and isinstance(balance["free_fit"]["r2"], float)
    assert all(seconds > 0 for seconds in balance["step_time_s"].values())
    assert set(balance["step_time_s"]) == {"tokens", "compute"} and balance["compute_vs_tokens"] > 0


def tiny_args(**changes):
    args = gpu.parse_args(["--tiny", "--max-tokens", "64"])
    args.device = torch.device("cpu")
    vars(args).update(changes)
    return args


def packed_batch(lengths: list[int], vocab: int) -> dict:
    rng = np.random.default_rng(0)
    return PackCollator()([rng.integers(0, vocab, n) for n in lengths])


def test_varlen_glue_and_transformers_mask_match_each_sample_alone():
    args = tiny_args()
    model, _ = gpu.make_model(args)
    lengths = [7, 20, 1, 13]
    batch = packed_batch(lengths, args.vocab)
    with torch.no_grad():
        alone = torch.cat([model(input_ids=ids).logits for ids in batch["input_ids"].split(lengths, dim=1)], dim=1)
        for method in ("pack-varlen", "pack-mask"):
            attention, kind, _ = gpu.METHODS[method]
            model.set_attn_implementation(attention)
            prepared = gpu.prepare(kind, batch, args)
            assert prepared.real == prepared.computed == sum(lengths)
            assert prepared.labelled == sum(lengths) - len(lengths)
            torch.testing.assert_close(model(**prepared.inputs).logits, alone, atol=1e-5, rtol=1e-5)


def test_flex_inputs_pad_the_row_to_max_tokens_with_a_document_mask():
    args = tiny_args()
    lengths = [7, 20, 1, 13]
    prepared = gpu.prepare("flex", packed_batch(lengths, args.vocab), args)
    total, extra = sum(lengths), args.max_tokens - sum(lengths)
    assert prepared.real == total and prepared.computed == args.max_tokens
    assert prepared.inputs["input_ids"].shape == (1, args.max_tokens)
    assert (prepared.labels[0, total:] == -100).all() and prepared.labelled == total - len(lengths)
    assert prepared.inputs["position_ids"][0, total:].tolist() == list(range(extra))
    from torch.nn.attention.flex_attention import create_mask

    block_mask = prepared.inputs["attention_mask"]
    dense = create_mask(block_mask.mask_mod, None, None, args.max_tokens, args.max_tokens, device="cpu")[0, 0]
    cu = torch.tensor(np.cumsum([0, *lengths, extra]), dtype=torch.int32)  # the padding: one more document
    assert torch.equal(dense, document_causal_mask(cu))
