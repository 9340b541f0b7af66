"""Step time of token-only vs. compute balancing, from measured micro-batch times (CPU).

    .venv/bin/python -m bench.balance                  # ~3.5 minutes on a 2-core VM

A synchronous step costs the slowest rank's micro-batch. This benchmark measures
what that costs for plans that differ only in which micro-batches share a step and
which rank runs each one (world size 8, one micro-batch per rank per step, pack
mode, ``oversize="split"``):

1. build (1) random step composition + token LPT (``balance_window=1``,
   ``balance="tokens"``) and (2) token balancing (``balance="tokens"``). Same seed
   and mode give the same packs (micro-batches); only step and rank differ;
2. time forward + backward of every distinct pack with the `TinyGPT` of
   ``bench/train_throughput.py`` (per-sample causal SDPA over ``cu_seq_lens``),
   ``--repeats`` round-robin passes after ``--warmup`` untimed micro-batches, a fixed
   number of threads; a pack's time is the median over the passes;
3. fit ``time = a * tokens + b * sum(L^2)`` over the packs (least squares, no
   intercept): ``b / a`` is the toy's effective attention coefficient, in the unit of
   `batchplan.planning.cost` (``1 / (12 h)`` by the FLOP count), and ``h_fit = round(a / (12 b))``
   the width at which the planner's cost model has that coefficient;
4. build (3) compute balancing with ``hidden_size = h_fit`` and, for reference, (4)
   with ``hidden_size = d_model`` (the FLOP model of the toy); check that all four
   plans hold exactly the same packs; report each plan's step time: the sum over
   steps of the max over ranks of the measured (median, or min over passes), fitted
   (= the cost model at ``h_fit``) or FLOP-model (``h = d_model``, no timing) pack time.

Every plan reuses the same pack times, so timing noise is not a difference between
strategies; but noise still inflates each step's max over ranks, most in a step of
eight near-equal packs, so the measured ratio understates the win of balancing (the
min over passes and the fit are less noisy). Cost: one forward + backward per pack
and pass, 40-200 ms for 4,096 tokens at the defaults: 483 packs x 3 passes ~ 3.5
minutes on one core.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from numpy.typing import NDArray

from batchplan import PlanConfig
from batchplan.plan import Plan
from batchplan.planning.cost import attention_coefficient
from batchplan.planning.epochs import build_plan
from batchplan.runtime import PackCollator, token_loss_sum
from batchplan.toy import TinyGPT
from bench.train_throughput import cpu_name

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 8
STRATEGIES = {  # name: (balance, balance_window or None for the default, label)
    "random": ("tokens", 1, "(1) random steps + token LPT"),
    "tokens": ("tokens", None, "(2) token balancing"),
    "compute": ("compute", None, "(3) compute balancing, h = h_fit"),
    "compute_flop": ("compute", None, "(4) compute balancing, h = d_model"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "sharegpt_dialogues_cl100k.parquet")
    parser.add_argument(
        "--lognormal",
        type=float,
        nargs=2,
        metavar=("MEDIAN", "SIGMA"),
        help="lognormal lengths (10,000 samples) instead of --data",
    )
    parser.add_argument("--samples", type=int, default=600, help="seeded uniform subsample of the lengths (0: all)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="token cap of a micro-batch")
    parser.add_argument("--seed", type=int, default=0, help="plan seed; also picks the subsample and token ids")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=1, help="attention heads (1: head_dim = d_model)")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over all packs")
    parser.add_argument("--warmup", type=int, default=8, help="untimed micro-batches before the passes")
    parser.add_argument(
        "--reference-max-tokens",
        type=int,
        default=8192,
        help="cost-model-only prediction on all lengths at a real model's setting",
    )
    parser.add_argument("--reference-hidden-size", type=int, default=4096)
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    return parser.parse_args()


def load_lengths(args: argparse.Namespace) -> tuple[NDArray[np.int64], NDArray[np.int64], str]:
    """(all lengths, the subsample to time, a description of it)."""
    rng = np.random.default_rng(np.random.SeedSequence([args.seed, 1]))
    if args.lognormal is not None:
        median, sigma = args.lognormal
        lengths = np.maximum(1, np.rint(rng.lognormal(np.log(median), sigma, 10_000))).astype(np.int64)
        name = f"lognormal (median {median:g}, sigma {sigma:g})"
    else:
        lengths = pq.read_table(args.data, columns=["length"]).column("length").to_numpy().astype(np.int64)
        name = args.data.name
    total = lengths.shape[0]
    if not args.samples or args.samples >= total:
        return lengths, lengths, f"{name}, all {total:,} samples"
    subsample = lengths[np.sort(rng.permutation(total)[: args.samples])]
    return lengths, subsample, f"{name}, {args.samples:,} of {total:,} samples (seeded uniform subsample)"


def make_plan(lengths: NDArray[np.int64], max_tokens: int, seed: int, name: str, hidden_size: int | None) -> Plan:
    balance, window, _ = STRATEGIES[name]
    extra = {} if window is None else {"balance_window": window}
    config = PlanConfig(
        max_tokens=max_tokens,
        world_size=WORLD_SIZE,
        seed=seed,
        oversize="split",
        balance=balance,
        hidden_size=hidden_size,
        **extra,
    )
    return build_plan(lengths, config)


def index_packs(plans: dict[str, Plan]) -> tuple[list[tuple[int, ...]], dict[str, NDArray[np.int64]]]:
    """Distinct packs (sorted entry ids), and each plan's rows as pack indices.

    Raises SystemExit unless every plan holds the same multiset of packs.
    """
    keys = {}
    for name, plan in plans.items():
        epoch = plan.epochs[0]
        members, offsets = epoch.members, epoch.offsets
        keys[name] = [tuple(sorted(members[offsets[i] : offsets[i + 1]].tolist())) for i in range(epoch.num_rows)]
    first_name, first = next(iter(keys.items()))
    reference = collections.Counter(first)
    for name, rows in keys.items():
        if collections.Counter(rows) != reference:
            raise SystemExit(
                f"plans {first_name!r} and {name!r} hold different micro-batches; the benchmark times "
                "each pack once and needs plans that differ only in step and rank assignment"
            )
    packs = sorted(reference)
    position = {key: index for index, key in enumerate(packs)}
    return packs, {name: np.array([position[key] for key in rows], dtype=np.int64) for name, rows in keys.items()}


def collate_packs(packs: list[tuple[int, ...]], entry_lengths: NDArray, vocab: int, seed: int) -> list[dict]:
    """One packed batch per pack: random token ids with the entries' lengths."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 2]))
    collator = PackCollator()
    return [collator([rng.integers(0, vocab, int(entry_lengths[e])) for e in pack]) for pack in packs]


def time_packs(model: TinyGPT, batches: list[dict], repeats: int, warmup: int, seed: int) -> NDArray[np.float64]:
    """Seconds of forward + backward, shape (repeats, packs): passes over all packs, each in a new order.

    Passes rather than back-to-back repeats, and a new order each pass, so a burst of
    load on a shared machine hits different packs each time and the median drops it.
    """
    # Warm up on the longest and shortest samples (allocator, both SDPA extremes).
    by_longest = sorted(range(len(batches)), key=lambda i: -int(batches[i]["max_length"]))
    for index in by_longest[: (warmup + 1) // 2] + by_longest[len(by_longest) - warmup // 2 :]:
        run_micro_batch(model, batches[index])
    rng = np.random.default_rng(np.random.SeedSequence([seed, 3]))
    times = np.empty((repeats, len(batches)))
    for repeat in range(repeats):
        started = time.perf_counter()
        for index in rng.permutation(len(batches)):
            times[repeat, index] = run_micro_batch(model, batches[index])
        print(f"pass {repeat + 1}/{repeats}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return times


def run_micro_batch(model: TinyGPT, batch: dict) -> float:
    """Seconds of one forward + backward (the loss of bench/train_throughput.py)."""
    labelled = int((batch["labels"][..., 1:] != -100).sum())
    started = time.perf_counter()
    loss = token_loss_sum(model(**batch), batch) / max(labelled, 1)
    loss.backward()
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return seconds


def pack_features(packs: list[tuple[int, ...]], entry_lengths: NDArray) -> dict[str, NDArray[np.float64]]:
    """Per pack: tokens, sum of squared sample lengths, sample count."""
    lengths = [entry_lengths[list(pack)].astype(np.float64) for pack in packs]
    return {
        "tokens": np.array([x.sum() for x in lengths]),
        "square": np.array([(x**2).sum() for x in lengths]),
        "samples": np.array([x.shape[0] for x in lengths], dtype=np.float64),
    }


def identical_pack_noise(features: dict, seconds: NDArray[np.float64]) -> tuple[float | None, int]:
    """Pooled relative std of the pack times among packs with identical lengths, and how many packs.

    Such packs (e.g. the single full-length pieces of split samples) cost the same by any
    model, so their spread is timing noise: it bounds the R^2 any cost model can reach.
    """
    groups = collections.defaultdict(list)
    for index, key in enumerate(zip(features["tokens"], features["square"])):
        groups[key].append(seconds[index])
    deviations = [np.asarray(g) / np.mean(g) - 1.0 for g in groups.values() if len(g) >= 5]
    if not deviations:
        return None, 0
    pooled = np.concatenate(deviations)
    return float(np.sqrt((pooled**2).mean())), int(pooled.shape[0])


def fit(columns: list[NDArray[np.float64]], seconds: NDArray[np.float64]) -> tuple[NDArray[np.float64], float]:
    """Least-squares coefficients of ``seconds ~ columns`` and R^2 (1 - SS_res / SS_tot, centred)."""
    design = np.stack(columns, axis=1)
    coefficients, *_ = np.linalg.lstsq(design, seconds, rcond=None)
    residual = seconds - design @ coefficients
    return coefficients, float(1.0 - (residual**2).sum() / ((seconds - seconds.mean()) ** 2).sum())


def fit_cost_model(features: dict, seconds: NDArray[np.float64], d_model: int) -> dict:
    """``seconds ~ a tokens + b sum L^2`` (the cost model's form), plus a diagnostic fit."""
    (a, b), r2 = fit([features["tokens"], features["square"]], seconds)
    extended, extended_r2 = fit(
        [np.ones_like(seconds), features["tokens"], features["square"], features["samples"]], seconds
    )
    coefficient = b / a
    return {
        "a_s_per_token": float(a),
        "b_s_per_token2": float(b),
        "coefficient_fit": float(coefficient),
        "coefficient_flop_model": attention_coefficient(d_model),
        "hidden_size_fit": round(1.0 / (12.0 * coefficient)) if coefficient > 0 else None,
        "r2": r2,
        "extended": {  # time ~ c0 + a tokens + b sum L^2 + s samples: what the cost model leaves out
            "intercept_s": float(extended[0]),
            "a_s_per_token": float(extended[1]),
            "b_s_per_token2": float(extended[2]),
            "s_per_sample": float(extended[3]),
            "r2": extended_r2,
        },
    }


def step_seconds(plan: Plan, pack_of_row: NDArray[np.int64], pack_time: NDArray[np.float64]) -> tuple[float, float]:
    """(sum over steps of the max over ranks, the same with the mean: the ideal) of per-pack times."""
    epoch = plan.epochs[0]
    # shape (steps, world_size): each rank's total time in each step
    per_rank = np.zeros((epoch.num_steps, epoch.world_size))
    np.add.at(per_rank, (epoch.step, epoch.rank), pack_time[pack_of_row])
    return float(per_rank.max(axis=1).sum()), float(per_rank.mean(axis=1).sum())


def evaluate(plans: dict, rows: dict, times: NDArray, features: dict, fitted: dict) -> dict:
    """Step times of every plan under the measured, fitted and FLOP-model pack times."""
    sources = {
        "measured": np.median(times, axis=0),
        "measured_min": times.min(axis=0),  # less sensitive to load from other processes
        # = a x the planner's cost at h_fit: the cost model, calibrated by the timings
        "fitted": fitted["a_s_per_token"] * features["tokens"] + fitted["b_s_per_token2"] * features["square"],
        # the cost model from the FLOP count alone (h = d_model), before any timing
        "flop_model": features["tokens"] + fitted["coefficient_flop_model"] * features["square"],
    }
    result = {}
    for name, plan in plans.items():
        entry = {}
        for source, pack_time in sources.items():
            actual, ideal = step_seconds(plan, rows[name], pack_time)
            entry[source] = {"step_sum": actual, "ideal": ideal}
        # The same, pass by pass: how much of a ratio is timing noise.
        entry["measured_per_pass"] = [step_seconds(plan, rows[name], t)[0] for t in times]
        entry["hidden_size"] = plan.config.hidden_size
        entry["balance"] = plan.config.balance
        entry["balance_window"] = plan.config.balance_window
        result[name] = entry
    return result


def predict_reference(lengths: NDArray[np.int64], max_tokens: int, hidden_size: int, seed: int) -> dict:
    """Cost-model step time (no timing) of (1)-(3) on all ``lengths`` at a real model's width."""
    step_sums = {}
    for name in ("random", "tokens", "compute"):
        epoch = make_plan(lengths, max_tokens, seed, name, hidden_size).epochs[0]
        # shape (steps, world_size): each rank's predicted cost in each step
        per_rank = np.zeros((epoch.num_steps, epoch.world_size))
        np.add.at(per_rank, (epoch.step, epoch.rank), epoch.cost)
        step_sums[name] = (float(per_rank.max(axis=1).sum()), float(per_rank.mean(axis=1).sum()))
    return {
        "samples": int(lengths.shape[0]),
        "max_tokens": max_tokens,
        "hidden_size": hidden_size,
        "attention_share_at_cap": attention_coefficient(hidden_size) * max_tokens,
        "vs_tokens": {name: value[0] / step_sums["tokens"][0] for name, value in step_sums.items()},
        "idle": {name: 1.0 - value[1] / value[0] for name, value in step_sums.items()},
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    all_lengths, lengths, source = load_lengths(args)
    plans = {name: make_plan(lengths, args.max_tokens, args.seed, name, None) for name in ("random", "tokens")}
    entry_lengths = plans["random"].entries.length
    packs, _ = index_packs(plans)
    print(f"{len(packs):,} packs, {plans['random'].num_steps} steps; timing ...", file=sys.stderr, flush=True)
    torch.manual_seed(args.seed)
    model = TinyGPT(
        args.vocab,
        d_model=args.d_model,
        num_heads=args.heads,
        num_layers=args.layers,
        max_positions=args.max_tokens,
        attention="documents",
    )
    started = time.perf_counter()
    batches = collate_packs(packs, entry_lengths, args.vocab, args.seed)
    times = time_packs(model, batches, args.repeats, args.warmup, args.seed)
    timing_s = time.perf_counter() - started
    features = pack_features(packs, entry_lengths)
    fitted = fit_cost_model(features, np.median(times, axis=0), args.d_model)
    if fitted["hidden_size_fit"] is None:
        raise SystemExit(
            f"the fitted attention term is not positive (b = {fitted['b_s_per_token2']:.3g} s/token^2): compute "
            "balancing has nothing to balance on; raise --max-tokens or narrow the model"
        )
    plans["compute"] = make_plan(lengths, args.max_tokens, args.seed, "compute", fitted["hidden_size_fit"])
    plans["compute_flop"] = make_plan(lengths, args.max_tokens, args.seed, "compute_flop", args.d_model)
    _, rows = index_packs(plans)  # (3) and (4) must hold the packs that were timed
    report = {
        **describe_run(args, source, lengths, plans["random"], features, times, timing_s),
        "fit": fitted,
        "plans": evaluate(plans, rows, times, features, fitted),
        "reference": predict_reference(all_lengths, args.reference_max_tokens, args.reference_hidden_size, args.seed),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)


def describe_run(args, source: str, lengths, plan: Plan, features: dict, times, timing_s: float) -> dict:
    median = np.median(times, axis=0)
    spread = np.median((times.max(axis=0) - times.min(axis=0)) / median) if times.shape[0] > 1 else 0.0
    return {
        "command": command_line(args),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} after the run",
        "torch": torch.__version__,
        "threads": args.threads,
        "source": source,
        "total_tokens": int(lengths.sum()),
        "max_tokens": args.max_tokens,
        "world_size": WORLD_SIZE,
        "model": {"d_model": args.d_model, "heads": args.heads, "layers": args.layers, "vocab": args.vocab},
        "micro_batches": plan.epochs[0].num_rows,
        "packs": len(features["tokens"]),
        "single_sample_packs": int((features["samples"] == 1).sum()),
        "steps": plan.num_steps,
        "pack_ms": {
            "min": 1e3 * float(median.min()),
            "median": 1e3 * float(np.median(median)),
            "max": 1e3 * float(median.max()),
        },
        "timing_s": timing_s,
        "repeat_spread_median": float(spread),
        "identical_pack_noise": dict(zip(("relative_std", "packs"), identical_pack_noise(features, median))),
    }


def command_line(args: argparse.Namespace) -> str:
    source = (
        f"--lognormal {args.lognormal[0]:g} {args.lognormal[1]:g}"
        if args.lognormal
        else f"--data {os.path.relpath(args.data, ROOT)}"
    )
    return (
        f".venv/bin/python -m bench.balance {source} --samples {args.samples} --max-tokens {args.max_tokens} "
        f"--seed {args.seed} --d-model {args.d_model} --heads {args.heads} --layers {args.layers} "
        f"--vocab {args.vocab} --threads {args.threads} --repeats {args.repeats} --warmup {args.warmup} "
        f"--reference-max-tokens {args.reference_max_tokens} "
        f"--reference-hidden-size {args.reference_hidden_size}"
    )


def print_report(report: dict) -> None:
    model, ms = report["model"], report["pack_ms"]
    print(f"\ncommand: {report['command']}")
    print(f"machine: {report['machine']}, torch {report['torch']}, {report['threads']} thread(s)")
    print(
        f"lengths: {report['source']}, {report['total_tokens']:,} tokens; max_tokens {report['max_tokens']:,}, "
        f"oversize split, world size {report['world_size']}, 1 micro-batch per rank per step"
    )
    print(
        f"model: TinyGPT d_model {model['d_model']}, {model['heads']} head(s), {model['layers']} layer(s), vocab "
        f"{model['vocab']}, float32, per-sample causal SDPA; forward + backward per pack"
    )
    print(
        f"plan: {report['micro_batches']:,} micro-batches in {report['steps']} steps, {report['packs']:,} distinct "
        f"packs ({report['single_sample_packs']} of one sample); pack time {ms['min']:.0f} / {ms['median']:.0f} / "
        f"{ms['max']:.0f} ms (min / median / max); median (max - min) / median over passes "
        f"{report['repeat_spread_median']:.1%}; timing took {report['timing_s']:.0f} s"
    )
    noise = report["identical_pack_noise"]
    if noise["relative_std"] is not None:
        print(
            f"noise: packs of identical lengths ({noise['packs']}) differ by {noise['relative_std']:.1%} (relative "
            "std of the median time): timing noise, which no cost model can explain"
        )
    print_fit(report["fit"], model["d_model"], report["max_tokens"])
    print_table(report["plans"])
    ref = report["reference"]
    print(
        f"\ncost model only, all {ref['samples']:,} samples, max_tokens {ref['max_tokens']:,}, hidden_size "
        f"{ref['hidden_size']:,} (attention share {ref['attention_share_at_cap']:.2f}): step time vs. (2): "
        + ", ".join(f"{STRATEGIES[n][2][:3]} {v:.3f}" for n, v in ref["vs_tokens"].items())
        + "; idle: "
        + ", ".join(f"{STRATEGIES[n][2][:3]} {v:.1%}" for n, v in ref["idle"].items())
    )


def print_fit(fit_: dict, d_model: int, max_tokens: int) -> None:
    ext = fit_["extended"]
    print(
        f"\nfit  time = a tokens + b sum L^2:  a = {fit_['a_s_per_token'] * 1e6:.3f} us/token, "
        f"b = {fit_['b_s_per_token2'] * 1e9:.4f} ns/token^2, R^2 = {fit_['r2']:.4f}"
    )
    print(
        f"     b/a = {fit_['coefficient_fit']:.3e} per token (FLOP model 1/(12 x {d_model}) = "
        f"{fit_['coefficient_flop_model']:.3e}: x{fit_['coefficient_fit'] / fit_['coefficient_flop_model']:.2f}); "
        f"planner hidden_size = round(a / (12 b)) = {fit_['hidden_size_fit']}"
    )
    print(
        f"     attention share of a {max_tokens:,}-token sample (b/a x {max_tokens:,}): "
        f"{fit_['coefficient_fit'] * max_tokens:.2f}"
    )
    print(
        f"     diagnostic: time = {ext['intercept_s'] * 1e3:.2f} ms + {ext['a_s_per_token'] * 1e6:.3f} us/token + "
        f"{ext['b_s_per_token2'] * 1e9:.4f} ns/token^2 + {ext['s_per_sample'] * 1e3:.3f} ms/sample, "
        f"R^2 = {ext['r2']:.4f}"
    )


def print_table(plans: dict) -> None:
    base = plans["tokens"]

    def ratio(entry: dict, source: str) -> str:
        return f"{entry[source]['step_sum'] / base[source]['step_sum']:.3f}"

    def idle(times: dict) -> float:  # share of rank time spent waiting for the slowest rank
        return 1.0 - times["ideal"] / times["step_sum"]

    print(
        "\n| plan | hidden_size | step time, measured | vs. (2) | min of passes vs. (2) | per pass vs. (2) "
        "| fitted vs. (2) | FLOP model vs. (2) | idle, measured | idle, fitted |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, entry in plans.items():
        label = STRATEGIES[name][2] + ("" if entry["balance_window"] == 1 else f", window {entry['balance_window']}")
        measured = entry["measured"]
        per_pass = np.array(entry["measured_per_pass"]) / np.array(base["measured_per_pass"])
        print(
            f"| {label} | {entry['hidden_size'] or '-'} | {measured['step_sum']:.2f} s | {ratio(entry, 'measured')} "
            f"| {ratio(entry, 'measured_min')} | {per_pass.min():.3f}–{per_pass.max():.3f} "
            f"| {ratio(entry, 'fitted')} | {ratio(entry, 'flop_model')} "
            f"| {idle(measured):.1%} | {idle(entry['fitted']):.1%} |"
        )


if __name__ == "__main__":
    main()
