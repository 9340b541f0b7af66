"""batchplan's packing against installable peers, on identical lengths, in the same run.

The peers are not dependencies of batchplan: run this from a separate virtualenv that
holds batchplan and them (torch pinned: an unpinned one pulls a multi-GB CUDA build;
axolotl without its dependencies: its packer module imports only numba, numpy, torch,
accelerate and transformers, which trl brings):

    python3 -m venv /tmp/peers-venv
    /tmp/peers-venv/bin/pip install -e . binpacking trl torch==2.13.0
    /tmp/peers-venv/bin/pip install --no-deps axolotl

    /tmp/peers-venv/bin/python -m bench.peers                     # 10^6 lognormal lengths, 8,192
    /tmp/peers-venv/bin/python -m bench.peers --samples 1e5       # binpacking runs up to 10^5
    /tmp/peers-venv/bin/python -m bench.peers --file ../shared/data/wikipedia_bert512.parquet \\
        --max-tokens 512 --samples 1e6                            # the file's first 10^6 rows
    /tmp/peers-venv/bin/python -m bench.peers --file ../shared/data/wikipedia_bert512.parquet \\
        --max-tokens 512 --peers batchplan,axolotl

Every peer packs the same numpy lengths (clipped to --max-tokens beforehand, so none has
to truncate; samples of length 0 are left out), in this process, one after the other.
Only each peer's packing call is timed, after a warm-up call on the first 2,000 lengths
(numba compiles then, not in the timed calls); best of --repeats (a peer stops
repeating once a run has taken over 20 s). What is timed:

- batchplan, plan: `build_plan(lengths, PlanConfig(max_tokens=C, world_size=1,
  oversize="truncate"))`, a whole epoch's plan: shuffle, pack, steps, row layout.
- batchplan, pack: only the packing step, `form_micro_batches(lengths, config,
  epoch_rng(0, 0, 0))` (shuffle within lengths + exact best-fit decreasing over all
  samples); the reference of the ratio column. It returns each bin's size and tokens and
  each (length, slot)'s bin; the members in bin order are listed only when asked for
  (a plan lays them out straight into rows): "batchplan, pack + members listed" adds
  that, the form in which the peers return their bins.
- axolotl, sampler: `MultipackBatchSampler.generate_batches()` as axolotl's trainer builds
  the sampler (RandomSampler order, group_size 100,000, bin_size 200, batch_size 1,
  num_processes = the CPU count as `dataset_num_proc` defaults, at most 4):
  `pack_parallel` over groups of 100,000 in a fork process pool, plus the mapping back to
  dataset indices in Python. axolotl, pack_group: the same numba kernel over the same
  groups in this process (`pack_parallel(..., num_processes=1)`), dataset order. The
  kernel is first-fit in the given order within each group (its docstring says
  first-fit decreasing; it does not sort).
- trl: `trl.data_utils.pack_dataset(dataset, C, strategy="bfd")` on a `datasets.Dataset`
  with one `input_ids` column (list<int32>; sample i's tokens are all i, which is how
  its output is checked). Building the dataset is not timed. TRL packs the token data,
  not just indices, so the call also copies every token. pack_dataset runs
  `Dataset.map(batched=True)`: with the default map batch size (1,000, what SFTTrainer
  uses) each 1,000 consecutive samples are packed on their own ("trl, bfd"); with
  `map_kwargs={"batch_size": None}` all samples are one batch ("trl, bfd one batch").
  Skipped above 2^31 - 1 tokens (list<int32> offsets; the token column would be 8+ GB).
- binpacking: `binpacking.to_constant_volume({i: length}, C)`, pure Python, worst fit
  decreasing (the emptiest bin that fits); only up to --binpacking-max samples.

For each peer the output bins are checked (every sample exactly once, no bin over C)
and its packing efficiency computed: real tokens / (bins x C). Prints a table; --json
for machines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from bench.build import lognormal_lengths

WARMUP_SAMPLES = 2_000
NO_REPEAT_SECONDS = 20.0
AXOLOTL_GROUP_SIZE = 100_000  # axolotl's sample_packing_group_size default
AXOLOTL_BIN_SIZE = 200  # axolotl's sample_packing_bin_size default
INT32_MAX = 2**31 - 1

# Each peer's set-up function gets (lengths, capacity), does the untimed preparation and
# returns (pack, to_bins): pack() is the timed call; to_bins(its result) gives (offsets,
# members), bin b holding samples members[offsets[b]:offsets[b + 1]].
Bins = tuple[np.ndarray, np.ndarray]


class Skipped(Exception):
    """A peer that does not run at this size (the message says why)."""


def _csr(bins: list) -> Bins:
    """(offsets, members) of a list of lists of sample indices."""
    sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    members = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(offsets[-1]))
    return offsets, members


def setup_batchplan_plan(lengths: np.ndarray, capacity: int):
    from batchplan import PlanConfig
    from batchplan.planning.epochs import build_plan

    config = PlanConfig(max_tokens=capacity, world_size=1, oversize="truncate")

    def to_bins(plan) -> Bins:
        (epoch,) = plan.epochs
        return epoch.offsets, epoch.members

    return lambda: build_plan(lengths, config), to_bins


def setup_batchplan_pack(lengths: np.ndarray, capacity: int):
    from batchplan import PlanConfig
    from batchplan.planning.forming import form_micro_batches
    from batchplan.planning.randomness import epoch_rng

    config = PlanConfig(max_tokens=capacity, world_size=1, oversize="truncate")

    def to_bins(batches) -> Bins:
        starts, ends, members = batches.starts, batches.ends, batches.members
        assert np.array_equal(starts[1:], ends[:-1]) and starts[0] == 0  # contiguous, in bin order
        return np.append(starts, ends[-1]), members

    return lambda: form_micro_batches(lengths, config, epoch_rng(0, 0, 0)), to_bins


def setup_batchplan_pack_members(lengths: np.ndarray, capacity: int):
    pack, to_bins = setup_batchplan_pack(lengths, capacity)

    def pack_members():
        batches = pack()
        batches.members  # noqa: B018 -- the bins' members listed, as the peers return them
        return batches

    return pack_members, to_bins


def _axolotl_cpus() -> int:
    # axolotl's dataset_num_proc defaults to os.cpu_count(); generate_batches caps it at 4.
    return min(4, os.cpu_count() or 1)


def setup_axolotl_sampler(lengths: np.ndarray, capacity: int):
    import torch
    from axolotl.utils.samplers.multipack import MultipackBatchSampler
    from torch.utils.data import RandomSampler

    generator = torch.Generator().manual_seed(0)
    sampler = MultipackBatchSampler(
        RandomSampler(range(lengths.shape[0]), generator=generator),
        batch_size=1,
        batch_max_len=capacity,
        lengths=lengths,
        bin_size=AXOLOTL_BIN_SIZE,
        group_size=AXOLOTL_GROUP_SIZE,
        drop_last=False,
        num_processes=_axolotl_cpus(),
        mp_start_method="fork",
    )

    def pack():
        sampler._batches = None  # generate_batches caches its result
        return sampler.generate_batches()

    def to_bins(batches) -> Bins:
        return _csr([b for batch in batches for b in batch])

    return pack, to_bins


def setup_axolotl_pack_group(lengths: np.ndarray, capacity: int):
    from axolotl.utils.samplers.multipack import pack_parallel

    def pack():
        return pack_parallel(
            lengths, bin_capacity=capacity, group_size=AXOLOTL_GROUP_SIZE, bin_size=AXOLOTL_BIN_SIZE, num_processes=1
        )

    return pack, _csr


def _trl_setup(lengths: np.ndarray, capacity: int, map_kwargs: dict | None):
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    total = int(lengths.sum(dtype=np.int64))
    if total > INT32_MAX:
        raise Skipped(f"{total:,} tokens: over list<int32> offsets (2^31 - 1), an 8+ GB token column")
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.repeat(np.arange(lengths.shape[0], dtype=np.int32), lengths)  # sample i's tokens are all i
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})
    dataset = datasets.Dataset(InMemoryTable(table))
    del values, offsets, table

    def pack():
        return pack_dataset(dataset, capacity, strategy="bfd", map_kwargs=map_kwargs)

    def to_bins(packed) -> Bins:
        table = packed.data.table
        input_ids = table.column("input_ids").combine_chunks()
        seq_lengths = table.column("seq_lengths").combine_chunks()
        tokens = input_ids.flatten().to_numpy()
        segment = seq_lengths.flatten().to_numpy().astype(np.int64)
        starts = np.zeros(segment.shape[0], dtype=np.int64)
        np.cumsum(segment[:-1], out=starts[1:])
        seq_offsets = seq_lengths.offsets.to_numpy().astype(np.int64)
        row_tokens = np.diff(input_ids.offsets.to_numpy())
        assert np.array_equal(np.add.reduceat(segment, seq_offsets[:-1]), row_tokens), "seq_lengths != rows"
        members = tokens[starts].astype(np.int64)
        assert np.array_equal(np.repeat(members, segment), tokens), "a packed sample's tokens are not its own"
        return seq_offsets, members

    return pack, to_bins


def setup_trl(lengths: np.ndarray, capacity: int):
    return _trl_setup(lengths, capacity, None)


def setup_trl_one_batch(lengths: np.ndarray, capacity: int):
    return _trl_setup(lengths, capacity, {"batch_size": None})


def setup_binpacking(lengths: np.ndarray, capacity: int, limit: int):
    import binpacking

    if lengths.shape[0] > limit:
        raise Skipped(f"{lengths.shape[0]:,} samples > --binpacking-max {limit:,} (pure Python, O(samples x bins))")
    weights = dict(enumerate(lengths.tolist()))

    def to_bins(bins) -> Bins:
        return _csr([list(b.keys()) for b in bins])

    return lambda: binpacking.to_constant_volume(weights, capacity), to_bins


PEERS: dict[str, tuple[str, str, Callable]] = {  # key: (group, label, set-up)
    "batchplan-plan": ("batchplan", "batchplan, plan (build_plan: one epoch)", setup_batchplan_plan),
    "batchplan-pack": ("batchplan", "batchplan, pack (form_micro_batches)", setup_batchplan_pack),
    "batchplan-pack-members": ("batchplan", "batchplan, pack + members listed", setup_batchplan_pack_members),
    "axolotl-sampler": ("axolotl", "axolotl, sampler (generate_batches)", setup_axolotl_sampler),
    "axolotl-pack-group": ("axolotl", "axolotl, pack_group (1 process)", setup_axolotl_pack_group),
    "trl-bfd": ("trl", "trl, bfd (map batches of 1,000)", setup_trl),
    "trl-bfd-one-batch": ("trl", "trl, bfd one batch", setup_trl_one_batch),
    "binpacking": ("binpacking", "binpacking (to_constant_volume)", setup_binpacking),
}


def check_bins(bins: Bins, lengths: np.ndarray, capacity: int) -> tuple[int, int]:
    """Assert a valid packing of all samples; return (bins, real tokens)."""
    offsets, members = (np.asarray(a, dtype=np.int64) for a in bins)
    count = lengths.shape[0]
    assert offsets[0] == 0 and offsets[-1] == members.shape[0] and np.all(np.diff(offsets) > 0), "bad bin offsets"
    assert members.shape[0] == count, f"{members.shape[0]:,} members for {count:,} samples"
    seen = np.bincount(members, minlength=count) if count else np.zeros(0)
    assert seen.shape[0] == count and np.all(seen == 1), "a sample is missing or packed twice"
    tokens = np.add.reduceat(lengths[members].astype(np.int64), offsets[:-1])
    assert int(tokens.max()) <= capacity, f"a bin holds {int(tokens.max())} > {capacity} tokens"
    return int(offsets.shape[0] - 1), int(tokens.sum())


def run_peer(key: str, lengths: np.ndarray, capacity: int, args) -> dict:
    group, label, setup = PEERS[key]
    extra = (args.binpacking_max,) if key == "binpacking" else ()
    row = {"peer": key, "label": label}
    try:
        warm_pack, _ = setup(lengths[:WARMUP_SAMPLES], capacity, *extra)
        warm_pack()  # numba compiles here, and imports and caches settle
        start = time.perf_counter()
        pack, to_bins = setup(lengths, capacity, *extra)
        row["setup_s"] = round(time.perf_counter() - start, 3)
    except Skipped as skipped:
        return {**row, "skipped": str(skipped)}
    times, result = [], None
    for _ in range(args.repeats):
        result = None  # free the last result before the next run
        start = time.perf_counter()
        result = pack()
        times.append(time.perf_counter() - start)
        if times[-1] > NO_REPEAT_SECONDS:
            break
    num_bins, tokens = check_bins(to_bins(result), lengths, capacity)
    return {
        **row,
        "seconds": min(times),
        "runs": len(times),
        "bins": num_bins,
        "efficiency": tokens / (num_bins * capacity),
    }


def load_lengths(args) -> tuple[np.ndarray, str, int]:
    """The lengths every peer packs (int32, clipped to --max-tokens, no zeros), the case's
    name, and how many samples of length 0 were left out."""
    if args.file is None:
        samples = int(args.samples or 1e6)
        lengths, name = lognormal_lengths(samples, args.max_tokens), f"lognormal {samples:.0e}"
    else:
        lengths = pq.read_table(args.file, columns=[args.length_column]).column(0).to_numpy()
        name = args.file.stem
        if args.samples is not None and int(args.samples) < lengths.shape[0]:
            lengths, name = lengths[: int(args.samples)], f"{name}, first {int(args.samples):,}"
    lengths = np.minimum(lengths, args.max_tokens).astype(np.int32)
    empty = int(np.count_nonzero(lengths <= 0))
    return np.ascontiguousarray(lengths[lengths > 0]), name, empty


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for package in ["batchplan", "numpy", "numba", "pyarrow", "torch", "axolotl", "trl", "datasets", "binpacking"]:
        try:
            out[package] = version("batchplan-llm" if package == "batchplan" else package)  # the distribution's name
        except PackageNotFoundError:
            pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=float, help="lognormal samples (default 1e6); with --file, its first rows")
    parser.add_argument("--file", type=Path, help="a Parquet file with a length column instead")
    parser.add_argument("--length-column", default="length")
    parser.add_argument("--max-tokens", type=int, default=8192, help="bin capacity C")
    parser.add_argument(
        "--peers", default=",".join(PEERS), help="comma-separated keys or groups (batchplan, axolotl, trl, binpacking)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per peer (best is reported)")
    parser.add_argument("--binpacking-max", type=float, default=1e5, help="largest size binpacking runs at")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.binpacking_max = int(args.binpacking_max)

    wanted = [w.strip() for w in args.peers.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in PEERS and w not in {g for g, _, _ in PEERS.values()}]
    if unknown:
        parser.error(f"unknown peers {unknown}; choose from {list(PEERS)} or their groups")
    keys = [k for k, (group, _, _) in PEERS.items() if k in wanted or group in wanted]
    if "batchplan-pack" not in keys:
        keys.insert(0, "batchplan-pack")  # the reference of the ratios

    lengths, name, empty = load_lengths(args)
    rows = []
    for key in keys:
        try:
            rows.append(run_peer(key, lengths, args.max_tokens, args))
        except ImportError as error:
            rows.append({"peer": key, "label": PEERS[key][1], "skipped": f"not importable: {error}"})
        if not args.json:
            print(f"  {key}: {rows[-1].get('seconds', rows[-1].get('skipped'))}", file=sys.stderr, flush=True)
    reference = next(r["seconds"] for r in rows if r["peer"] == "batchplan-pack")
    for row in rows:
        if "seconds" in row:
            row["ratio"] = round(row["seconds"] / reference, 2)
            row["seconds"] = round(row["seconds"], 5)
    report = {
        "case": name,
        "samples": int(lengths.shape[0]),
        "empty_left_out": empty,
        "max_tokens": args.max_tokens,
        "tokens": int(lengths.sum(dtype=np.int64)),
        "cpus": os.cpu_count(),
        "versions": versions(),
        "peers": rows,
    }
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"{name}: {report['samples']:,} samples, {report['tokens']:,} tokens, C = {args.max_tokens:,}"
        + (f" ({empty:,} of length 0 left out)" if empty else "")
    )
    print(" ".join(f"{k} {v}" for k, v in report["versions"].items()))
    print(f"{'peer':<42} {'seconds':>9} {'vs pack':>8} {'bins':>11} {'efficiency':>10}  runs")
    for row in rows:
        if "skipped" in row:
            print(f"{row['label']:<42} skipped: {row['skipped']}")
            continue
        print(
            f"{row['label']:<42} {row['seconds']:>9.4f} {row['ratio']:>7.2f}x {row['bins']:>11,} "
            f"{100 * row['efficiency']:>9.3f}%  {row['runs']}"
        )


if __name__ == "__main__":
    main()
