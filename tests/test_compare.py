"""`batchplan compare`: every number of the table against a plain-loop recomputation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from batchplan.config import PlanConfig
from batchplan.planning.epochs import build_plan
from batchplan.planning.randomness import epoch_rng
from batchplan.reports.compare import (
    STREAM_FAIRSEQ,
    STREAM_HF,
    STREAM_PYTORCH,
    batch_sorted_greedy,
    compare_strategies,
)
from batchplan_cli.main import app

DATA = Path(__file__).resolve().parent.parent / "data"
DIALOGUES = DATA / "sharegpt_dialogues_cl100k.parquet"
runner = CliRunner()


# ---- the three baselines, written the way their sources write them ----------------


def loop_fixed(num_items, batch_size, rng):
    order = list(rng.permutation(num_items))
    return [order[i : i + batch_size] for i in range(0, num_items, batch_size)]


def loop_hf(lengths, batch_size, rng):
    """transformers.trainer_pt_utils.get_length_grouped_indices, then batches of batch_size."""
    multiple = min(len(lengths) // (batch_size * 4), 50) or 1
    indices = list(rng.permutation(len(lengths)))
    size = multiple * batch_size
    megabatches = [indices[i : i + size] for i in range(0, len(lengths), size)]
    megabatches = [sorted(m, key=lambda i: lengths[i], reverse=True) for m in megabatches]
    top = max(range(len(megabatches)), key=lambda k: (lengths[megabatches[k][0]], -k))
    megabatches[0][0], megabatches[top][0] = megabatches[top][0], megabatches[0][0]
    flat = [i for m in megabatches for i in m]
    return [flat[i : i + batch_size] for i in range(0, len(flat), batch_size)]


def loop_fairseq(lengths, max_tokens, rng):
    """fairseq ordered_indices (stable sort of a permutation) + batch_by_size + shuffled batches."""
    permutation = list(rng.permutation(len(lengths)))
    order = sorted(permutation, key=lambda i: lengths[i])  # Python's sort is stable
    batches, batch, longest = [], [], 0
    for index in order:
        new_longest = max(longest, lengths[index])
        if batch and (len(batch) + 1) * new_longest > max_tokens:
            batches.append(batch)
            batch, new_longest = [], lengths[index]
        batch.append(index)
        longest = new_longest
    if batch:
        batches.append(batch)
    return [batches[k] for k in rng.permutation(len(batches))]


# ---- the metrics, with loops ---------------------------------------------------------


def loop_cost(batch_lengths, mode, coefficient):
    if not batch_lengths:
        return 0.0
    if mode == "pad":
        longest = max(batch_lengths)
        return len(batch_lengths) * (longest + coefficient * longest * longest)
    return sum(length + coefficient * length * length for length in batch_lengths)


def loop_metrics(batches, places, mode, max_tokens, world_size, coefficient):
    """``batches``: lists of lengths; ``places``: (step, rank) of each."""
    num_steps = max(step for step, _ in places) + 1
    tokens = [[0.0] * world_size for _ in range(num_steps)]
    cost = [[0.0] * world_size for _ in range(num_steps)]
    real = computed = 0
    for batch, (step, rank) in zip(batches, places):
        tokens[step][rank] += sum(batch)
        cost[step][rank] += loop_cost(batch, mode, coefficient)
        real += sum(batch)
        computed += len(batch) * max(batch) if (mode == "pad" and batch) else sum(batch)

    def imbalance(per_step):  # over every step but the epoch's last
        values = [max(r) / (sum(r) / world_size) - 1 for r in per_step[:-1] if sum(r) > 0]
        return sum(values) / len(values) if values else None  # nothing to average: n/a

    regular = [batch for batch, (step, _) in zip(batches, places) if step != num_steps - 1]
    return {
        "micro_batches": len(batches),
        "steps": num_steps,
        "padding_fraction": 1 - real / computed,
        "fill": sum(map(sum, regular)) / (len(regular) * max_tokens) if regular else None,
        "token_imbalance": imbalance(tokens),
        "cost_imbalance": imbalance(cost),
        "epoch_cost": sum(max(r) for r in cost),
    }


def round_robin(num_batches, world_size, per_step):
    return [(k // per_step, k % world_size) for k in range(num_batches)]


def plan_batches(lengths, config):
    """Micro-batches of a batchplan plan (epoch 0) as lists of lengths, with (step, rank)."""
    plan = build_plan(np.asarray(lengths), config)
    epoch = plan.epochs[0]
    entry_lengths = plan.entries.length
    batches = [
        [int(entry_lengths[m]) for m in epoch.members[epoch.offsets[i] : epoch.offsets[i + 1]]]
        for i in range(epoch.num_rows)
    ]
    return batches, [(int(s), int(r)) for s, r in zip(epoch.step, epoch.rank)]


@pytest.mark.parametrize(
    ("seed", "num_samples", "max_tokens", "world_size", "micro_batches", "high"),
    [(0, 300, 128, 3, 2, 100), (1, 57, 64, 4, 1, 64), (2, 1000, 512, 8, 3, 300), (3, 5, 50, 8, 1, 50)],
)
def test_table_matches_a_loop_recomputation(seed, num_samples, max_tokens, world_size, micro_batches, high):
    lengths = np.random.default_rng(seed).integers(1, high + 1, num_samples)
    hidden_size = 64  # small, so that the attention term matters
    coefficient = 1 / (12 * hidden_size)
    result = compare_strategies(
        lengths,
        max_tokens=max_tokens,
        world_size=world_size,
        micro_batches=micro_batches,
        hidden_size=hidden_size,
        seed=seed,
    )
    values = [int(v) for v in lengths]
    batch_size = max(1, max_tokens // max(values))
    assert result.baseline_batch_size == batch_size and result.longest == max(values)
    per_step = world_size * micro_batches
    baselines = {
        "pytorch": loop_fixed(len(values), batch_size, epoch_rng(seed, 0, STREAM_PYTORCH)),
        "hf_grouped": loop_hf(values, batch_size, epoch_rng(seed, 0, STREAM_HF)),
        "fairseq": loop_fairseq(values, max_tokens, epoch_rng(seed, 0, STREAM_FAIRSEQ)),
    }
    expected = {}
    for name, batches in baselines.items():
        assert sorted(i for b in batches for i in b) == list(range(len(values)))  # each sample once
        as_lengths = [[values[i] for i in b] for b in batches]
        assert all(len(b) * max(b) <= max_tokens for b in as_lengths)  # same memory
        places = round_robin(len(batches), world_size, per_step)
        expected[name] = loop_metrics(as_lengths, places, "pad", max_tokens, world_size, coefficient)
    for mode in ("pad", "pack"):
        config = PlanConfig(
            max_tokens=max_tokens,
            mode=mode,
            world_size=world_size,
            micro_batches=micro_batches,
            seed=seed,
            oversize="truncate",
            hidden_size=hidden_size,
        )
        batches, places = plan_batches(values, config)
        expected[f"batchplan_{mode}"] = loop_metrics(batches, places, mode, max_tokens, world_size, coefficient)

    assert [row.name for row in result.strategies] == list(expected)
    for row in result.strategies:
        want = expected[row.name]
        for key, value in want.items():
            found = getattr(row, key)
            if value is None:  # nothing to average: n/a, not 0
                assert found is None, (row.name, key)
            else:
                assert found == pytest.approx(value, rel=1e-12, abs=1e-12), (row.name, key)
        assert row.relative_time == pytest.approx(want["epoch_cost"] / expected["pytorch"]["epoch_cost"])
    assert result.strategies[0].relative_time == 1.0


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=120),
    max_tokens=st.integers(40, 160),
    seed=st.integers(0, 3),
)
def test_sorted_greedy_is_fairseqs_loop(lengths, max_tokens, seed):
    """The run-length version equals the item-by-item loop, including lengths == max_tokens."""
    offsets, members = batch_sorted_greedy(np.array(lengths), max_tokens, epoch_rng(seed, 0, 9))
    found = [members[offsets[i] : offsets[i + 1]].tolist() for i in range(offsets.shape[0] - 1)]
    assert found == loop_fairseq(lengths, max_tokens, epoch_rng(seed, 0, 9))


def test_oversize_samples_are_truncated_by_default_and_counted():
    lengths = np.array([10, 500, 20, 30, 1000, 5] * 20)
    result = compare_strategies(lengths, max_tokens=100, world_size=2)
    assert result.oversize == "truncate" and result.oversize_samples == 40
    assert result.num_entries == lengths.size and result.longest == 100
    assert result.baseline_batch_size == 1
    dropped = compare_strategies(lengths, max_tokens=100, world_size=2, oversize="drop")
    assert dropped.dropped_samples == 40 and dropped.num_entries == 80


def test_bad_hidden_size_is_a_config_error():
    from batchplan.errors import ConfigError

    with pytest.raises(ConfigError, match="`hidden_size`"):
        compare_strategies(np.array([5, 6]), max_tokens=16, world_size=1, hidden_size=0)


def test_cli_table_json_and_plot(tmp_path):
    args = ["compare", str(DIALOGUES), "--max-tokens", "8192", "--world-size", "8"]
    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.output
    text = " ".join(table.stdout.split())
    for expected in (
        "PyTorch",
        "HF grouped",
        "fairseq",
        "batchplan pad",
        "batchplan pack",
        "Same memory",
        "--oversize truncate",
        "h = 4,096 (default",
    ):
        assert expected in text
    result = runner.invoke(app, [*args, "--json", "--hidden-size", "2048", "--plot", str(tmp_path / "c.png")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["hidden_size"] == 2048 and data["num_samples"] == 9457 and data["oversize_samples"] > 0
    rows = {row["name"]: row for row in data["strategies"]}
    assert list(rows) == ["pytorch", "hf_grouped", "fairseq", "batchplan_pad", "batchplan_pack"]
    assert rows["pytorch"]["relative_time"] == 1.0
    assert rows["batchplan_pack"]["fill"] > 0.99 and rows["batchplan_pack"]["relative_time"] < 1.0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_one_step_shows_n_a_in_the_table_json_and_plot(tmp_path):
    """Five samples on eight ranks: one step, the epoch's last: fill and imbalance have nothing
    to average, so they are n/a (null), not 0 %, and the figure still draws."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"length": [3, 4, 5, 6, 7]}), tmp_path / "tiny.parquet")
    args = ["compare", str(tmp_path / "tiny.parquet"), "--max-tokens", "50", "--world-size", "8"]
    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.output
    assert "n/a" in table.stdout and "0.00%   n/a" in table.stdout
    result = runner.invoke(app, [*args, "--json", "--plot", str(tmp_path / "c.png")])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["strategies"]
    assert all(row["fill"] is None and row["token_imbalance"] is None for row in rows)
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--hidden-size", "0"], "--hidden-size must be a positive integer, got 0"),
        (["--oversize", "error"], "samples are longer than max_tokens 8,192"),
        (["--micro-batches", "0"], "--micro-batches must be >= 1, got 0"),
    ],
)
def test_cli_bad_options_are_one_line(extra, message):
    result = runner.invoke(app, ["compare", str(DIALOGUES), "--max-tokens", "8192", "--world-size", "8", *extra])
    assert result.exit_code == 1
    assert message in " ".join(result.stderr.split())
    assert "Traceback" not in result.output
