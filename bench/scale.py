"""Pretraining scale: one epoch of 10⁶ .. 10⁹ samples written as a plan directory, and what a
rank pays to open its slice.

    python -m bench.scale --samples 1e6 1e7 1e8 --world-size 1024
    python -m bench.scale --samples 1e8 --open-world-sizes 64 1024 4096
    python -m bench.scale --samples 1e9 --world-size 1024          # ~13 GB of Parquet + plan on disk

For each sample count: lognormal lengths (`bench.build.lognormal_lengths`, median 300, clipped at
the cap), written to Parquet in chunks of 10⁷ (bounded memory; not timed); then, as subprocesses,
`batchplan build --layout directory --epochs 1` (pack, the cap, the world size) with its wall time
and peak resident memory (getrusage of the child), and `numpy.random.default_rng(0).permutation(N)`
(the yardstick, its own process) — the ratio is of runs made one after the other in this run. A
build of 1,000 samples first warms the numba cache.

With ``--open-world-sizes``, a plan is built per world size and, for a few ranks, a fresh process
imports ``batchplan.runtime`` (not timed), then times ``PlanSampler(plan, rank=r, world_size=W)``
and its first batch (open the manifest, map the epoch's file, read and check the rank's rows: what
a training process does before its first batch) and lists the plan files it has mapped or open. The files were just
written, so they are in the page cache: on a cold network file system add its latency per file
(two files: the manifest and the epoch's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from bench.build import lognormal_lengths, permutation_in_child, run_in_child, run_measured

CHUNK = 10**7

_OPEN = """
import json, os, sys, time
from batchplan.runtime import PlanSampler
path, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
start = time.perf_counter()
sampler = PlanSampler(path, rank=rank, world_size=world)
first = next(iter(sampler))  # the rank's rows of the epoch are read here
seconds = time.perf_counter() - start
names = {line.split()[-1] for line in open("/proc/self/maps") if path in line}
for fd in os.listdir("/proc/self/fd"):
    try:
        names.add(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        pass
print(json.dumps({"seconds": seconds, "plan_files": sorted(os.path.basename(n) for n in names if path in n)}))
"""


def write_lognormal(path: Path, num_samples: int, max_tokens: int) -> None:
    """``num_samples`` lognormal lengths in chunks of 10⁷ (chunk ``i`` drawn with seed ``i``)."""
    schema = pa.schema([("length", pa.int32())])
    with pq.ParquetWriter(path, schema) as writer:
        for index, start in enumerate(range(0, num_samples, CHUNK)):
            lengths = lognormal_lengths(min(CHUNK, num_samples - start), max_tokens, seed=index)
            writer.write_table(pa.table({"length": lengths}, schema=schema), row_group_size=1 << 22)


def build(dataset: Path, output: Path, max_tokens: int, world_size: int) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB, `bench.build.run_measured`) of one directory build."""
    return run_measured([sys.executable, "-m", "batchplan_cli.main", "build", str(dataset), "-o", str(output),
                         "--max-tokens", str(max_tokens), "--world-size", str(world_size), "--epochs", "1",
                         "--layout", "directory", "-q"])  # fmt: skip


def open_seconds(plan: Path, rank: int, world_size: int) -> dict:
    found = subprocess.run([sys.executable, "-c", _OPEN, str(plan), str(rank), str(world_size)], check=True,
                           capture_output=True, text=True)  # fmt: skip
    return json.loads(found.stdout)


def directory_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.iterdir()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=float, nargs="+", default=[1e6, 1e7])
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--open-world-sizes", type=int, nargs="*", default=[])
    parser.add_argument("--tmp", type=Path, default=None, help="where to write lengths and plans")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        tmp = Path(tmp)
        run_in_child("bench.scale:write_lognormal", tmp / "tiny.parquet", 1000, args.max_tokens)
        build(tmp / "tiny.parquet", tmp / "tiny", args.max_tokens, 8)  # warm the numba cache
        for samples in map(int, args.samples):
            dataset = tmp / f"lengths-{samples}.parquet"
            run_in_child("bench.scale:write_lognormal", dataset, samples, args.max_tokens)
            rows = []
            for world_size in args.open_world_sizes or [args.world_size]:
                plan = tmp / f"plan-{samples}-{world_size}"
                wall, peak = build(dataset, plan, args.max_tokens, world_size)
                row = {"samples": samples, "world_size": world_size, "build_s": round(wall, 2),
                       "peak_rss_gib": round(peak, 2), "plan_mib": round(directory_mib(plan), 1)}  # fmt: skip
                if args.open_world_sizes:
                    opens = [open_seconds(plan, rank, world_size) for rank in (0, world_size // 2, world_size - 1)]
                    row["open_ms"] = [round(o["seconds"] * 1000, 1) for o in opens]
                    row["files_read"] = opens[0]["plan_files"]
                rows.append(row)
            permutation = permutation_in_child(samples)
            for row in rows:
                row["permutation_s"] = round(permutation, 2)
                row["ratio"] = round(row["build_s"] / permutation, 2)
                print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            dataset.unlink()
            for row in rows:
                _remove(tmp / f"plan-{samples}-{row['world_size']}")


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
