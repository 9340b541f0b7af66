"""One epoch planned in-process (no start-up, no file), against the permutation yardstick.

    python -m bench.plan_epoch --samples 1e7
    python -m bench.plan_epoch --file ../shared/data/wikipedia_bert512.parquet --max-tokens 512
    python -m bench.plan_epoch --samples 1e7 --mode pad

Times `batchplan.planning.epochs.plan_epoch` (shuffle, micro-batches, steps, ranks, rows) after a
warm-up on 5,000 samples (the numba kernels loaded), best of --repeats, and
`numpy.random.default_rng(0).permutation(N)` in the same run. What `bench.build` measures
end to end, without the fixed start-up, reading and writing.
"""

from __future__ import annotations

import time

from bench.build import case_parser, lognormal_lengths, print_row, time_permutation


def main() -> None:
    parser = case_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, help="threads splitting the epoch's kernels (default: what a build uses)"
    )
    args = parser.parse_args()

    from batchplan.config import PlanConfig, num_threads
    from batchplan.formats.lengths import read_lengths
    from batchplan.planning.entries import make_entries
    from batchplan.planning.epochs import plan_epoch

    if args.file is None:
        lengths, name = lognormal_lengths(int(args.samples), args.max_tokens), f"lognormal {int(args.samples):.0e}"
    else:
        lengths, name = read_lengths(args.file).lengths, args.file.stem
    config = PlanConfig(max_tokens=args.max_tokens, mode=args.mode, world_size=args.world_size, oversize="truncate")
    entries = make_entries(lengths, config)
    threads = args.threads or num_threads()
    plan_epoch(make_entries(lengths[:5000], config), config, 0, threads=threads)  # load the kernels
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        plan_epoch(entries, config, 0, threads=threads)
        best = min(best, time.perf_counter() - start)
    permutation = time_permutation(lengths.shape[0])
    row = {
        "case": name,
        "samples": int(lengths.shape[0]),
        "mode": args.mode,
        "max_tokens": args.max_tokens,
        "world_size": args.world_size,
        "threads": threads,
        "plan_epoch_s": round(best, 3),
        "permutation_s": round(permutation, 3),
        "ratio": round(best / permutation, 2),
    }
    print_row(row, args.json)


if __name__ == "__main__":
    main()
