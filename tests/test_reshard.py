"""`batchplan reshard`: the rest of a run re-planned for another world size.

In process, over pack and pad, 2->3, 4->2, 8->1 and 1->8 ranks, split and truncated
samples, drop_last, several epochs, a step inside an epoch and at an epoch boundary:
- what the parent trained before step S, plus what the new plan holds, plus the drops
  it lists, is exactly each epoch's samples (pieces of split samples tile them);
- `check_plan` and the independent `reference.check_guarantees` accept the new plan;
- steps run on from S and ``tokens_before_step`` from the parent's count at S;
- the default step size follows the documented rule; reruns are byte-identical;
- a parent's sampler state at step S loads (any rank), any other is refused.
Then real DDP (gloo on CPU): 2 processes train k steps, the plan is resharded and 3
processes resume from their states; 4 -> 2 likewise.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import reference as ref
import torch
from _ddp_plans import free_port, sample_lengths, write_test_plan
from _ddp_reshard_worker import resume_on, train_until
from _spawn import launch
from conftest import build_and_write
from typer.testing import CliRunner

from batchplan import ConfigError, PlanConfig, PlanMismatchError
from batchplan.formats.bitmap import decode_bitmap, encode_bitmap
from batchplan.formats.opening import open_plan
from batchplan.formats.plan_writer import write_plan
from batchplan.operations.reshard import reshard_plan, reshard_plan_file
from batchplan.operations.reshard_steps import default_step_sizing
from batchplan.operations.validate import check_plan
from batchplan.planning.epochs import build_plan
from batchplan.runtime import PlanSampler
from batchplan.runtime.lr_schedule import token_lr_lambda
from batchplan_cli.main import app


def dataset(num_samples: int = 300, seed: int = 11) -> np.ndarray:
    """1..300 tokens, plus a few samples far above the 256-token cap (split or truncated)."""
    lengths = np.random.default_rng(seed).integers(1, 301, num_samples).astype(np.int32)
    for index, length in ((4, 700), (40, 1000), (99, 513)):
        if index < num_samples:
            lengths[index] = length
    return lengths


# --------------------------------------------------------------------------- helpers


def pieces_by_epoch(plan, keep=lambda step: True) -> dict[int, list[tuple[int, int, int]]]:
    """``(sample, start, length)`` of every entry of the rows whose step passes ``keep``."""
    lengths = None if "starts" in plan.schema.names else LENGTHS_OF[plan.metadata["lengths_fingerprint"]]
    found = defaultdict(list)
    for epoch in range(plan.num_epochs):
        for row in plan.read_epoch(epoch).to_pylist():
            if keep(row["step"]):
                if "starts" in row:
                    spans = zip(row["starts"], row["lengths"])
                else:
                    spans = ((0, lengths[s]) for s in row["samples"])
                found[epoch] += [(s, start, n) for s, (start, n) in zip(row["samples"], spans)]
    return found


def dropped_pieces(plan, epoch: int, lengths) -> list[tuple[int, int, int]]:
    dropped = plan.metadata["dropped"]
    if "starts" in plan.schema.names:
        return [tuple(p) for p in dropped.get("drop_last_spans", {}).get(str(epoch), [])]
    return [(s, 0, int(lengths[s])) for s in dropped.get("drop_last", {}).get(str(epoch), [])]


def assert_exact_cover(lengths, config: PlanConfig, epochs: list[list[tuple[int, int, int]]], always=()) -> None:
    """Each epoch's pieces tile every sample not always dropped exactly once."""
    want = np.minimum(lengths, config.max_tokens) if config.oversize == "truncate" else lengths
    for epoch, pieces in enumerate(epochs):
        by_sample = defaultdict(list)
        for sample, start, length in pieces:
            by_sample[sample].append((start, length))
        assert set(by_sample) == set(range(len(lengths))) - set(always), f"epoch {epoch}: samples missing"
        for sample, spans in by_sample.items():
            position = 0
            for start, length in sorted(spans):
                assert start == position, f"epoch {epoch} sample {sample}: pieces {sorted(spans)}"
                position += length
            assert position == want[sample], f"epoch {epoch} sample {sample}: pieces {sorted(spans)}"


def assert_continues(parent_path, child_path, from_step: int, lengths) -> None:
    """Trained on the parent before ``from_step`` + the child (+ listed drops) = every epoch, exactly."""
    parent, child = open_plan(parent_path), open_plan(child_path)
    before = pieces_by_epoch(parent, lambda step: step < from_step)
    after = pieces_by_epoch(child)
    resumed = child.metadata["resharded_from"]["epoch"]
    epochs = []
    for epoch in range(parent.num_epochs):
        drops = dropped_pieces(parent if epoch < resumed else child, epoch, lengths)
        epochs.append(before[epoch] + after[epoch] + drops)
    dropped = parent.metadata["dropped"]
    assert_exact_cover(
        lengths,
        PlanConfig.from_dict(parent.metadata["config"]),
        epochs,
        dropped.get("empty", []) + dropped.get("oversize", []),
    )


LENGTHS_OF: dict[str, np.ndarray] = {}


@pytest.fixture
def make_parent(tmp_path):
    def _make(lengths=None, name="parent.arrow", **options):
        lengths = dataset() if lengths is None else lengths
        path = tmp_path / name
        build_and_write(lengths, PlanConfig(**options), path)
        LENGTHS_OF[open_plan(path).metadata["lengths_fingerprint"]] = lengths
        return path, lengths

    return _make


def step_at(path, epoch: int, where: str) -> int:
    """A global step of ``epoch``: its first (``"start"``) or one in its middle."""
    meta = open_plan(path).metadata
    first = meta.get("first_step", 0) + sum(meta["steps_per_epoch"][:epoch])
    return first if where == "start" else first + meta["steps_per_epoch"][epoch] // 2


# --------------------------------------------------------------------------- the matrix

CASES = {
    "pack-split-2to3": (dict(mode="pack", world_size=2, epochs=2, micro_batches=2, oversize="split"), 3, 0, "middle"),
    "pad-truncate-4to2": (
        dict(
            mode="pad", max_tokens=512, world_size=4, epochs=2, micro_batches=1, oversize="truncate", shuffle_window=64
        ),
        2,
        1,
        "middle",
    ),
    "pack-droplast-8to1": (
        dict(mode="pack", world_size=8, epochs=2, micro_batches=1, oversize="drop", drop_last=True),
        1,
        1,
        "start",
    ),
    "pad-droplast-tokens-1to8": (
        dict(
            mode="pad", max_tokens=512, world_size=1, epochs=2, tokens_per_step=4096, oversize="split", drop_last=True
        ),
        8,
        0,
        "middle",
    ),
    "pack-split-droplast-2to3-3epochs": (
        dict(mode="pack", world_size=2, epochs=3, micro_batches=3, oversize="split", drop_last=True),
        3,
        1,
        "middle",
    ),
    "pack-cost-4to3": (
        dict(mode="pack", world_size=4, epochs=1, micro_batches=2, oversize="split", hidden_size=64),
        3,
        0,
        "middle",
    ),
    "pad-split-3to2-boundary": (
        dict(mode="pad", max_tokens=512, world_size=3, epochs=2, micro_batches=2, oversize="split", batch_multiple=2),
        2,
        1,
        "start",
    ),
    "pack-empty-1to8-at-start": (
        dict(mode="pack", world_size=1, epochs=2, micro_batches=4, oversize="drop", drop_empty=True),
        8,
        0,
        "start",
    ),
}


def case_lengths(name: str) -> np.ndarray:
    lengths = dataset()
    if "empty" in name:
        lengths[[1, 2, 3]] = 0
    return lengths


@pytest.fixture(params=sorted(CASES))
def resharded(request, make_parent, tmp_path):
    options, new_world, epoch, where = CASES[request.param]
    options = {"max_tokens": 256, "seed": 5, **options}
    parent, lengths = make_parent(case_lengths(request.param), **options)
    from_step = step_at(parent, epoch, where)
    child = tmp_path / "child.arrow"
    reshard_plan_file(parent, child, world_size=new_world, from_step=from_step)
    return parent, child, from_step, lengths


def test_trained_before_plus_the_new_plan_is_every_sample_once_per_epoch(resharded):
    parent, child, from_step, lengths = resharded
    assert_continues(parent, child, from_step, lengths)


def test_validate_and_the_reference_checker_accept_the_new_plan(resharded):
    _, child, _, lengths = resharded
    plan = open_plan(child)
    assert check_plan(plan, lengths) == []
    assert check_plan(plan) == []
    config = PlanConfig.from_dict(plan.metadata["config"])
    assert ref.check_guarantees(plan, lengths, config=config) == []


def test_steps_and_token_counts_run_on_from_the_parent(resharded):
    parent, child, from_step, _ = resharded
    old, new = open_plan(parent), open_plan(child)
    steps = new.read_all().column("step").to_numpy()
    assert new.metadata["first_step"] == from_step
    assert np.array_equal(np.unique(steps), np.arange(from_step, from_step + new.num_steps))
    parent_rows = old.read_all().to_pylist()
    before = next(r["tokens_before_step"] for r in parent_rows if r["step"] == from_step)
    first = [r for r in new.read_all().to_pylist() if r["step"] == from_step]
    if first:  # the resumed epoch's rest may all be dropped by drop_last
        assert all(r["tokens_before_step"] == before for r in first)
    assert new.metadata["tokens_before_first_step"] == before
    resumed = new.metadata["resharded_from"]["epoch"]
    assert all(n == 0 for n in new.metadata["rows_per_rank"][:resumed])
    assert new.metadata["config"]["world_size"] == new.world_size


def test_lineage_names_the_parent_and_the_step(resharded):
    parent, child, from_step, _ = resharded
    old, new = open_plan(parent), open_plan(child)
    lineage = new.metadata["resharded_from"]
    assert lineage["content_hash"] == old.metadata["content_hash"]
    assert lineage["config_fingerprint"] == old.metadata["config_fingerprint"]
    assert lineage["world_size"] == old.world_size and lineage["from_step"] == from_step
    assert new.metadata["dataset"] == old.metadata["dataset"]
    assert new.metadata["lengths_fingerprint"] == old.metadata["lengths_fingerprint"]
    assert new.metadata["num_entries"] == old.metadata["num_entries"]


def test_resharding_again_gives_the_same_bytes(resharded, tmp_path):
    parent, child, from_step, _ = resharded
    again = tmp_path / "again.arrow"
    reshard_plan_file(parent, again, world_size=open_plan(child).world_size, from_step=from_step)
    assert again.read_bytes() == child.read_bytes()


def test_a_loss_tokens_column_keeps_exact_counts(tmp_path):
    lengths = dataset()
    loss_tokens = (lengths // 3).astype(np.int32)
    parent = tmp_path / "parent.arrow"
    build_and_write(
        lengths, PlanConfig(max_tokens=1024, world_size=2, epochs=2, micro_batches=2), parent, loss_tokens=loss_tokens
    )
    child = tmp_path / "child.arrow"
    reshard_plan_file(parent, child, world_size=3, from_step=step_at(parent, 0, "middle"))
    assert check_plan(open_plan(child), lengths, loss_tokens) == []
    assert ref.check_guarantees(child, lengths, loss_tokens=loss_tokens) == []


# --------------------------------------------------------------------------- step size


@pytest.mark.parametrize(
    ("world_size", "micro_batches", "new_world", "expected"),
    [
        (4, 2, 2, 4),  # the same global step: 8 micro-batches
        (2, 2, 4, 1),
        (8, 1, 1, 8),
        (4, 1, 3, 1),  # the nearest whole number per rank: 3 instead of 4
        (2, 1, 8, 1),  # one per rank is the least a step holds
        (3, 3, 2, 5),  # 9 / 2 = 4.5 rounds up
    ],
)
def test_fixed_micro_batches_are_redivided_over_the_new_ranks(
    make_parent, world_size, micro_batches, new_world, expected
):
    parent, _ = make_parent(max_tokens=256, world_size=world_size, micro_batches=micro_batches, oversize="split")
    assert default_step_sizing(open_plan(parent), new_world) == {"micro_batches": expected, "tokens_per_step": None}


def test_a_divisible_step_keeps_its_tokens(make_parent, tmp_path):
    parent, _ = make_parent(max_tokens=256, world_size=4, micro_batches=2, oversize="split", epochs=2)
    child = tmp_path / "child.arrow"
    reshard_plan_file(parent, child, world_size=2, from_step=3)
    old, new = _mean_full_step_tokens(open_plan(parent)), _mean_full_step_tokens(open_plan(child))
    assert abs(new - old) <= 0.02 * old


def _mean_full_step_tokens(plan) -> float:
    tokens = []
    for epoch in range(plan.num_epochs):
        rows = [r for r in plan.read_rank(epoch, 0).to_pylist() if r["micro"] == 0]
        tokens += [r["step_tokens"] for r in rows[:-1]]
    return float(np.mean(tokens))


def test_a_token_target_is_kept_unless_one_micro_batch_per_rank_exceeds_it(make_parent):
    parent, _ = make_parent(max_tokens=256, world_size=2, tokens_per_step=2048, oversize="split")
    plan = open_plan(parent)
    assert default_step_sizing(plan, 3) == {"micro_batches": None, "tokens_per_step": 2048}
    assert default_step_sizing(plan, 16) == {"micro_batches": 1, "tokens_per_step": None}


def test_explicit_sizes_are_used(make_parent, tmp_path):
    parent, lengths = make_parent(max_tokens=256, world_size=2, micro_batches=2, oversize="split")
    for name, size in (("micro_batches", 3), ("tokens_per_step", 3000)):
        child = tmp_path / f"{name}.arrow"
        reshard_plan_file(parent, child, world_size=3, from_step=2, **{name: size})
        config = open_plan(child).metadata["config"]
        assert config[name] == size and config["world_size"] == 3
        assert check_plan(open_plan(child), lengths) == []


# --------------------------------------------------------------------------- chains, bad input, forgeries


def test_a_resharded_plan_can_be_resharded_again(make_parent, tmp_path):
    parent, lengths = make_parent(max_tokens=256, world_size=2, epochs=2, micro_batches=2, oversize="split")
    child, grandchild = tmp_path / "child.arrow", tmp_path / "grandchild.arrow"
    first = step_at(parent, 0, "middle")
    reshard_plan_file(parent, child, world_size=3, from_step=first)
    second = first + 5
    reshard_plan_file(child, grandchild, world_size=2, from_step=second)
    plan = open_plan(grandchild)
    assert check_plan(plan, lengths) == []
    assert ref.check_guarantees(plan, lengths) == []
    grandparent = plan.metadata["resharded_from"]["resharded_from"]
    assert grandparent["content_hash"] == open_plan(parent).metadata["content_hash"]
    before = pieces_by_epoch(open_plan(parent), lambda step: step < first)
    middle = pieces_by_epoch(open_plan(child), lambda step: step < second)
    after = pieces_by_epoch(plan)
    epochs = [before[k] + middle[k] + after[k] for k in range(2)]
    assert_exact_cover(lengths, PlanConfig.from_dict(plan.metadata["config"]), epochs)


@pytest.mark.parametrize("from_step", [-1, "end", "end+1"])
def test_a_step_outside_the_plan_is_a_config_error(make_parent, tmp_path, from_step):
    parent, _ = make_parent(max_tokens=256, world_size=2, oversize="split")
    end = open_plan(parent).num_steps
    step = {"end": end, "end+1": end + 1}.get(from_step, from_step)
    with pytest.raises(ConfigError, match=rf"holds steps 0\.\.{end - 1}"):
        reshard_plan_file(parent, tmp_path / "child.arrow", world_size=3, from_step=step)


def test_a_resharded_plan_holds_only_its_own_steps(make_parent, tmp_path):
    parent, _ = make_parent(max_tokens=256, world_size=2, oversize="split")
    child = tmp_path / "child.arrow"
    reshard_plan_file(parent, child, world_size=3, from_step=10)
    with pytest.raises(ConfigError, match=r"holds steps 10\.\."):
        reshard_plan_file(child, tmp_path / "again.arrow", world_size=2, from_step=9)


def test_bad_options_are_config_errors(make_parent, tmp_path):
    parent, _ = make_parent(max_tokens=256, world_size=2, oversize="split")
    out = tmp_path / "child.arrow"
    with pytest.raises(ConfigError, match="the plan being resharded"):
        reshard_plan_file(parent, parent, world_size=3, from_step=1)
    with pytest.raises(ConfigError, match="`world_size` must be"):
        reshard_plan_file(parent, out, world_size=0, from_step=1)
    with pytest.raises(ConfigError, match="pass only one"):
        reshard_plan_file(parent, out, world_size=3, from_step=1, micro_batches=2, tokens_per_step=4096)
    with pytest.raises(ConfigError, match="smaller than one micro-batch per rank"):
        reshard_plan_file(parent, out, world_size=3, from_step=1, tokens_per_step=100)
    with pytest.raises(ConfigError, match="does not exist"):
        reshard_plan_file(parent, tmp_path / "nope" / "child.arrow", world_size=3, from_step=1)
    assert not out.exists()


def test_drop_last_refuses_to_drop_a_whole_later_epoch(make_parent, tmp_path):
    parent, _ = make_parent(dataset(40), max_tokens=256, world_size=1, epochs=2, drop_last=True, oversize="split")
    with pytest.raises(ConfigError, match="whole epoch would be dropped"):
        reshard_plan_file(parent, tmp_path / "child.arrow", world_size=64, from_step=1)


def test_drop_last_drops_a_resumed_rest_that_fills_no_step(make_parent, tmp_path):
    parent, lengths = make_parent(max_tokens=256, world_size=2, epochs=2, drop_last=True, oversize="split")
    last = open_plan(parent).metadata["steps_per_epoch"][0] - 1  # one micro-batch per rank left
    child = tmp_path / "child.arrow"
    reshard_plan_file(parent, child, world_size=8, from_step=last)
    plan = open_plan(child)
    assert plan.metadata["steps_per_epoch"][0] == 0 and plan.metadata["dropped"]["drop_last"]["0"]
    assert check_plan(plan, lengths) == [] and ref.check_guarantees(plan, lengths) == []
    assert_continues(parent, child, last, lengths)


@pytest.mark.parametrize("forgery", ["forget", "twice"])
def test_validate_catches_a_wrong_consumed_list(make_parent, tmp_path, forgery):
    parent, lengths = make_parent(max_tokens=256, world_size=2, micro_batches=2, oversize="drop")
    resharded = reshard_plan(open_plan(parent), world_size=3, from_step=4)
    consumed = decode_bitmap(resharded.lineage["consumed"]["samples"], len(lengths))
    sample = int(np.flatnonzero(consumed)[0]) if forgery == "forget" else int(np.flatnonzero(~consumed)[-1])
    consumed[sample] = not consumed[sample]
    lineage = {**resharded.lineage, "consumed": {**resharded.lineage["consumed"], "samples": encode_bitmap(consumed)}}
    forged = tmp_path / "forged.arrow"
    write_plan(resharded.plan, forged, lengths_fingerprint=resharded.lengths_fingerprint, lineage=lineage)
    violations = check_plan(open_plan(forged), lengths)
    assert [v.guarantee for v in violations] == ["coverage"]
    assert ref.check_guarantees(forged, lengths) != []


def test_validate_catches_a_consumed_piece_planned_again(make_parent, tmp_path):
    parent, lengths = make_parent(max_tokens=256, world_size=2, micro_batches=2, oversize="split")
    resharded = reshard_plan(open_plan(parent), world_size=3, from_step=4)
    planned = resharded.plan.epochs[0]
    entry = int(planned.members[0])
    piece = [
        int(resharded.plan.entries.sample[entry]),
        int(resharded.plan.entries.start[entry]),
        int(resharded.plan.entries.length[entry]),
    ]
    consumed = resharded.lineage["consumed"]
    lineage = {**resharded.lineage, "consumed": {**consumed, "spans": sorted(consumed["spans"] + [piece])}}
    forged = tmp_path / "forged.arrow"
    write_plan(resharded.plan, forged, lengths_fingerprint=resharded.lengths_fingerprint, lineage=lineage)
    assert "coverage" in {v.guarantee for v in check_plan(open_plan(forged), lengths)}
    assert "coverage" in {v.guarantee for v in check_plan(open_plan(forged))}


def test_validate_catches_rows_in_an_epoch_the_parent_finished_and_a_malformed_lineage(tmp_path):
    lengths = dataset()
    plan = build_plan(lengths, PlanConfig(max_tokens=256, world_size=2, epochs=2, oversize="split"))
    parent = {
        "content_hash": "crc32:00000000",
        "config_fingerprint": "0" * 16,
        "world_size": 2,
        "config": {},
        "from_step": 0,
        "epoch": 1,
        "position": 0,
        "rows_per_rank": [1, 1],
    }
    lineage = {
        "first_step": 0,
        "tokens_before_first_step": 0,
        "resharded_from": parent,
        "consumed": {"epoch": 1, "samples": "", "spans": []},
    }
    forged = tmp_path / "forged.arrow"
    write_plan(plan, forged, lineage=lineage)
    assert any("trained on the parent plan" in v.message for v in check_plan(open_plan(forged), lengths))
    write_plan(plan, forged, lineage={**lineage, "consumed": {"epoch": 1, "samples": "%%", "spans": []}})
    assert any("malformed" in v.message for v in check_plan(open_plan(forged)))


def test_the_bitmap_round_trips_and_is_short():
    mask = np.zeros(1000, dtype=bool)
    assert encode_bitmap(mask) == ""
    mask[[0, 7, 8, 500]] = True
    assert np.array_equal(decode_bitmap(encode_bitmap(mask), 1000), mask)
    assert len(encode_bitmap(mask)) <= 4 * (501 // 8 + 3) // 3 + 4
    with pytest.raises(ValueError):
        decode_bitmap(encode_bitmap(mask), 400)


# --------------------------------------------------------------------------- the sampler


def states_after(path, world_size: int, steps: int) -> list[dict]:
    """Each rank's sampler state after ``steps`` optimizer steps (from the plan's start)."""
    states = []
    for rank in range(world_size):
        sampler = PlanSampler(path, rank=rank, world_size=world_size)
        done = 0
        for _ in range(sampler.num_epochs):
            for rows in sampler:
                done += rows.record.is_last
                if done == steps:
                    break
            if done == steps:
                break
        states.append(sampler.state_dict())
    return states


def records(sampler) -> list[tuple]:
    out = []
    while not sampler.finished:
        out += [(mb.epoch, mb.step, mb.micro, tuple(mb.indices)) for mb in (rows.record for rows in sampler)]
    return out


@pytest.mark.parametrize("where", ["middle", "start"])
def test_a_sampler_resumes_on_the_new_plan_from_any_parent_rank_state(make_parent, tmp_path, where):
    parent, _ = make_parent(max_tokens=256, world_size=2, epochs=2, micro_batches=2, oversize="split")
    from_step = step_at(parent, 1, where)
    child = tmp_path / "child.arrow"
    reshard_plan_file(parent, child, world_size=3, from_step=from_step)
    states = states_after(parent, 2, from_step)
    for rank in range(3):
        fresh = records(PlanSampler(child, rank=rank, world_size=3))
        for state in states:
            sampler = PlanSampler(child, rank=rank, world_size=3)
            sampler.load_state_dict(state)
            assert sampler.epoch == 1
            assert records(sampler) == fresh
            assert fresh[0][1] == from_step


def test_a_state_at_the_end_of_the_previous_epoch_is_at_the_boundary_step(make_parent, tmp_path):
    parent, _ = make_parent(max_tokens=256, world_size=2, epochs=2, micro_batches=2, oversize="split")
    from_step = step_at(parent, 1, "start")
    child = tmp_path / "child.arrow"
    reshard_plan_file(parent, child, world_size=3, from_step=from_step)
    old = PlanSampler(parent, rank=1, world_size=2)
    list(old)  # all of epoch 0, not yet epoch 1
    sampler = PlanSampler(child, rank=0, world_size=3)
    sampler.load_state_dict(old.state_dict())
    assert sampler.epoch == 1 and sampler.position == 0


@pytest.mark.parametrize(("steps", "pattern"), [(5, "before step 6"), (7, "after step 6")])
def test_a_parent_state_at_another_step_is_refused(make_parent, tmp_path, steps, pattern):
    parent, _ = make_parent(max_tokens=256, world_size=2, micro_batches=2, oversize="split")
    child = tmp_path / "child.arrow"
    reshard_plan_file(parent, child, world_size=3, from_step=6)
    sampler = PlanSampler(child, rank=0, world_size=3)
    with pytest.raises(PlanMismatchError, match=f"{pattern}.*reshard the parent again with `from_step`"):
        sampler.load_state_dict(states_after(parent, 2, steps)[0])


def test_a_parent_state_in_the_middle_of_a_step_is_refused(make_parent, tmp_path):
    parent, _ = make_parent(max_tokens=256, world_size=2, micro_batches=2, oversize="split")
    child = tmp_path / "child.arrow"
    reshard_plan_file(parent, child, world_size=3, from_step=6)
    state = states_after(parent, 2, 6)[0]
    state["position"] += 1  # one micro-batch into step 6
    with pytest.raises(PlanMismatchError, match="1 micro-batch.*after step 6"):
        PlanSampler(child, rank=0, world_size=3).load_state_dict(state)


def test_other_states_are_still_refused_strictly(make_parent, tmp_path):
    parent, lengths = make_parent(max_tokens=256, world_size=2, micro_batches=2, oversize="split")
    other, _ = make_parent(
        lengths, name="other.arrow", max_tokens=256, world_size=2, micro_batches=2, oversize="split", seed=9
    )
    child = tmp_path / "child.arrow"
    reshard_plan_file(parent, child, world_size=3, from_step=6)
    sampler = PlanSampler(child, rank=0, world_size=3)
    with pytest.raises(PlanMismatchError, match="resharded from"):
        sampler.load_state_dict(states_after(other, 2, 6)[0])
    state = states_after(parent, 2, 6)[0]
    with pytest.raises(PlanMismatchError, match="world_size 5"):
        sampler.load_state_dict({**state, "world_size": 5})
    with pytest.raises(PlanMismatchError, match="config fingerprint"):
        sampler.load_state_dict({**state, "config_fingerprint": "0" * 16})
    own = PlanSampler(child, rank=2, world_size=3)
    next(iter(own))
    saved = own.state_dict()
    with pytest.raises(PlanMismatchError, match="rank"):
        sampler.load_state_dict(saved)  # a state of the new plan keeps its rank check
    again = PlanSampler(child, rank=2, world_size=3)
    again.load_state_dict(saved)
    assert again.position == 1


def test_the_token_lr_schedule_continues_on_the_new_plan(make_parent, tmp_path):
    parent, _ = make_parent(max_tokens=256, world_size=2, micro_batches=2, oversize="split")
    child = tmp_path / "child.arrow"
    reshard_plan_file(parent, child, world_size=3, from_step=6)
    new = open_plan(child)
    first = next(r for r in new.read_rank(0, 0).to_pylist() if r["step"] == 6)
    total = open_plan(parent).read_all().column("tokens").to_numpy().sum()
    schedule = token_lr_lambda(child, warmup_tokens=int(total), decay="constant")
    assert schedule(6) == pytest.approx((first["tokens_before_step"] + first["step_tokens"]) / total)


def test_token_lr_on_the_new_plan_equals_an_unresharded_run_at_the_same_tokens(make_parent, tmp_path):
    from batchplan.runtime import read_step_tokens
    from batchplan.runtime.lr_schedule import token_lr_factor

    parent, _ = make_parent(max_tokens=256, world_size=2, epochs=2, micro_batches=2, oversize="split")
    child = tmp_path / "child.arrow"
    reshard_plan_file(parent, child, world_size=3, from_step=7)
    before, tokens = read_step_tokens(parent)
    total = int(before[-1] + tokens[-1])
    new_before, new_tokens = read_step_tokens(child)
    assert int(new_before[-1] + new_tokens[-1]) == total  # the decay ends where the whole run ends
    options = {"warmup_tokens": total // 5, "decay": "cosine", "min_lr_ratio": 0.1}
    schedule = token_lr_lambda(child, **options)
    for k in range(new_before.shape[0]):
        done = int(new_before[k] + new_tokens[k])
        assert schedule(7 + k) == pytest.approx(token_lr_factor(done, total_tokens=total, **options))
    assert int(new_before[0]) == int(before[7])  # the new plan starts at the old run's tokens


# --------------------------------------------------------------------------- command line


def test_the_command_writes_a_valid_plan_and_fails_in_one_line(make_parent, tmp_path):
    parent, lengths = make_parent(max_tokens=256, world_size=2, micro_batches=2, oversize="split")
    child = tmp_path / "child.arrow"
    runner = CliRunner()
    result = runner.invoke(app, ["reshard", str(parent), "--world-size", "3", "--from-step", "4", "-o", str(child)])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stdout and "steps 4.. on 3 ranks (was 2)" in result.stdout
    assert check_plan(open_plan(child), lengths) == []
    result = runner.invoke(
        app, ["reshard", str(parent), "--world-size", "3", "--from-step", "9999", "-o", str(tmp_path / "x.arrow")]
    )
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "error: --from-step 9999 is not a step" in result.stderr
    result = runner.invoke(app, ["reshard", str(parent), "--world-size", "3", "--from-step", "4", "-o", str(parent)])
    assert result.exit_code == 1 and "the plan being resharded" in result.stderr


# --------------------------------------------------------------------------- real DDP


@pytest.mark.slow
@pytest.mark.parametrize(
    ("old_world", "new_world", "options", "steps"),
    [
        (2, 3, dict(max_tokens=64, epochs=2, tokens_per_step=400, oversize="split", seed=3), 3),
        (
            4,
            2,
            dict(max_tokens=96, mode="pad", epochs=2, micro_batches=1, oversize="truncate", shuffle_window=8, seed=5),
            9,
        ),
    ],
)
def test_ddp_processes_resume_on_another_world_size(tmp_path, old_world, new_world, options, steps):
    lengths = sample_lengths()
    parent = write_test_plan(tmp_path / "parent.arrow", lengths, world_size=old_world, **options)
    launch(train_until, (old_world, free_port(), str(parent), lengths, steps, str(tmp_path)), world_size=old_world)
    old = [torch.load(tmp_path / f"old{rank}.pt", weights_only=False) for rank in range(old_world)]
    from_step = max(entry[1] for entry in old[0]["seen"]) + 1
    assert from_step == steps
    child = tmp_path / "child.arrow"
    reshard_plan_file(parent, child, world_size=new_world, from_step=from_step)
    torch.save([result["state"] for result in old], tmp_path / "states.pt")
    launch(
        resume_on,
        (new_world, free_port(), str(child), lengths, str(tmp_path / "states.pt"), str(tmp_path)),
        world_size=new_world,
    )
    new = [torch.load(tmp_path / f"new{rank}.pt", weights_only=False) for rank in range(new_world)]
    plan = open_plan(child)
    for rank, result in enumerate(new):  # each rank ran exactly its rows of the new plan
        expected = [
            (epoch, row["step"], row["micro"], tuple(row["samples"]))
            for epoch in range(plan.num_epochs)
            for row in plan.read_rank(epoch, rank).to_pylist()
        ]
        assert [entry[:4] for entry in result["seen"]] == expected
    ran = defaultdict(list)  # epoch -> pieces, over both runs and all ranks
    for result in old + new:
        for epoch, _, _, samples, starts, spans in result["seen"]:
            ran[epoch] += list(zip(samples, starts, spans))
    dropped = [dropped_pieces(plan, epoch, lengths) for epoch in range(plan.num_epochs)]
    assert_exact_cover(
        lengths,
        PlanConfig(**options, world_size=old_world),
        [ran[epoch] + dropped[epoch] for epoch in range(plan.num_epochs)],
    )


# --------------------------------------------------------------------------- balance on real data

DATA_FILES = sorted((Path(__file__).resolve().parent.parent / "data").glob("*.parquet"))


@pytest.mark.slow
@pytest.mark.parametrize("data", DATA_FILES, ids=lambda p: p.stem)
def test_a_resharded_plan_is_balanced_like_a_fresh_build(data, tmp_path):
    from batchplan.operations.build import build_plan_file
    from batchplan.reports.summary import summarize_plan

    max_tokens = 512 if "wikipedia" in data.name else 8192
    base = {"max_tokens": max_tokens, "epochs": 2, "oversize": "split", "hidden_size": 4096}
    over = []
    for world, new_world in ((8, 6), (8, 12), (64, 48)):
        parent = tmp_path / f"{world}.arrow"
        if not parent.exists():
            build_plan_file(data, parent, PlanConfig(world_size=world, **base))
        fresh = tmp_path / f"{new_world}.arrow"
        if not fresh.exists():
            build_plan_file(data, fresh, PlanConfig(world_size=new_world, **base))
        child = tmp_path / f"{world}-{new_world}.arrow"
        reshard_plan_file(parent, child, world_size=new_world, from_step=open_plan(parent).num_steps // 4)
        found = summarize_plan(open_plan(child))["cost_imbalance"]
        bound = max(1.5 * summarize_plan(open_plan(fresh))["cost_imbalance"], 0.005)
        if found > bound:
            over.append((world, new_world, found, bound))
    assert not over, f"cost imbalance above max(1.5 x a fresh build's, 0.5 %): {over}"
