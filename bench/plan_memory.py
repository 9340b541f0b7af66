"""Peak memory of planning one plan (`batchplan.planning.epochs.build_plan`), in a fresh process.

    python -m bench.plan_memory --samples 1e8
    python -m bench.plan_memory --samples 1e7 --breakdown
    python -m bench.plan_memory --samples 1e8 --stages
    python -m bench.plan_memory --samples 1e7 --mode pad --epochs 2

A child process loads the kernels (a build of 5,000 samples), makes the lognormal lengths
(`bench.build.lognormal_lengths`, generated in chunks so that making them peaks at little
more than the lengths themselves), then plans them once with ``PlanConfig(max_tokens,
world_size, epochs)``. Reported: the planner's peak, ``ru_maxrss`` less the resident set
right after the lengths were made (bytes and bytes per sample), the seconds of
`build_plan`, and ``numpy.random.default_rng(0).permutation(N)`` timed in the same process
after it (the ratio). ``--breakdown`` also traces numpy's allocations (numpy reports them to
`tracemalloc`) and records, at each kernel call of the planner (`run_in_parts`, packing,
laying out), the resident set and the numpy arrays alive, by the line that made them;
a thread polling the resident set names the call during which it peaked. Arrays numba
allocates inside kernels are not traced, nor memory the allocator keeps after a free
(arrays under glibc's 32 MiB mmap threshold, so mostly at 10^7 and below): they show as
resident less traced. ``--stages`` records the seconds and resident set at the same calls
without tracing. Neither run's time is reported (the hooks slow it).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np

from bench.build import case_parser, print_row

_CHUNK = 1 << 22  # lengths generated per draw: 32 MiB of float64 at a time
_NUMPY_DOMAIN = np.lib.tracemalloc_domain
_PAGE = 4096


def main() -> None:
    parser = case_parser(__doc__)
    parser.set_defaults(world_size=1024)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--breakdown", action="store_true", help="arrays alive at each kernel call")
    parser.add_argument("--stages", action="store_true", help="seconds and resident set at each kernel call")
    parser.add_argument("--top", type=int, default=8, help="allocation sites listed per call in the breakdown")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    command = [sys.executable, "-m", "bench.plan_memory", "--child", *sys.argv[1:]]
    found = subprocess.run(command, check=True, capture_output=True, text=True)
    result = json.loads(found.stdout.strip().splitlines()[-1])
    breakdown = result.pop("breakdown", None)
    print_row(result, args.json)
    if breakdown is not None and not args.json:
        print_breakdown(breakdown, result["samples"])
    elif breakdown is not None:
        print(json.dumps(breakdown))


def chunked_lognormal(num_samples: int, max_tokens: int, seed: int = 0) -> np.ndarray:
    """`bench.build.lognormal_lengths`, the same values, drawn a chunk at a time; uint16 when
    they fit, as `batchplan.formats.lengths.read_lengths` holds them."""
    rng = np.random.default_rng(seed)
    lengths = np.empty(num_samples, dtype=np.uint16 if max_tokens < 2**16 else np.int32)
    for first in range(0, num_samples, _CHUNK):
        last = min(num_samples, first + _CHUNK)
        drawn = rng.lognormal(mean=np.log(300), sigma=1.0, size=last - first)
        lengths[first:last] = np.clip(drawn, 1, max_tokens)
    return lengths


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE


def measure(args) -> dict:
    """The child: plan once, report the planner's peak and time (and the breakdown)."""
    from batchplan.config import PlanConfig
    from batchplan.planning.epochs import build_plan

    config = PlanConfig(max_tokens=args.max_tokens, mode=args.mode, world_size=args.world_size, epochs=args.epochs)
    build_plan(chunked_lognormal(5000, args.max_tokens), config)  # load the kernels
    num_samples = int(args.samples)
    lengths = chunked_lognormal(num_samples, args.max_tokens)
    gc.collect()
    base = resident_bytes()
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracer = Tracer(base, args.breakdown).start() if args.breakdown or args.stages else None
    start = time.perf_counter()
    plan = build_plan(lengths, config)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    breakdown = None
    if tracer is not None:
        breakdown = tracer.stop(args.top)
        breakdown["plan"] = plan_arrays(plan)
    held = resident_bytes() - base
    del plan
    gc.collect()
    start = time.perf_counter()
    np.random.default_rng(0).permutation(num_samples)
    permutation = time.perf_counter() - start
    result = {
        "samples": num_samples,
        "mode": args.mode,
        "max_tokens": args.max_tokens,
        "world_size": args.world_size,
        "epochs": args.epochs,
        "lengths_gib": round(lengths.nbytes / 2**30, 3),
        "peak_before_plan_gib": round((before_kib * 1024 - base) / 2**30, 3),
        "planner_peak_gib": round(peak / 2**30, 3),
        "planner_peak_bytes_per_sample": round(peak / num_samples, 2),
        "plan_held_bytes_per_sample": round(held / num_samples, 2),
        "build_plan_s": None if tracer else round(seconds, 3),
        "permutation_s": round(permutation, 3),
        "ratio": None if tracer else round(seconds / permutation, 2),
    }
    if breakdown is not None:
        result["breakdown"] = breakdown
    return result


def plan_arrays(plan) -> dict[str, dict[str, int]]:
    """Bytes of each array of the plan: its own view and the block it keeps alive."""
    out = {}
    arrays = {f"entries.{k}": v for k, v in vars(plan.entries).items() if isinstance(v, np.ndarray)}
    for epoch in plan.epochs:
        for name, value in vars(epoch).items():
            if isinstance(value, np.ndarray):
                arrays[f"epoch{epoch.epoch}.{name}"] = value
    for name, value in arrays.items():
        owner = value
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        out[name] = {"dtype": str(value.dtype), "bytes": int(value.nbytes), "block": int(owner.nbytes)}
    return out


class Tracer:
    """Numpy allocations and the resident set at each planner kernel call; the peak's call."""

    HOOKS = {  # names a module does not have are skipped
        "batchplan.planning.bins": ["run_in_parts", "place_slots"],
        "batchplan.planning.schedule": ["run_in_parts", "cut_steps"],
        "batchplan.planning.randomness": ["run_in_parts"],
        "batchplan.planning.forming": ["pack_histogram", "cut_padded"],
        "batchplan.planning.epoch_batches": ["lay_out_segments", "scatter_segments"],
    }

    def __init__(self, base: int, trace: bool) -> None:
        self.base, self.trace, self.label, self.restore = base, trace, "start", []
        self.began = time.perf_counter()
        self.peak, self.peak_label, self.running = 0, "start", True
        self.snapshots: list[tuple[str, float, int, tracemalloc.Snapshot | None]] = []

    def start(self) -> Tracer:
        import importlib

        for module_name, names in self.HOOKS.items():
            module = importlib.import_module(module_name)
            for name in names:
                if hasattr(module, name):
                    original = getattr(module, name)
                    self.restore.append((module, name, original))
                    setattr(module, name, self._wrapped(original))
        if self.trace:
            tracemalloc.start(8)
        self.poller = threading.Thread(target=self._poll, daemon=True)
        self.poller.start()
        return self

    def _wrapped(self, function):
        def call(*args, **kwargs):
            label = getattr(args[0], "__name__", function.__name__) if function.__name__ == "run_in_parts" else None
            label = label or function.__name__
            self._record(f"{label} (in)")
            result = function(*args, **kwargs)
            self._record(f"{label} (out)")
            return result

        return call

    def _record(self, label: str) -> None:
        self.label = label
        resident = resident_bytes() - self.base
        self.peak, self.peak_label = max((self.peak, self.peak_label), (resident, label))
        seconds = time.perf_counter() - self.began
        snapshot = None
        if self.trace:
            snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, _NUMPY_DOMAIN)])
        self.snapshots.append((label, seconds, resident, snapshot))

    def _poll(self) -> None:
        while self.running:
            resident = resident_bytes() - self.base
            if resident > self.peak:
                self.peak, self.peak_label = resident, f"during {self.label}"
            time.sleep(0.001)

    def stop(self, top: int) -> dict:
        self.running = False
        self.poller.join()
        if self.trace:
            tracemalloc.stop()
        for module, name, original in self.restore:
            setattr(module, name, original)
        events = []
        for label, seconds, resident, snapshot in self.snapshots:
            stats = [] if snapshot is None else snapshot.statistics("traceback")
            sites = [(_site(stat.traceback), stat.size) for stat in stats[:top]]
            traced = sum(stat.size for stat in stats)
            events.append({"label": label, "s": seconds, "resident": resident, "traced": traced, "sites": sites})
        return {"peak": self.peak, "peak_during": self.peak_label, "events": events}


def _site(traceback) -> str:
    """The innermost frame of batchplan's own code that is not the allocation helper."""
    for frame in reversed(traceback):  # tracemalloc lists the most recent frame last
        name = frame.filename
        if "batchplan" in name and not name.endswith("buffers.py"):
            return f"{'/'.join(Path(name).parts[-2:])}:{frame.lineno}"
    return f"{Path(traceback[-1].filename).name}:{traceback[-1].lineno}"


def print_breakdown(breakdown: dict, num_samples: int) -> None:
    per = float(num_samples)
    print(f"\npeak (polled) {breakdown['peak'] / per:.2f} B/sample, {breakdown['peak_during']}")
    for event in breakdown["events"]:
        print(
            f"\n{event['s']:7.3f} s  {event['label']}: resident {event['resident'] / per:.2f} B/sample, "
            f"numpy traced {event['traced'] / per:.2f} B/sample"
        )
        for site, size in event["sites"]:
            print(f"    {size / per:7.2f}  {site}")
    print("\nplan arrays (B/sample: the view, the block it keeps alive)")
    for name, info in breakdown["plan"].items():
        print(f"    {info['bytes'] / per:7.2f} {info['block'] / per:7.2f}  {name} ({info['dtype']})")


if __name__ == "__main__":
    main()
