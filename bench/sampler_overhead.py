"""PlanSampler cost on a large plan: open time and per-micro-batch overhead.

    .venv/bin/python -m bench.sampler_overhead                  # builds the plan once (~1 min)

The plan: all 16 M samples of ../shared/data/wikipedia_bert512.parquet (beside the checkout), pack
mode, max_tokens 512, world_size 8, one epoch; built once into --plan (reused when
the file exists). Measured, in one process with the file in the page cache:

- open: ``PlanSampler(path, rank=3, world_size=8)`` (memory map + metadata);
- first epoch setup: reading rank 3's record batch (zero-copy numpy views);
- per micro-batch: ``iter(sampler)`` (what a loader draws: the dataset rows with
  their ``MicroBatch`` record) and ``schedule()`` (the records alone, read-only),
  over every micro-batch of rank 3;
- for scale, a ``DataLoader(batch_sampler=sampler)`` over a trivial dataset.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time
from pathlib import Path

from torch.utils.data import DataLoader

from batchplan.runtime import PlanSampler

DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "wikipedia_bert512.parquet"
RANK, WORLD_SIZE = 3, 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--plan", type=Path, default=Path("/tmp/wikipedia_bert512_pack512_ws8.arrow"))
    parser.add_argument("--opens", type=int, default=50, help="repetitions of the open measurement")
    parser.add_argument("--loader-batches", type=int, default=100_000, help="micro-batches through a DataLoader")
    return parser.parse_args()


def build_if_missing(data: Path, plan: Path) -> float | None:
    if plan.exists():
        return None
    from batchplan import PlanConfig  # only here: building loads numba, the runtime does not
    from batchplan.operations.build import build_plan_file

    started = time.perf_counter()
    build_plan_file(data, plan, PlanConfig(max_tokens=512, world_size=WORLD_SIZE))
    return time.perf_counter() - started


def time_opens(plan: Path, repeat: int) -> tuple[float, float]:
    """(first open, median of ``repeat`` more) in milliseconds."""
    times = []
    for _ in range(repeat + 1):
        started = time.perf_counter()
        PlanSampler(plan, rank=RANK, world_size=WORLD_SIZE)
        times.append((time.perf_counter() - started) * 1e3)
    return times[0], statistics.median(times[1:])


def per_micro_batch(plan: Path) -> dict[str, float]:
    """Microseconds per micro-batch for each way of walking rank 3's epoch."""
    sampler = PlanSampler(plan, rank=RANK, world_size=WORLD_SIZE)
    started = time.perf_counter()
    sampler.set_epoch(0)
    rows = len(sampler)
    next(iter(sampler))  # reads the record batch
    setup_ms = (time.perf_counter() - started) * 1e3
    timings = {"rows": rows, "setup_ms": setup_ms}
    for name, walk in (
        ("iter(sampler)", lambda: sum(1 for _ in sampler)),
        ("schedule()", lambda: sum(1 for _ in sampler.schedule())),
    ):
        sampler.set_epoch(0)
        started = time.perf_counter()
        count = walk()
        timings[name] = (time.perf_counter() - started) / count * 1e6
    return timings


def loader_overhead(plan: Path, limit: int) -> float:
    """Microseconds per micro-batch through DataLoader(num_workers=0) with a trivial dataset."""
    sampler = PlanSampler(plan, rank=RANK, world_size=WORLD_SIZE)
    loader = DataLoader(range(sampler.plan.num_samples), batch_sampler=sampler, collate_fn=len)
    started = time.perf_counter()
    count = 0
    for _ in loader:
        count += 1
        if count == limit:
            break
    return (time.perf_counter() - started) / count * 1e6


def main() -> None:
    args = parse_args()
    build_seconds = build_if_missing(args.data, args.plan)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    first_ms, median_ms = time_opens(args.plan, args.opens)
    timings = per_micro_batch(args.plan)
    loader_us = loader_overhead(args.plan, args.loader_batches)
    rss_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    sampler = PlanSampler(args.plan, rank=RANK, world_size=WORLD_SIZE)

    print("command: .venv/bin/python -m bench.sampler_overhead")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
        f"plan: {args.plan} ({args.plan.stat().st_size / 2**20:,.0f} MiB), {sampler.plan.num_samples:,} samples, "
        f"world_size {WORLD_SIZE}, {sampler.num_steps:,} steps"
        + (f"; built in {build_seconds:.0f} s" if build_seconds else "")
    )
    print()
    print("| measurement | value |")
    print("|---|---:|")
    print(f"| open `PlanSampler(plan, rank={RANK}, world_size={WORLD_SIZE})`, first | {first_ms:.2f} ms |")
    print(f"| open, median of {args.opens} | {median_ms:.2f} ms |")
    print(f"| first epoch setup (read rank {RANK}'s {timings['rows']:,} rows) | {timings['setup_ms']:.2f} ms |")
    for name in ("iter(sampler)", "schedule()"):
        print(f"| per micro-batch, `{name}` | {timings[name]:.2f} us |")
    print(f"| per micro-batch, `DataLoader(range(n), batch_sampler=sampler)` | {loader_us:.2f} us |")
    print(f"| peak RSS growth over all of the above | {rss_growth_mb:,.0f} MiB |")


if __name__ == "__main__":
    main()
