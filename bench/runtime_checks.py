"""What the runtime's checks cost: per rank-epoch read, and per micro-batch collated.

    .venv/bin/python -m bench.runtime_checks                       # 10^7 samples, 64 ranks (~1 min to build)
    .venv/bin/python -m bench.runtime_checks --max-tokens 2048     # spans: samples over 2,048 are split

The plan: lognormal lengths (median 300, clipped to 8,192), pack mode, ``--max-tokens``
(8,192 by default), ``--world-size`` ranks, one epoch, ``oversize="split"``; built once
into /tmp (reused when the file exists). In one process, with the file in the page cache,
for every rank, interleaved A B C A B C ... over ``--rounds`` rounds:

- A: reading one rank's rows of an epoch as the sampler does without checks
  (``rank_rows(checked=False)``, validated record batch, `RankRows` views);
- A+: A with the rows' own checksum (``read_rank``'s default: the CRC-32 their record batch
  carries, recomputed);
- B: A, then `check_rank_rows` (sample indices within ``num_samples``; with spans, spans
  inside their samples and each row's tokens);
- C: B with the dataset's lengths known (after ``check_dataset(..., lengths)``): spans
  against them, each row's tokens against them.

Then per micro-batch, interleaved over rank 0's first ``--micro-batches`` micro-batches:
`PackCollator` on the items without a record (no check) and with it (`check_items`), and
`PlanDataset.__getitems__` with ``input_key=None`` (no check) and the default.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from batchplan.formats.opening import open_plan
from batchplan.runtime import PackCollator, PlanDataset
from batchplan.runtime.checks import check_items, check_rank_rows, span_cap
from batchplan.runtime.records import PlannedRows
from batchplan.runtime.rows import RankRows
from bench.build import lognormal_lengths

LONGEST = 8192


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=float, default=1e7)
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3, help="passes over every rank")
    parser.add_argument("--micro-batches", type=int, default=2000, help="micro-batches collated per variant")
    parser.add_argument("--tmp", type=Path, default=Path(os.environ.get("BENCH_TMP", "/tmp")))
    return parser.parse_args()


def build_if_missing(path: Path, lengths: np.ndarray, max_tokens: int, world_size: int) -> float | None:
    if path.exists():
        return None
    from batchplan.config import PlanConfig  # only here: building loads numba, the runtime does not
    from batchplan.formats.plan_writer import write_plan
    from batchplan.planning.epochs import build_plan

    started = time.perf_counter()
    config = PlanConfig(max_tokens=max_tokens, world_size=world_size, oversize="split")
    write_plan(build_plan(lengths, config), path)
    return time.perf_counter() - started


def read_rows(plan, rank: int, checked: bool = False) -> RankRows:
    rows = plan.rank_rows(0, rank, checked=checked)
    return RankRows(rows, 0, plan.world_size, rank=rank, span_cap=span_cap(plan.metadata, 0))


def time_reads(plan, lengths: np.ndarray, rounds: int) -> dict[str, list[float]]:
    """Microseconds per rank-epoch read, per variant, interleaved rank by rank."""
    variants = {
        "A: read": lambda rank: read_rows(plan, rank),
        "A+: read, rows' checksum": lambda rank: read_rows(plan, rank, checked=True),
        "B: read + check": lambda rank: check_rank_rows(read_rows(plan, rank), plan, rank),
        "C: read + check with lengths": lambda rank: check_rank_rows(read_rows(plan, rank), plan, rank, lengths),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    times["check alone"], times["check with lengths alone"] = [], []
    for rank in range(plan.world_size):  # warm: every rank's pages in the page cache
        variants["C: read + check with lengths"](rank)
    names = list(variants)
    for round_ in range(rounds):
        for rank in range(plan.world_size):
            shift = (round_ + rank) % len(names)  # each variant first as often as the others
            for name in names[shift:] + names[:shift]:
                started = time.perf_counter()
                variants[name](rank)
                times[name].append((time.perf_counter() - started) * 1e6)
            rows = read_rows(plan, rank)
            for name, known in (("check alone", None), ("check with lengths alone", lengths)):
                started = time.perf_counter()
                check_rank_rows(rows, plan, rank, known)
                times[name].append((time.perf_counter() - started) * 1e6)
    return times


def time_micro_batches(plan, lengths: np.ndarray, count: int) -> dict[str, float]:
    """Median microseconds per micro-batch of rank 0, per variant, interleaved micro-batch by micro-batch."""
    records = list(read_rows(plan, 0).records())[:count]
    dataset = _Tokens(lengths)
    collator = PackCollator()
    unchecked, checked = PlanDataset(dataset, input_key=None), PlanDataset(dataset)
    variants = {
        "PackCollator, no record": lambda rows, items: collator(list(items)),
        "PackCollator, record (check_items)": lambda rows, items: collator(items),
        "PlanDataset.__getitems__, input_key=None": lambda rows, items: unchecked.__getitems__(rows),
        "PlanDataset.__getitems__, checked": lambda rows, items: checked.__getitems__(rows),
        "check_items alone": lambda rows, items: check_items(rows.record, [len(i["input_ids"]) for i in items]),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for record in records:
        rows = PlannedRows(record.indices, record)
        items = checked.__getitems__(rows)
        for name, run in variants.items():
            started = time.perf_counter()
            run(rows, items)
            times[name].append((time.perf_counter() - started) * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


class _Tokens:
    """Sample ``i`` is ``lengths[i]`` zeros (made once per item: what a tokenized dataset returns)."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return self.lengths.shape[0]

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {"input_ids": np.zeros(int(self.lengths[index]), dtype=np.int64)}


def main() -> None:
    args = parse_args()
    samples = int(args.samples)
    lengths = lognormal_lengths(samples, LONGEST)
    path = args.tmp / f"runtime_checks_crc_{samples:.0e}_ws{args.world_size}_{args.max_tokens}.arrow"
    built = build_if_missing(path, lengths, args.max_tokens, args.world_size)
    plan = open_plan(path)
    entries = [read_rows(plan, rank).entries()["samples"][1].shape[0] for rank in range(plan.world_size)]
    reads = time_reads(plan, lengths, args.rounds)
    per_batch = time_micro_batches(plan, lengths, args.micro_batches)

    command = f"--samples {args.samples:.0e} --world-size {args.world_size} --max-tokens {args.max_tokens}"
    print(f"command: .venv/bin/python -m bench.runtime_checks {command}")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
    size = f"{path.stat().st_size / 2**20:,.0f} MiB"
    print(
        f"machine: {machine}; plan: {path} ({size}), {samples:,} samples, world_size {args.world_size}, "
        f"spans: {'starts' in plan.schema.names}, entries per rank: median {int(statistics.median(entries)):,}"
        + (f"; built in {built:.0f} s" if built else "")
    )
    print()
    title = f"rank-epoch read ({args.rounds} rounds x {args.world_size} ranks, interleaved)"
    print(f"| {title} | median | added | ns per entry |")
    print("|---|---:|---:|---:|")
    base = reads["A: read"]
    for name, times in reads.items():
        added = statistics.median(times) if "alone" in name else statistics.median(t - b for t, b in zip(times, base))
        per_entry = added * 1e3 / statistics.median(entries)
        print(f"| {name} | {statistics.median(times):,.1f} us | {added:+,.1f} us | {per_entry:.2f} |")
    print()
    print(f"| per micro-batch (rank 0's first {args.micro_batches:,}, interleaved) | time |")
    print("|---|---:|")
    for name, micros in per_batch.items():
        print(f"| {name} | {micros:.2f} us |")


if __name__ == "__main__":
    main()
