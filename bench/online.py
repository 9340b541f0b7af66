"""`plan_batch` beside verl's and OpenRLHF's micro-batch balancing, on the same batches.

The peers are not dependencies of batchplan. Only their balancing module is imported (pure
Python and torch, on CPU), from the wheels as the package index ships them:

    mkdir -p /tmp/peers && cd /tmp/peers && pip download --no-deps verl openrlhf
    unzip -q -o verl-*.whl -d verl && unzip -q -o openrlhf-*.whl -d openrlhf && cd -
    .venv/bin/python -m bench.online --peers /tmp/peers            # every case, table
    .venv/bin/python -m bench.online --peers /tmp/peers --grpo-seeds 5   # and 4 more GRPO batches
    .venv/bin/python -m bench.online --speed --repeats 15          # 65,536 sequences on 512 ranks, warm
    .venv/bin/python -m bench.online --cold --repeats 5            # first call in a fresh process

``--speed`` times one warm call on one core, each run with the load average before it.
``--cold`` times fresh processes, interleaved: ``python + numpy`` (any numpy program's floor),
numba's own start (its import and first-call set-up, one tiny cached kernel),
``import numpy, batchplan; plan_batch(...)`` on 4,096 sequences for 8 ranks, and the same
after numba's start (what batchplan adds to it) (`cold`).

What each planner does with one global batch (what their trainers run, the ranks' all-reduces
played in one process):

- batchplan: ``plan_batch(lengths, W, max_tokens, attention_coefficient=1/24576)`` (verl's
  workload ``24576 L + L^2``, divided by 24,576); with ``groups`` too for the GRPO case.
- verl 0.9: ``_balance_batch``: ``get_seqlen_balanced_partitions(workload, W, equal_size=True)``
  (Karmarkar-Karp); then on each rank ``rearrange_micro_batches(batch, max_tokens)`` with the
  ranks' micro-batch count synchronised as its ``dp_group`` all-reduce does (the largest count,
  and again while a rank's partition breaks the cap).
- OpenRLHF 0.11: an equal share per rank (``get_seqlen_balanced_partitions(lengths, W,
  equal_size=True)``, the local batch its replay buffer slices), then per rank
  ``get_minimum_num_micro_batch_size`` (first fit), the largest over ranks (its all-reduce),
  and ``get_seqlen_balanced_partitions(lengths, count, equal_size=False)``.

Reported per planner and case: micro-batches over the cap, whether every rank runs the same
count, samples dropped or repeated, empty micro-batches, the busiest rank's cost over the mean
(cost = L + L^2 / 24,576 per sequence), the same in lockstep (sum over micro-batch positions of
the costliest rank's micro-batch, over the mean: FSDP waits at every forward), groups split
over micro-batches (GRPO case), and time: batchplan one call (every rank makes the same call);
a peer, its global balance plus its slowest rank's micro-batching (the ranks run in parallel).
Best of ``--repeats``, planners interleaved (A B A B); the load average is printed beside.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"  # ../shared/data beside the checkout
WORKLOAD = 24576  # verl's calculate_workload: 24576 L + L^2
COEFFICIENT = 1 / WORKLOAD


def load_lengths(name: str) -> np.ndarray:
    return pq.read_table(DATA / f"{name}.parquet", columns=["length"])["length"].to_numpy().astype(np.int64)


def grpo_batch(prompts: int, generations: int, seed: int = 0):
    """A GRPO step: ``prompts`` prompts (ShareGPT segments, at most 2,048 tokens) each with
    ``generations`` responses (ShareGPT dialogues, at most 6,144): sequence = prompt + response."""
    rng = np.random.default_rng(seed)
    prompt = np.minimum(rng.choice(load_lengths("sharegpt_segments_cl100k"), prompts), 2048)
    response = np.minimum(rng.choice(load_lengths("sharegpt_dialogues_cl100k"), prompts * generations), 6144)
    return np.repeat(prompt, generations) + response, np.repeat(np.arange(prompts), generations)


def cases(grpo_seeds: int = 1) -> dict[str, tuple]:
    """name -> (lengths, world_size, max_tokens, groups); GRPO batches drawn with seeds
    ``0..grpo_seeds - 1`` (the first without a seed in its name)."""
    rng = np.random.default_rng(31)
    out = {}
    for seed in range(grpo_seeds):
        grpo, groups = grpo_batch(512, 8, seed=seed)
        drawn = f" (seed {seed})" if seed else ""
        out[f"grpo 512x8{drawn}, 8 ranks"] = (grpo, 8, 16384, groups)
        out[f"grpo 512x8{drawn}, 64 ranks"] = (grpo, 64, 16384, groups)
    return {
        **out,
        # verl #6176: shares needing different counts (a few at the cap, many short)
        "unequal counts": (np.concatenate([np.full(8, 8192), rng.integers(1, 128, 1016)]), 8, 8192, None),
        # verl #6735: balancing on L^2 puts many short sequences beside a long one's cost
        "quadratic over cap": (np.concatenate([np.full(8, 8000), np.full(504, 64)]), 8, 8192, None),
        # OpenRLHF #1296: a batch that does not divide by the ranks
        "not divisible": (rng.integers(100, 4000, 1020), 8, 8192, None),
        # slime #1860: fewer sequences than ranks
        "fewer than ranks": (np.array([4000, 300, 20]), 8, 8192, None),
    }


# ---------------------------------------------------------------- the peers' modules


def find_module(root: Path, package: str) -> Path:
    found = sorted(root.glob(f"**/{package}/utils/seqlen_balancing.py"))
    if not found:
        raise FileNotFoundError(f"no {package}/utils/seqlen_balancing.py under {root}; see this module's docstring")
    return found[0]


def import_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_verl(root: Path) -> types.ModuleType:
    """verl's seqlen_balancing with its three verl imports stood in for (it uses them only to
    slice a TensorDict and name the device)."""
    stubs = {
        "verl": types.ModuleType("verl"),
        "verl.protocol": types.ModuleType("verl.protocol"),
        "verl.utils": types.ModuleType("verl.utils"),
        "verl.utils.tensordict_utils": types.ModuleType("verl.utils.tensordict_utils"),
        "verl.utils.device": types.ModuleType("verl.utils.device"),
    }
    stubs["verl.protocol"].DataProto = object
    stubs["verl.utils.tensordict_utils"].index_select_tensor_dict = lambda batch, indices: indices
    stubs["verl.utils.device"].get_device_name = lambda: "cpu"
    stubs["verl.utils"].tensordict_utils = stubs["verl.utils.tensordict_utils"]
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        return import_file("verl_seqlen_balancing", find_module(root, "verl"))
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


class _Nested:
    """What rearrange_micro_batches reads of ``input_ids``: a nested tensor's offsets."""

    is_nested = True

    def __init__(self, lengths):
        import torch

        self._offsets = torch.tensor(np.concatenate(([0], np.cumsum(lengths))))

    def offsets(self):
        return self._offsets


def run_verl(verl, lengths, world_size, max_tokens):
    """Returns (ranks: list of lists of micro-batches, seconds on the critical path)."""
    import torch

    start = time.perf_counter()
    workload = verl.calculate_workload(torch.tensor(lengths)).tolist()
    shares = verl.get_seqlen_balanced_partitions(workload, k_partitions=world_size, equal_size=True)
    balance_s = time.perf_counter() - start
    batches = [{"input_ids": _Nested(lengths[share])} for share in shares]
    count, slowest = None, 0.0
    while True:  # the dp all-reduce of the count, played out: every rank again at the largest
        counts, ranks, slowest = [], [], 0.0
        for share, batch in zip(shares, batches):
            start = time.perf_counter()
            _, indices = verl.rearrange_micro_batches(batch, max_tokens, min_num_micro_batch=count)
            slowest = max(slowest, time.perf_counter() - start)
            ranks.append([[share[i] for i in micro] for micro in indices])
            counts.append(len(indices))
        if count is not None and max(counts) == count:
            return ranks, balance_s + slowest
        count = max(counts)


def run_openrlhf(openrlhf, lengths, world_size, max_tokens):
    start = time.perf_counter()
    shares = openrlhf.get_seqlen_balanced_partitions(lengths.tolist(), world_size, equal_size=True)
    balance_s = time.perf_counter() - start
    slowest, counts = 0.0, []
    for share in shares:
        start = time.perf_counter()
        counts.append(openrlhf.get_minimum_num_micro_batch_size(lengths[share].tolist(), max_tokens, 1, 1))
        slowest = max(slowest, time.perf_counter() - start)
    count, ranks, rest = max(counts), [], 0.0
    for share in shares:
        start = time.perf_counter()
        parts = openrlhf.get_seqlen_balanced_partitions(lengths[share].tolist(), count, equal_size=False)
        rest = max(rest, time.perf_counter() - start)
        ranks.append([[share[i] for i in part] for part in parts])
    return ranks, balance_s + slowest + rest


def run_batchplan(lengths, world_size, max_tokens, groups=None):
    from batchplan import plan_batch

    start = time.perf_counter()
    plan = plan_batch(lengths, world_size, max_tokens, attention_coefficient=COEFFICIENT, groups=groups)
    seconds = time.perf_counter() - start
    return [[list(micro) for micro in plan.ranks[r]] for r in range(world_size)], seconds


# ---------------------------------------------------------------- judging


def judge(ranks, lengths, max_tokens, groups) -> dict:
    cost = lengths + lengths.astype(np.float64) ** 2 * COEFFICIENT
    counts = [len(rank) for rank in ranks]
    seen = np.bincount(
        np.array([s for rank in ranks for micro in rank for s in micro], dtype=np.int64), minlength=len(lengths)
    )
    over = sum(int(lengths[micro].sum()) > max_tokens for rank in ranks for micro in rank)
    rank_costs = np.array([sum(cost[micro].sum() for micro in rank) for rank in ranks])
    mean = rank_costs.sum() / len(ranks)
    positions = max(counts)
    lockstep = sum(max((cost[rank[m]].sum() if m < len(rank) else 0.0) for rank in ranks) for m in range(positions))
    split_groups = 0
    if groups is not None:
        where = {}
        for r, rank in enumerate(ranks):
            for m, micro in enumerate(rank):
                for s in micro:
                    where.setdefault(groups[s], set()).add((r, m))
        split_groups = sum(len(places) > 1 for places in where.values())
    return {
        "over_cap": int(over),
        "equal_counts": len(set(counts)) == 1,
        "micro_batches": positions,
        "dropped": int((seen == 0).sum()),
        "repeated": int((seen > 1).sum()),
        "empty": sum(len(micro) == 0 for rank in ranks for micro in rank),
        "max_over_mean": float(rank_costs.max() / mean),
        "bound": lower_bound(cost, len(ranks)),
        "lockstep_over_mean": float(lockstep / mean),
        "groups_split": split_groups,
    }


def lower_bound(cost, world_size: int) -> float:
    """No assignment of these sequences has a lower max/mean: the mean, the costliest, and
    two of the ``world_size + 1`` costliest on one rank."""
    mean = cost.sum() / world_size
    largest = -np.sort(-cost)[: world_size + 1]
    bound = max(mean, largest[0], largest[world_size - 1] + largest[world_size] if len(largest) > world_size else 0)
    return float(bound / mean)


def run_case(name, case, planners, repeats: int) -> list[dict]:
    lengths, world_size, max_tokens, groups = case
    rows = {key: {"case": name, "planner": key, "seconds": float("inf")} for key in planners}
    for planner in planners.values():  # untimed: loads numba's kernels, warms Python's caches
        try:
            planner(lengths, world_size, max_tokens, groups)
        except Exception:  # noqa: BLE001 -- reported by the timed runs
            pass
    for _ in range(repeats):  # interleaved: A B A B
        for key, planner in planners.items():
            try:
                ranks, seconds = planner(lengths, world_size, max_tokens, groups)
            except Exception as error:  # noqa: BLE001 -- a peer that fails on a batch is a result
                rows[key]["error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:120]}"
                continue
            rows[key]["seconds"] = min(rows[key]["seconds"], seconds)
            rows[key].update(judge(ranks, lengths, max_tokens, groups))
    return list(rows.values())


def planners_for(peers: Path | None) -> dict:
    planners = {
        "batchplan": lambda lengths, w, cap, groups: run_batchplan(lengths, w, cap),
        "batchplan, groups": lambda lengths, w, cap, groups: run_batchplan(lengths, w, cap, groups),
    }
    if peers is not None:
        verl = import_verl(peers)
        openrlhf = import_file("openrlhf_seqlen_balancing", find_module(peers, "openrlhf"))
        planners["verl"] = lambda lengths, w, cap, groups: run_verl(verl, lengths, w, cap)
        planners["openrlhf"] = lambda lengths, w, cap, groups: run_openrlhf(openrlhf, lengths, w, cap)
    return planners


# ---------------------------------------------------------------- speed


def speed(repeats: int, sequences: int = 65536, world_size: int = 512, max_tokens: int = 16384) -> dict:
    """Warm ``plan_batch`` on one core: GRPO-like lengths, every run with the load average before it."""
    from batchplan import plan_batch

    lengths, _ = grpo_batch(sequences // 8, 8, seed=1)
    plan = plan_batch(lengths, world_size, max_tokens, attention_coefficient=COEFFICIENT)  # loads the kernel
    runs = []
    for _ in range(repeats):
        load = load_average()
        start = time.perf_counter()
        plan = plan_batch(lengths, world_size, max_tokens, attention_coefficient=COEFFICIENT)
        runs.append({"ms": (time.perf_counter() - start) * 1e3, "load": load})
    times = [run["ms"] for run in runs]
    return {
        "sequences": sequences,
        "world_size": world_size,
        "max_tokens": max_tokens,
        "best_ms": min(times),
        "median_ms": float(np.median(times)),
        "num_micro": plan.num_micro,
        "balance": plan.balance,
        "runs": runs,
    }


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


# What each fresh process of `cold` runs: ``{start}``, ``{mark}`` and ``{end}`` read the clock
# (its script's first line, a point between, the end of its work); it prints every reading.
CHILDREN = {
    # the floor of any Python program using numpy
    "python + numpy": "{start}\nimport numpy\n{end}",
    # numba's own start: its import, its typing and target set-up on the first call of a
    # kernel, and one tiny kernel from the cache (what any numba program pays once)
    "python + numpy + numba's start": (
        "{start}\nimport numpy\nfrom batchplan.kernels.startup import start_numba\nstart_numba()\n{end}"
    ),
    # the first plan: what an RL worker spawned for a step pays
    "plan_batch, first call": (
        "{start}\nimport numpy as np\nimport batchplan\nlengths = np.random.default_rng(0).integers(1, 8192, 4096)\n"
        "plan = batchplan.plan_batch(lengths, 8, 16384, hidden_size=4096)\n{end}"
    ),
    # numba's start, then the first plan: the reading between them splits batchplan's own part
    # (its modules, its kernel loaded, numpy.ma that numba imports on a first array, the plan)
    "numba's start, then plan_batch": (
        "{start}\nimport numpy as np\nfrom batchplan.kernels.startup import start_numba\nstart_numba()\n{mark}\n"
        "import batchplan\nlengths = np.random.default_rng(0).integers(1, 8192, 4096)\n"
        "plan = batchplan.plan_batch(lengths, 8, 16384, hidden_size=4096)\n{end}"
    ),
}
START = "import time\nstamps = [time.time()]"
MARK = "stamps.append(time.time())"
END = "stamps.append(time.time())\nprint(*stamps, flush=True)"


def cold(repeats: int) -> dict:
    """Fresh processes, interleaved (each kind once per round), spans of each, best and median:
    ``to_result_s``, from the parent's spawn to the end of the work (interpreter start,
    imports, work); ``script_s``, the script's own (imports, work); ``process_s``, spawn to
    exit (the interpreter's teardown too, ~0.3 s with numba loaded: nothing a worker that goes
    on training waits for); ``after_mark_s``, from the child's middle reading to its end.

    The first round is untimed apart from the plan's, which compiles: numba's cache starts
    empty, in a temporary folder, as does Python's bytecode cache (``PYTHONPYCACHEPREFIX``;
    an installed package ships its bytecode). Later rounds find both filled."""
    out: dict = {"empty_cache_s": None, "rounds": []}
    with tempfile.TemporaryDirectory() as cache:
        env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
        env.update(
            NUMBA_CACHE_DIR=f"{cache}/numba",
            PYTHONPYCACHEPREFIX=f"{cache}/bytecode",
            OMP_NUM_THREADS="1",
            NUMBA_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
        )
        for round_ in range(repeats + 1):
            row = {"load": load_average()}
            for name, code in CHILDREN.items():
                row[name] = run_child(code, env)
            if round_ == 0:
                out["empty_cache_s"] = row["plan_batch, first call"]
            else:
                out["rounds"].append(row)
    out["summary"] = {
        name: {
            key: {
                "best": min(row[name][key] for row in out["rounds"]),
                "median": float(np.median([row[name][key] for row in out["rounds"]])),
            }
            for key in out["rounds"][0][name]
        }
        for name in CHILDREN
    }
    return out


def run_child(code: str, env: dict) -> dict:
    """One fresh process of `cold`: its spans, in seconds."""
    spawned = time.time()
    done = subprocess.run(
        [sys.executable, "-c", code.format(start=START, mark=MARK, end=END)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    exited = time.time()
    stamps = [float(x) for x in done.stdout.split()]
    spans = {"to_result_s": stamps[-1] - spawned, "script_s": stamps[-1] - stamps[0], "process_s": exited - spawned}
    if len(stamps) > 2:
        spans["after_mark_s"] = stamps[-1] - stamps[-2]
    return spans


def print_table(rows: list[dict]) -> None:
    header = (
        "case",
        "planner",
        "over cap",
        "equal counts",
        "micro",
        "dropped",
        "repeated",
        "empty",
        "max/mean",
        "max/mean - 1 (ppb)",
        "bound",
        "lockstep",
        "groups split",
        "ms",
    )
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for row in rows:
        if "over_cap" not in row:
            print(f"{row['case']} | {row['planner']} | fails: {row.get('error', '?')}" + " |" * (len(header) - 3))
            continue
        print(
            f"{row['case']} | {row['planner']} | {row['over_cap']} | {'yes' if row['equal_counts'] else 'NO'} | "
            f"{row['micro_batches']} | {row['dropped']} | {row['repeated']} | {row['empty']} | "
            f"{row['max_over_mean']:.6f} | {(row['max_over_mean'] - 1) * 1e9:,.2f} | {row['bound']:.6f} | "
            f"{row['lockstep_over_mean']:.4f} | "
            f"{row['groups_split']} | {row['seconds'] * 1e3:.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=Path, help="folder with the unpacked verl and openrlhf wheels")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--speed", action="store_true", help="65,536 sequences on 512 ranks, warm")
    parser.add_argument("--cold", action="store_true", help="first call in a fresh process")
    parser.add_argument("--grpo-seeds", type=int, default=1, help="GRPO batches drawn (seeds 0, 1, ...)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    report: dict = {"load_before": Path("/proc/loadavg").read_text().split()[:3]}
    if args.speed:
        report["speed"] = speed(args.repeats)
    elif args.cold:
        report["cold"] = cold(args.repeats)
    else:
        planners = planners_for(args.peers)
        batches = cases(args.grpo_seeds).items()
        report["rows"] = [row for name, case in batches for row in run_case(name, case, planners, args.repeats)]
    report["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    elif "rows" in report:
        print_table(report["rows"])
        print(f"load average before {' '.join(report['load_before'])}, after {' '.join(report['load_after'])}")
    else:
        print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
