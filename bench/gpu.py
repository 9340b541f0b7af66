"""Training throughput and rank balance of a small Llama on one GPU, from ShareGPT lengths.

    pip install --no-deps -e . && python -m bench.gpu --json gpu-bench.json   # one H200: at most --deadline 420 s
    .venv/bin/python -m bench.gpu --tiny --seconds 2 --json /tmp/gpu.json      # CPU (the default without CUDA): ~20 s

A randomly initialised ``LlamaForCausalLM`` (GPU: 12 layers, width 1,024, 16 heads, MLP 2,816, vocab
32,000, bf16 weights and AdamW, 220 M parameters; ``--tiny``: 2 layers, width 64; float32 on CPU) trains on
random token ids with the lengths of data/sharegpt_dialogues_cl100k.parquet. One model and optimizer
serve every method (switched with ``set_attn_implementation``), so peak memory differs only by what
each method's micro-batches need.

1. Real (non-pad) tokens/s: samples truncated to --max-length, at most --max-tokens per micro-batch,
   forward + backward + AdamW step per micro-batch, --seconds per method after --warmup micro-batches,
   in --rounds round-robin slices (peak memory: ``torch.cuda.max_memory_allocated``, reset per slice):
   - baseline: ``max_tokens // max_length`` samples per batch in random order, padded to the longest
     (Hugging Face Trainer's default); SDPA with the padding mask;
   - pad: a batchplan pad plan (``n x longest <= max_tokens``); SDPA with the padding mask;
   - pack-varlen: a batchplan pack plan; ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention
     varlen, causal within each sample of ``cu_seq_lens``); on CPU a per-sample SDPA loop stands in;
   - pack-flex (GPU only: FlexAttention has no CPU backward): the same plan; compiled FlexAttention
     with a document BlockMask, each row padded to max_tokens so one compiled kernel serves all;
   - pack-mask: the same plan; SDPA with the (T, T) block-diagonal causal mask transformers builds
     from ``position_ids`` restarting at 0 per sample.
2. Balance: --balance-samples seeded samples (whole, ``oversize="split"``) planned for 8 ranks, one
   micro-batch per rank per step, with ``balance="tokens"`` and ``balance="compute"`` (hidden_size =
   width). Forward + backward of each distinct pack is timed (--balance-passes passes, median) with
   the first pack method that trained; R^2 of those times against batchplan's cost model; each plan's
   step time = sum over steps of the slowest rank's measured time.

Time is bounded: checks between micro-batches, --warmup-limit per method's warm-up (compilation),
and a SIGALRM at --deadline; the table is printed and the JSON written with whatever was measured.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from batchplan import PlanConfig
from batchplan.runtime import (
    PackCollator,
    PadCollator,
    PlanDataset,
    PlanSampler,
    token_loss_sum,
)

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 8
SIZES = {  # option: (GPU default, --tiny default)
    "layers": (12, 2),
    "width": (1024, 64),
    "heads": (16, 4),
    "kv_heads": (16, 4),
    "mlp": (2816, 176),
    "vocab": (32000, 512),
    "max_tokens": (16384, 1024),
    "max_length": (4096, 256),
    "seconds": (40.0, 2.0),
    "rounds": (4, 2),
    "warmup": (3, 1),
    "warmup_limit": (180.0, 60.0),
    "deadline": (420.0, 120.0),
    "balance_samples": (2000, 8),
    "balance_passes": (3, 2),
    "balance_seconds": (75.0, 3.0),
    "methods": ("baseline,pad,pack-varlen,pack-flex", "baseline,pad,pack-varlen,pack-mask"),
}
PADDED = "SDPA + padding mask (transformers 'sdpa')"
METHODS = {  # name: (transformers attention implementation, input kind, kernel; varlen's: see varlen_kernel)
    "baseline": ("sdpa", "padded", PADDED),
    "pad": ("sdpa", "padded", PADDED),
    "pack-varlen": ("batchplan_varlen", "varlen", None),
    "pack-flex": ("flex_attention", "flex", "FlexAttention (compiled) + document BlockMask; rows padded to max_tokens"),
    "pack-mask": ("sdpa", "mask", "SDPA + (T, T) block-diagonal causal mask from position_ids (transformers 'sdpa')"),
}


class TimeLimit(Exception):
    """Raised by SIGALRM when a time limit is reached."""


def set_alarm(end: float, what: str) -> None:
    """From now on, raise `TimeLimit` in the main thread at ``end`` (``time.monotonic()``) and no other time."""

    def alarm(signum, frame):
        raise TimeLimit(what)

    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(end - time.monotonic(), 1e-3))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU sizes (the default without CUDA)")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "sharegpt_dialogues_cl100k.parquet")
    parser.add_argument("--json", type=Path, default=Path("gpu-bench.json"), help="where the results go")
    parser.add_argument("--seed", type=int, default=0)
    for name, (gpu, tiny) in SIZES.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(gpu), help=f"GPU {gpu}, tiny {tiny}")
    args = parser.parse_args(argv)
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.tiny = args.tiny or args.device.type == "cpu"
    for name, defaults in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, defaults[args.tiny])
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32  # FlashAttention: 16-bit only
    args.methods = args.methods.split(",")
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {list(METHODS)}")
    return args


def cost_model() -> tuple[Callable, Callable]:
    """batchplan's ``(attention_coefficient, micro_batch_costs)`` (the planning layer: numba)."""
    from batchplan.planning.cost import attention_coefficient, micro_batch_costs

    return attention_coefficient, micro_batch_costs


def build_plan(lengths: np.ndarray, directory: Path, name: str, **options) -> Path:
    """A plan file for a dataset of these lengths (a one-column Parquet file written beside it)."""
    from batchplan import build_plan_file

    dataset, plan = directory / f"{name}.parquet", directory / f"{name}.arrow"
    pq.write_table(pa.table({"length": np.asarray(lengths, dtype=np.int32)}), dataset)
    build_plan_file(dataset, plan, PlanConfig(**options))
    return plan


def random_tokens(lengths: np.ndarray, vocab: int, seed: int) -> list[np.ndarray]:
    """Sample ``i``: ``lengths[i]`` random token ids (views of one array), the same in every method."""
    ids = np.random.default_rng(np.random.SeedSequence([seed, 3])).integers(0, vocab, int(lengths.sum()))
    return np.split(ids, np.cumsum(lengths)[:-1])


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, 0)):
    """``varlen_attn``'s signature and layout ((T, H, D) in and out), causal SDPA per sample: for CPU."""
    pieces = [
        F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale)
        for s, e in itertools.pairwise(cu_q.tolist())
    ]
    return torch.cat([p.transpose(0, 1) for p in pieces])


def varlen_attention(module, query, key, value, attention_mask, *, kernel, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function: causal attention within each sample of a packed row."""
    if key.shape[1] != query.shape[1]:  # grouped key/value heads, repeated for the kernel
        key, value = (x.repeat_interleave(query.shape[1] // key.shape[1], 1) for x in (key, value))
    # (1, H, T, D) -> (T, H, D), the varlen layout: for Llama's projections already the memory order, no copy
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    if kernel is None:
        raise ImportError(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn")
    return kernel(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0)).unsqueeze(0), None


def varlen_kernel(device: torch.device) -> tuple[Callable, str]:
    if device.type != "cuda":
        return reference_varlen, "causal SDPA per sample over cu_seq_lens (CPU stand-in for varlen_attn)"
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # an older torch: pack-varlen alone fails, at its warm-up
        varlen_attn = None
    return varlen_attn, "torch.nn.attention.varlen.varlen_attn (FlashAttention varlen over cu_seq_lens)"


@functools.cache
def compiled_create_block_mask() -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def document_block_mask(document: torch.Tensor):
    """FlexAttention BlockMask: query q sees key k when both lie in one document and k <= q."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(batch, head, q, k):
        return (document[q] == document[k]) & (q >= k)

    make = compiled_create_block_mask() if document.is_cuda else create_block_mask  # compiled: no T x T tensor
    return make(same_document_causal, None, None, document.shape[0], document.shape[0], device=document.device)


def make_model(args: argparse.Namespace):
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    kernel = varlen_kernel(args.device)[0]
    AttentionInterface.register("batchplan_varlen", functools.partial(varlen_attention, kernel=kernel))
    sizes = {"num_hidden_layers": args.layers, "hidden_size": args.width, "num_attention_heads": args.heads}
    config = LlamaConfig(**sizes, num_key_value_heads=args.kv_heads, intermediate_size=args.mlp, vocab_size=args.vocab)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(args.device, args.dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


class Prepared(NamedTuple):
    inputs: dict  # model inputs, on the device
    labels: torch.Tensor
    labelled: int  # tokens with a target after the shift
    real: int  # non-pad tokens
    computed: int  # tokens the model computes, pad included


def prepare(kind: str, batch, args: argparse.Namespace) -> Prepared:
    """A collated micro-batch (CPU) -> what one forward takes, on the device."""
    labels = batch["labels"]
    labelled = int((labels[..., 1:] != -100).sum())
    if kind == "padded":
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        real = int(batch["attention_mask"].sum())
    else:
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
        real = int(batch["input_ids"].shape[1])
    if kind == "varlen":
        inputs |= {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    if kind == "flex":  # pad the row to max_tokens as one more document: one shape, one compiled kernel
        extra = args.max_tokens - real
        lengths = batch["cu_seq_lens"].diff().tolist() + ([extra] if extra else [])
        inputs["input_ids"] = F.pad(inputs["input_ids"], (0, extra))
        inputs["position_ids"] = torch.cat([inputs["position_ids"], torch.arange(extra)[None]], 1)
        labels = F.pad(labels, (0, extra), value=-100)
        document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    inputs = {k: v.to(args.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in inputs.items()}
    if kind == "flex":
        inputs["attention_mask"] = document_block_mask(document.to(args.device))
    return Prepared(inputs, labels.to(args.device, non_blocking=True), labelled, real, inputs["input_ids"].numel())


def forward_backward(model, prepared: Prepared) -> None:
    loss = token_loss_sum(model(**prepared.inputs), prepared.labels) / max(prepared.labelled, 1)
    loss.backward()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def baseline_rows(num_samples: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Random order, a fixed number of samples per batch, epoch after epoch."""
    for epoch in itertools.count():
        order = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(num_samples)
        for first in range(0, num_samples - batch_size + 1, batch_size):
            yield order[first : first + batch_size].tolist()


def plan_rows(path: Path) -> Iterator:
    """The micro-batches of a one-rank plan, replayed by PlanSampler, again and again."""
    while True:
        yield from PlanSampler(path, rank=0, world_size=1)


class Run:
    """One method: its micro-batch stream, and what it measured (``result``, reported as it grows)."""

    def __init__(self, name: str, rows: Iterator, dataset: PlanDataset, device: torch.device) -> None:
        self.name, self.rows, self.dataset = name, rows, dataset
        self.attention, self.kind, kernel = METHODS[name]
        self.collate = PadCollator() if self.kind == "padded" else PackCollator()
        kernel = kernel or varlen_kernel(device)[1]
        counts = {"micro_batches": 0, "real_tokens": 0, "computed_tokens": 0, "plan_tokens": 0, "seconds": 0.0}
        self.result = {"kernel": kernel, "tokens_per_s": None, **counts, "peak_memory_gib": None, "error": None}

    def train(self, model, optimizer, args, seconds: float, max_micro_batches: int = -1, timed: bool = True) -> None:
        """Forward + backward + AdamW step on the next micro-batches for ``seconds``."""
        model.set_attn_implementation(self.attention)
        if args.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)
        counts = np.zeros(4, dtype=np.int64)  # micro-batches, real, computed and planned tokens
        synchronize(args.device)
        started = time.perf_counter()
        while time.perf_counter() - started < seconds and counts[0] != max_micro_batches:
            batch = self.collate(self.dataset.__getitems__(next(self.rows)))
            prepared = prepare(self.kind, batch, args)
            forward_backward(model, prepared)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            counts += (1, prepared.real, prepared.computed, 0 if self.name == "baseline" else batch.record.tokens)
        synchronize(args.device)
        if timed:  # whole slices only
            result = self.result
            result["seconds"] += time.perf_counter() - started
            for key, value in zip(("micro_batches", "real_tokens", "computed_tokens", "plan_tokens"), counts):
                result[key] += int(value)
            result["tokens_per_s"] = result["real_tokens"] / max(result["seconds"], 1e-9)
            if args.device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(args.device) / 2**30
                result["peak_memory_gib"] = max(peak, result["peak_memory_gib"] or 0.0)

    def fail(self, error: Exception, model) -> None:
        self.result["error"] = f"{type(error).__name__}: {error}"[:800]
        model.zero_grad(set_to_none=True)
        print(f"{self.name} failed: {self.result['error']}", file=sys.stderr, flush=True)


def measure_throughput(runs: list[Run], model, optimizer, args, end: float) -> None:
    """Warm every method up (a failure is recorded, not fatal), then round-robin timed slices."""
    for run in runs:
        limit = time.monotonic() + args.warmup_limit  # compiling may take long: bounded per method
        set_alarm(min(limit, end), f"the warm-up limit ({args.warmup_limit:g} s)" if limit < end else "the deadline")
        try:
            run.train(model, optimizer, args, float("inf"), args.warmup, timed=False)
        except Exception as error:  # noqa: BLE001 - one failing kernel must not lose the others' numbers
            run.fail(error, model)
        finally:
            set_alarm(end, "the deadline")
    live = [run for run in runs if run.result["error"] is None]
    budget = min(len(live) * args.seconds, end - time.monotonic() - args.balance_seconds - 0.05 * args.deadline)
    slice_s = budget / (args.rounds * max(len(live), 1))
    for round_number in range(args.rounds if budget > 0 else 0):
        for run in list(live):
            try:
                run.train(model, optimizer, args, slice_s)
            except TimeLimit:
                raise
            except Exception as error:  # noqa: BLE001 - e.g. out of memory in one method
                run.fail(error, model)
                live.remove(run)
        summary = ", ".join(f"{run.name} {run.result['tokens_per_s']:,.0f}" for run in live)
        print(f"round {round_number + 1}/{args.rounds}: real tokens/s {summary}", file=sys.stderr, flush=True)


Pack = tuple[tuple[int, int, int], ...]  # (sample, first token, tokens) of each entry


def balance_plans(raw: np.ndarray, args, directory: Path) -> dict[str, list[tuple[int, int, Pack]]]:
    """(step, rank, pack) of each micro-batch of the token- and of the compute-balanced plan."""
    rng = np.random.default_rng(np.random.SeedSequence([args.seed, 1]))
    lengths = raw[np.sort(rng.permutation(len(raw))[: args.balance_samples])]
    plans = {}
    for balance in ("tokens", "compute"):
        options = {"world_size": WORLD_SIZE, "oversize": "split", "balance": balance, "seed": args.seed}
        width = {"hidden_size": args.width} if balance == "compute" else {}
        path = build_plan(lengths, directory, f"balance-{balance}", max_tokens=args.max_tokens, **options, **width)
        plans[balance] = []
        for rank in range(WORLD_SIZE):
            for mb in PlanSampler(path, rank=rank, world_size=WORLD_SIZE).schedule():
                sizes = mb.lengths if mb.lengths is not None else lengths[mb.indices].tolist()
                starts = mb.starts if mb.starts is not None else [0] * len(sizes)
                plans[balance].append((mb.step, rank, tuple(zip(mb.indices, starts, sizes))))
    return plans


def time_packs(packs: list[Pack], run: Run, model, args, deadline: float) -> np.ndarray:
    """Seconds of forward + backward of each pack, shape (passes, packs); NaN where time ran out."""
    times = np.full((args.balance_passes, len(packs)), np.nan)
    if not packs:
        return times
    pool = random_tokens(np.array([args.max_tokens]), args.vocab, args.seed)[0]  # token ids do not change the time
    prepared = [prepare(run.kind, PackCollator()([pool[:n] for _, _, n in pack]), args) for pack in packs]
    model.set_attn_implementation(run.attention)
    end = min(deadline, time.monotonic() + args.balance_seconds)
    rng = np.random.default_rng(np.random.SeedSequence([args.seed, 2]))
    for index in [-1, -1, *itertools.chain.from_iterable(rng.permutation(len(packs)) for _ in times)]:
        now = time.monotonic()
        if now > deadline or (now > end and (~np.isnan(times)).sum() >= 3):  # 3 packs at least: a fit
            break
        synchronize(args.device)
        started = time.perf_counter()
        forward_backward(model, prepared[index])
        synchronize(args.device)
        if index >= 0:  # two warm-up runs first
            times[np.argmax(np.isnan(times[:, index])), index] = time.perf_counter() - started
        model.zero_grad(set_to_none=True)
    return times


def fit(columns: list[np.ndarray], seconds: np.ndarray) -> tuple[np.ndarray, float]:
    """Least-squares coefficients of ``seconds ~ columns`` and R^2 (1 - SS_res / SS_tot, centred)."""
    design = np.stack(columns, axis=1)
    coefficients, *_ = np.linalg.lstsq(design, seconds, rcond=None)
    residual = seconds - design @ coefficients
    return coefficients, float(1.0 - (residual**2).sum() / max(((seconds - seconds.mean()) ** 2).sum(), 1e-300))


def step_seconds(rows: list[tuple[int, int, Pack]], index_of: dict, pack_time: np.ndarray) -> tuple[float, float]:
    """(sum over steps of the slowest rank's time, the same with the mean rank's: the ideal)."""
    per_rank = np.zeros((max(step for step, _, _ in rows) + 1, WORLD_SIZE))  # shape (steps, ranks)
    for step, rank, pack in rows:
        per_rank[step, rank] += pack_time[index_of[pack]] if pack else 0.0
    return float(per_rank.max(axis=1).sum()), float(per_rank.mean(axis=1).sum())


def summarize_balance(plans: dict, packs: list[Pack], times: np.ndarray, width: int) -> dict:
    """R^2 of the pack times against batchplan's cost model; simulated step time of each plan."""
    attention_coefficient, micro_batch_costs = cost_model()
    sizes = [np.array([n for _, _, n in pack], dtype=np.float64) for pack in packs]
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in sizes])]).astype(np.int64)
    cost = micro_batch_costs(np.concatenate(sizes), offsets, "pack", attention_coefficient(width))
    tokens, square = np.array([x.sum() for x in sizes]), np.array([(x**2).sum() for x in sizes])
    measured = ~np.isnan(times).all(axis=0)
    result = {"packs_timed": int(measured.sum()), "passes_complete": int((~np.isnan(times)).all(axis=1).sum())}
    if measured.sum() < 3:
        return result | {"note": "fewer than 3 packs timed: no fit, no step times"}
    seconds = np.nanmedian(times[:, measured], axis=0)
    (intercept, slope), r2 = fit([np.ones_like(seconds), cost[measured]], seconds)
    (a, b), r2_free = fit([tokens[measured], square[measured]], seconds)
    pack_time = intercept + slope * cost  # a pack left untimed takes the fitted time
    pack_time[measured] = seconds
    index_of = {pack: index for index, pack in enumerate(packs)}
    steps = {name: step_seconds(rows, index_of, pack_time) for name, rows in plans.items()}
    predicted = {name: step_seconds(rows, index_of, cost)[0] for name, rows in plans.items()}
    return result | {
        "pack_ms": {"min": 1e3 * seconds.min(), "median": 1e3 * np.median(seconds), "max": 1e3 * seconds.max()},
        "r2_cost_model": r2,  # time ~ intercept + slope x cost(width)
        "cost_fit": {"intercept_ms": 1e3 * intercept, "us_per_cost_token": 1e6 * slope},
        "free_fit": {"r2": r2_free, "coefficient": b / a, "coefficient_model": attention_coefficient(width)},
        "step_time_s": {name: value[0] for name, value in steps.items()},
        "idle": {name: 1.0 - value[1] / value[0] for name, value in steps.items()},
        "compute_vs_tokens": steps["compute"][0] / steps["tokens"][0],
        "compute_vs_tokens_cost_model": predicted["compute"] / predicted["tokens"],
    }


def measure_balance(raw: np.ndarray, runs: list[Run], model, args, directory: Path, report: dict, end: float) -> None:
    trained = [run for run in runs if run.kind != "padded" and run.result["micro_batches"] > 0]
    if not trained:
        report["note"] = "no pack method trained: nothing to time"
        return
    run = min(trained, key=lambda r: ("pack-varlen", "pack-flex", "pack-mask").index(r.name))
    plans = balance_plans(raw, args, directory)
    packs = sorted({pack for rows in plans.values() for _, _, pack in rows if pack})
    steps = {name: max(row[0] for row in rows) + 1 for name, rows in plans.items()}
    report |= {"method": run.name, "kernel": run.result["kernel"], "samples": args.balance_samples, "steps": steps}
    report["packs"] = len(packs)
    times = time_packs(packs, run, model, args, end)
    report |= summarize_balance(plans, packs, times, args.width)


def describe(args: argparse.Namespace) -> dict:
    """What runs where: command, device, versions, sizes."""
    import transformers

    sizes = ("layers", "width", "heads", "kv_heads", "mlp", "vocab")
    device = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else f"{os.cpu_count()} CPUs"
    return {
        "command": shlex.join(["python", "-m", "bench.gpu", *sys.argv[1:]]),
        "device": device,
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}",
        "model": {name: getattr(args, name) for name in sizes} | {"dtype": str(args.dtype).removeprefix("torch.")},
        "max_tokens": args.max_tokens,
        "max_length": args.max_length,
        "methods": {},
        "balance": {},
        "baseline_batch_size": args.max_tokens // args.max_length,
        "stopped": None,
    }


def run_all(args: argparse.Namespace, report: dict, end: float) -> None:
    raw = pq.read_table(args.data, columns=["length"]).column("length").to_numpy().astype(np.int64)
    lengths = np.minimum(raw, args.max_length)
    report["data"] = f"{args.data.name}: {len(raw):,} samples, {int(lengths.sum()):,} tokens after truncation"
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        modes = {"pad", "pack"} & {method.split("-")[0] for method in args.methods}
        plans = {mode: build_plan(lengths, directory, mode, max_tokens=args.max_tokens, mode=mode) for mode in modes}
        model, optimizer = make_model(args)
        report["model"]["parameters"] = sum(p.numel() for p in model.parameters())
        dataset = PlanDataset(random_tokens(lengths, args.vocab, args.seed))
        runs = []
        for method in args.methods:
            if method == "baseline":
                rows = baseline_rows(len(lengths), args.max_tokens // args.max_length, args.seed)
            else:
                rows = plan_rows(plans[method.split("-")[0]])
            runs.append(Run(method, rows, dataset, args.device))
            report["methods"][method] = runs[-1].result
        measure_throughput(runs, model, optimizer, args, end)
        measure_balance(raw, runs, model, args, directory, report["balance"], end)


def print_report(report: dict) -> None:
    m, methods, b = report["model"], report["methods"], report["balance"]
    base = (methods.get("baseline") or {}).get("tokens_per_s")
    print(
        f"\ncommand: {report['command']}\ndevice: {report['device']}; {report['versions']}\nmodel: "
        f"LlamaForCausalLM, random init, {m['layers']} layers, width {m['width']}, {m['heads']} heads "
        f"({m['kv_heads']} key/value), MLP {m['mlp']}, vocab {m['vocab']}, {m.get('parameters', 0) / 1e6:.1f} M "
        f"parameters, {m['dtype']}, AdamW\ndata: {report.get('data')}; max_tokens {report['max_tokens']:,} per "
        f"micro-batch, samples truncated to {report['max_length']:,}; baseline: {report['baseline_batch_size']} "
        "samples per batch\n\n| method | attention kernel | real tokens/s | vs. baseline | real / computed tokens "
        "| peak memory GiB | micro-batches |\n|---|---|---:|---:|---:|---:|---:|"
    )
    for name, r in methods.items():
        cells = [name, r["kernel"], f"failed: {r['error']}" if r["error"] else "not timed", "", "", "", ""]
        if not r["error"] and r["tokens_per_s"]:
            ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
            memory = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
            fill = f"{r['real_tokens'] / r['computed_tokens']:.1%}"
            cells[2:] = [f"{r['tokens_per_s']:,.0f}", ratio, fill, memory, r["micro_batches"]]
        print("| " + " | ".join(map(str, cells)) + " |")
    if "r2_cost_model" in b:
        ms, free, step, idle = b["pack_ms"], b["free_fit"], b["step_time_s"], b["idle"]
        print(
            f"\nbalance: {b['samples']:,} samples, split at max_tokens, {WORLD_SIZE} ranks, 1 micro-batch per rank "
            f"per step ({b['steps']['tokens']} / {b['steps']['compute']} steps); {b['packs']} packs, "
            f"{b['packs_timed']} timed, {b['passes_complete']} full passes, {b['method']}: forward + backward "
            f"{ms['min']:.1f} / {ms['median']:.1f} / {ms['max']:.1f} ms (min / median / max)\n  time ~ cost model "
            f"(tokens + L^2 / (12 x width)): R^2 = {b['r2_cost_model']:.4f}; free fit a tokens + b sum L^2: R^2 = "
            f"{free['r2']:.4f}, b/a = {free['coefficient']:.3g} (model {free['coefficient_model']:.3g})\n  step "
            f"time, measured: balance=tokens {step['tokens']:.3f} s ({idle['tokens']:.1%} idle), balance=compute "
            f"{step['compute']:.3f} s ({idle['compute']:.1%} idle): compute / tokens = {b['compute_vs_tokens']:.3f}"
            f" (the cost model predicts {b['compute_vs_tokens_cost_model']:.3f})"
        )
    else:
        print(f"\nbalance: {b.get('note', 'not measured')}")
    if report["stopped"]:
        print(f"\nstopped early: {report['stopped']}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    report = describe(args)
    try:
        set_alarm(started + args.deadline, "the deadline")
        run_all(args, report, started + args.deadline)
    except TimeLimit as error:
        report["stopped"] = f"{error} ({args.deadline:g} s) reached"
    except Exception as error:  # noqa: BLE001 - what was measured is still reported
        traceback.print_exc()
        report["stopped"] = f"{type(error).__name__}: {error}"[:800]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    report["wall_s"] = time.monotonic() - started
    print_report(report)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
