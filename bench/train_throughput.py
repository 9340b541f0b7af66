"""Training throughput on CPU: real (non-pad) tokens per second, baseline vs. plan.

    .venv/bin/python -m bench.train_throughput                  # ~2 minutes on 2 cores

The same tiny GPT as examples/train_ddp.py (d_model 64, 2 layers, vocab 1,024,
float32), one process, forward + backward + AdamW step per micro-batch, on random
token ids with the real lengths of data/sharegpt_dialogues_cl100k.parquet, each
sample truncated to --max-length tokens (the same tokens for every method):

(a) baseline: a fixed number of samples per batch (max_tokens // max_length, so
    the worst case fits the same memory), random order, padded to the longest;
(b) plan, pad mode: ``n x longest <= max_tokens``, samples of similar length;
(c) plan, pack mode: samples concatenated up to max_tokens, document-masked
    attention (causal SDPA per sample over ``cu_seq_lens``; "pack (mask)" uses
    one block-diagonal mask over the row instead).

Each method trains for --seconds in total after --warmup micro-batches, in
--rounds round-robin slices (so load from other processes hits every method
alike); tokens/s counts only real tokens. Plans are built in a temporary
directory (not timed).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from batchplan.runtime import PackCollator, PadCollator, PlanSampler, token_loss_sum
from batchplan.toy import RandomTokens, TinyGPT

ROOT = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 1024


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "sharegpt_dialogues_cl100k.parquet")
    parser.add_argument("--max-tokens", type=int, default=8192, help="token budget of one micro-batch")
    parser.add_argument("--max-length", type=int, default=2048, help="samples are truncated to this")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured time per method")
    parser.add_argument("--rounds", type=int, default=6, help="the time is split into rounds over all methods")
    parser.add_argument("--warmup", type=int, default=2, help="untimed micro-batches per method")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--methods", default="baseline,pad,pack,pack-mask")
    return parser.parse_args()


def baseline_batches(num_samples: int, batch_size: int) -> Iterator[list[int]]:
    """Random order, a fixed number of samples per batch (what most training loops do)."""
    order = np.random.default_rng(np.random.SeedSequence([0, 0, 0])).permutation(num_samples)
    for first in range(0, num_samples - batch_size + 1, batch_size):
        yield order[first : first + batch_size].tolist()


def plan_batches(lengths: np.ndarray, mode: str, max_tokens: int, directory: Path) -> Iterator[list[int]]:
    """This process's micro-batches of a one-rank plan, through PlanSampler."""
    from batchplan import PlanConfig
    from batchplan.formats.plan_writer import write_plan
    from batchplan.planning.epochs import build_plan

    path = directory / f"{mode}.arrow"
    write_plan(build_plan(lengths, PlanConfig(max_tokens=max_tokens, mode=mode)), path)
    yield from PlanSampler(path, rank=0, world_size=1)


class Run:
    """One method's model, optimizer and micro-batch stream, timed slice by slice."""

    def __init__(self, batches: Iterator[list[int]], dataset, collator, attention: str) -> None:
        self.batches, self.dataset, self.collator = batches, dataset, collator
        self.model = make_model(attention)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.real = self.computed = self.count = 0
        self.seconds = 0.0

    def train(self, seconds: float, *, timed: bool = True, max_micro_batches: int | None = None) -> None:
        """Train on the next micro-batches for ``seconds`` (or ``max_micro_batches``)."""
        started = time.perf_counter()
        done = 0
        while time.perf_counter() - started < seconds and done != max_micro_batches:
            batch = self.collator([self.dataset[i] for i in next(self.batches)])
            labelled = int((batch["labels"][..., 1:] != -100).sum())
            loss = token_loss_sum(self.model(**batch), batch) / max(labelled, 1)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            done += 1
            if timed:
                mask = batch.get("attention_mask")
                self.real += int(batch["input_ids"].numel() if mask is None else mask.sum())
                self.computed += int(batch["input_ids"].numel())
                self.count += 1
        if timed:
            self.seconds += time.perf_counter() - started

    def result(self) -> dict:
        return {
            "tokens_per_s": self.real / self.seconds,
            "micro_batches": self.count,
            "real": self.real,
            "padded": self.computed,
            "seconds": self.seconds,
        }


def make_model(attention: str) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB_SIZE, d_model=64, num_heads=4, num_layers=2, max_positions=2048, attention=attention)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    raw = pq.read_table(args.data, columns=["length"]).column("length").to_numpy()
    lengths = np.minimum(raw, args.max_length).astype(np.int32)
    dataset = RandomTokens(lengths, VOCAB_SIZE)
    batch_size = args.max_tokens // args.max_length
    with tempfile.TemporaryDirectory() as directory:

        def plan(mode: str) -> Iterator[list[int]]:
            return plan_batches(lengths, mode, args.max_tokens, Path(directory))

        streams = {
            "baseline": (lambda: baseline_batches(len(lengths), batch_size), PadCollator(), "documents"),
            "pad": (lambda: plan("pad"), PadCollator(), "documents"),
            "pack": (lambda: plan("pack"), PackCollator(), "documents"),
            "pack-mask": (lambda: plan("pack"), PackCollator(), "mask"),
        }
        runs = {}
        for name in args.methods.split(","):
            batches, collator, attention = streams[name]
            runs[name] = Run(batches(), dataset, collator, attention)
            runs[name].train(float("inf"), timed=False, max_micro_batches=args.warmup)
        # Round-robin slices: a load change on a shared machine hits every method alike.
        for round_number in range(args.rounds):
            for run in runs.values():
                run.train(args.seconds / args.rounds)
            summary = ", ".join(f"{n} {r.real / r.seconds:,.0f}" for n, r in runs.items())
            print(f"round {round_number + 1}/{args.rounds}: real tokens/s {summary}", flush=True)
    results = {name: run.result() for name, run in runs.items()}
    print_report(args, results, batch_size, len(lengths), int(lengths.sum()))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def print_report(args, results: dict, batch_size: int, num_samples: int, total_tokens: int) -> None:
    labels = {
        "baseline": f"(a) baseline: {batch_size} samples/batch, random order, padded",
        "pad": "(b) plan, pad mode",
        "pack": "(c) plan, pack mode, per-sample causal SDPA",
        "pack-mask": "(c) plan, pack mode, block-diagonal SDPA mask",
    }
    base = results.get("baseline", {}).get("tokens_per_s")
    print(
        f"\ncommand: .venv/bin/python -m bench.train_throughput --max-tokens {args.max_tokens} "
        f"--max-length {args.max_length} --seconds {args.seconds:g} --rounds {args.rounds} "
        f"--threads {args.threads}"
    )
    print(
        f"machine: {cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, "
        f"torch {torch.__version__}, {args.threads} threads; data: {args.data.name}, {num_samples:,} samples, "
        f"{total_tokens:,} tokens after truncation to {args.max_length}\n"
    )
    print("| method | real tokens/s | vs. baseline | real / computed tokens | micro-batches timed |")
    print("|---|---:|---:|---:|---:|")
    for name, result in results.items():
        ratio = f"{result['tokens_per_s'] / base:.2f}x" if base else "-"
        fill = result["real"] / max(result["padded"], 1)
        print(f"| {labels[name]} | {result['tokens_per_s']:,.0f} | {ratio} | {fill:.1%} | {result['micro_batches']} |")


if __name__ == "__main__":
    main()
