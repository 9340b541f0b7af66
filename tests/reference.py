"""Slow, obviously-correct references for every kernel, and an independent plan checker.

Everything here is plain Python over lists: no numba, no numpy vector tricks, and
nothing imported from ``batchplan.kernels`` or ``batchplan.operations.validate``. The kernels
must agree with these functions exactly (tests/test_kernels.py), and every plan the
planner writes must pass `check_guarantees`, which re-derives DESIGN.md's guarantees
from the Arrow file alone (tests/test_guarantees.py).
"""

from __future__ import annotations

import base64
import json
import os
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

__all__ = [
    "assign_ranks",
    "check_guarantees",
    "cut_padded",
    "gather_segments",
    "shuffle_by_group",
    "sort_within_windows",
    "order_rows",
    "pack_items",
    "pack_segments",
    "ramp_steps",
    "segment_max",
    "segment_sum",
    "sort_by_length_desc",
    "steps_by_tokens",
]


# --------------------------------------------------------------------------- kernels


def sort_by_length_desc(lengths: Sequence[int], order: Sequence[int]) -> list[int]:
    """``order`` sorted longest first; equal lengths keep their order (Python's sort is stable)."""
    return sorted((int(i) for i in order), key=lambda item: -int(lengths[item]))


def pack_items(lengths: Sequence[int], order: Sequence[int], max_tokens: int) -> list[int]:
    """Best-fit decreasing, one open bin at a time, by linear scan.

    Items longest first (ties in ``order``). Each goes to the open bin with the
    smallest residual that still fits it; among bins of that residual, the one that
    reached it most recently (the kernel keeps a LIFO stack per residual). A bin
    whose residual reaches 0 is closed. Bins are numbered in order of creation.
    """
    residual: list[int] = []  # per bin
    reached_at: list[int] = []  # per bin: clock when it got its current residual
    closed: list[bool] = []
    bin_of_item = [-1] * len(lengths)
    clock = 0
    for item in sort_by_length_desc(lengths, order):
        length = int(lengths[item])
        best = -1
        for b in range(len(residual)):
            if closed[b] or residual[b] < length:
                continue
            if (
                best < 0
                or residual[b] < residual[best]
                or (residual[b] == residual[best] and reached_at[b] > reached_at[best])
            ):
                best = b
        if best < 0:
            residual.append(max_tokens)
            reached_at.append(-1)
            closed.append(False)
            best = len(residual) - 1
        bin_of_item[item] = best
        residual[best] -= length
        reached_at[best] = clock
        clock += 1
        closed[best] = residual[best] == 0
    return bin_of_item


def pack_segments(lengths: Sequence[int], order: Sequence[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """`pack_items` as CSR: bins in creation order, each bin's items in placement order."""
    bin_of_item = pack_items(lengths, order, max_tokens)
    num_bins = max(bin_of_item, default=-1) + 1
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for item in sort_by_length_desc(lengths, order):
        bins[bin_of_item[item]].append(item)
    offsets = [0]
    for members in bins:
        offsets.append(offsets[-1] + len(members))
    return offsets, [item for members in bins for item in members]


def shuffle_by_group(
    groups: Sequence[int], num_groups: int, keys: Sequence[int], first: int = 0
) -> tuple[list[int], list[int]]:
    """Items (plus ``first``) ordered by group, each group Fisher-Yates shuffled from the last
    position down, position i swapping with begin + (keys[i] * (i - begin + 1)) >> 32."""
    members: list[list[int]] = [[] for _ in range(num_groups)]
    for item, group in enumerate(groups):
        members[group].append(first + item)
    items: list[int] = []
    start = [0]
    for group in members:
        begin = len(items)
        items += group
        for last in range(len(items) - 1, begin, -1):
            pick = begin + ((int(keys[last]) * (last - begin + 1)) >> 32)
            items[last], items[pick] = items[pick], items[last]
        start.append(len(items))
    return items, start


def order_rows(step_offsets: Sequence[int], rank: Sequence[int], micro: Sequence[int], world_size: int):
    """Rows sorted by (rank, step, micro): for each row, (position, step, rank, micro, num_micro)."""
    keyed = []
    for step in range(len(step_offsets) - 1):
        per_rank = (step_offsets[step + 1] - step_offsets[step]) // world_size
        for p in range(step_offsets[step], step_offsets[step + 1]):
            keyed.append(((rank[p], step, micro[p]), (p, step, rank[p], micro[p], per_rank)))
    return [row for _, row in sorted(keyed)]


def cut_padded(
    lengths: Sequence[int], order: Sequence[int], window: int, max_tokens: int, batch_multiple: int
) -> tuple[list[int], list[int]]:
    """Windows of ``window`` entries in ``order``; each sorted longest first (stable) and cut
    front to back into the largest prefix whose count x longest fits, that count rounded
    down to a multiple of ``batch_multiple`` when it is at least ``batch_multiple``.

    Returns ``(offsets, members)`` as lists.
    """
    order = [int(i) for i in order]
    offsets = [0]
    members: list[int] = []
    for begin in range(0, len(order), window):
        queue = sort_by_length_desc(lengths, order[begin : begin + window])
        while queue:
            longest = int(lengths[queue[0]])
            count = 0
            while count < len(queue) and (count + 1) * longest <= max_tokens:
                count += 1
            if count >= batch_multiple:
                while count % batch_multiple:
                    count -= 1
            members.extend(queue[:count])
            offsets.append(offsets[-1] + count)
            queue = queue[count:]
    return offsets, members


def steps_by_tokens(round_tokens: Sequence[int], target: int) -> list[int]:
    """A step keeps taking the next round while that brings its total strictly closer to
    ``target``; it always takes at least one round. Returns step offsets over rounds."""
    offsets = [0]
    total = 0
    for index, tokens in enumerate(round_tokens):
        tokens = int(tokens)
        step_is_empty = index == offsets[-1]
        if not step_is_empty and not abs(total + tokens - target) < abs(total - target):
            offsets.append(index)
            total = 0
        total += tokens
    if len(round_tokens):
        offsets.append(len(round_tokens))
    return offsets


def ramp_target(done: int, start: float, target: float, ramp_tokens: int) -> float:
    """Tokens wanted for a step after ``done`` tokens: linear from ``start`` to ``target``."""
    return target if done >= ramp_tokens else start + (target - start) * (done / ramp_tokens)


def ramp_steps(
    round_tokens: Sequence[int], tokens_before: int, start: float, target: float, ramp_tokens: int, max_rounds: int
) -> list[int]:
    """Steps for a target that ramps with the tokens done (``tokens_before`` + earlier steps).

    Once ``done >= ramp_tokens`` with ``max_rounds > 0``: exactly ``max_rounds`` rounds per
    step. Otherwise a step keeps taking the next round while that brings its total strictly
    closer to the target of its start, at most ``max_rounds`` (when > 0), at least one.
    """
    steps: list[list[int]] = []
    done = tokens_before
    position = 0
    while position < len(round_tokens):
        goal = ramp_target(done, start, target, ramp_tokens)
        fixed = max_rounds > 0 and done >= ramp_tokens
        step = [int(round_tokens[position])]
        position += 1
        while position < len(round_tokens):
            if max_rounds > 0 and len(step) == max_rounds:
                break
            nxt = int(round_tokens[position])
            if not fixed and not abs(sum(step) + nxt - goal) < abs(sum(step) - goal):
                break
            step.append(nxt)
            position += 1
        steps.append(step)
        done += sum(step)
    offsets = [0]
    for step in steps:
        offsets.append(offsets[-1] + len(step))
    return offsets


def assign_ranks(costs: Sequence[float], step_offsets: Sequence[int], world_size: int) -> tuple[list[int], list[int]]:
    """Per step: micro-batches by decreasing cost (stable), each to the least-loaded rank
    that has fewer than ``count / world_size``; equal loads go to the lowest rank."""
    rank = [-1] * len(costs)
    micro = [-1] * len(costs)
    for step in range(len(step_offsets) - 1):
        begin, end = int(step_offsets[step]), int(step_offsets[step + 1])
        per_rank = (end - begin) // world_size
        load = [0.0] * world_size
        taken = [0] * world_size
        by_cost = sorted(range(begin, end), key=lambda i: -float(costs[i]))
        for item in by_cost:
            open_ranks = [r for r in range(world_size) if taken[r] < per_rank]
            best = min(open_ranks, key=lambda r: (load[r], r))
            rank[item] = best
            micro[item] = taken[best]
            taken[best] += 1
            load[best] += float(costs[item])
    return rank, micro


def sort_within_windows(costs: Sequence[float], window: int) -> list[int]:
    """Positions by decreasing cost inside each window; equal costs keep their order."""
    order: list[int] = []
    for begin in range(0, len(costs), window):
        positions = list(range(begin, min(begin + window, len(costs))))
        order += sorted(positions, key=lambda p: (-costs[p], p))
    return order


def segment_sum(values: Sequence[int], offsets: Sequence[int]) -> list[int]:
    return [sum(int(v) for v in values[offsets[s] : offsets[s + 1]]) for s in range(len(offsets) - 1)]


def segment_max(values: Sequence[int], offsets: Sequence[int]) -> list[int]:
    return [max([0, *(int(v) for v in values[offsets[s] : offsets[s + 1]])]) for s in range(len(offsets) - 1)]


def gather_segments(
    members: Sequence[int], starts: Sequence[int], ends: Sequence[int], order: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Segments ``members[starts[k]:ends[k]]`` for ``k`` in ``order``, concatenated, as CSR."""
    offsets = [0]
    out: list[int] = []
    for k in order:
        out.extend(int(m) for m in members[int(starts[k]) : int(ends[k])])
        offsets.append(len(out))
    return offsets, out


# --------------------------------------------------------------------------- plan checker

REQUIRED_TYPES = {
    "epoch": pa.int32(),
    "step": pa.int64(),
    "rank": pa.int32(),
    "micro": pa.int32(),
    "tokens": pa.int64(),
    "loss_tokens": pa.int64(),
    "step_loss_tokens": pa.int64(),
}
REQUIRED_METADATA = (
    "format_version",
    "num_samples",
    "world_size",
    "max_tokens",
    "mode",
    "epochs",
    "seed",
    "config",
    "lengths_fingerprint",
    "dropped",
)


class _Problems(list):
    def add(self, guarantee: str, message: str) -> None:
        self.append(f"[{guarantee}] {message}")


def check_guarantees(
    plan_file: str | os.PathLike | object,
    lengths: Sequence[int],
    *,
    loss_tokens: Sequence[int] | None = None,
    config: object | None = None,
) -> list[str]:
    """Every broken DESIGN.md guarantee of a plan file, as ``"[guarantee] message"`` lines.

    Reads the Arrow IPC file with pyarrow alone and re-derives each guarantee in plain
    loops: layout (one record batch per (epoch, rank)), equal micro-batch counts per
    step, caps, exact token / loss-token / per-step counts, exactly-once coverage with
    every drop listed under a reason that holds.

    A resharded plan (metadata ``resharded_from``) continues its parent from step
    ``first_step``: epochs before the resumed one hold no rows, steps and
    ``tokens_before_step`` run on from the parent's, and the resumed epoch's coverage
    counts the samples and pieces listed under ``consumed`` (trained on the parent).

    Args:
        plan_file: a path, or an object with a ``path`` attribute (`PlanFile`).
        lengths: the dataset's sample lengths.
        loss_tokens: the loss-token column the plan was built with, if any.
        config: the `PlanConfig` the plan was built with; checked against the metadata.
    """
    path = str(getattr(plan_file, "path", plan_file))
    lengths = [int(x) for x in lengths]
    loss_column = None if loss_tokens is None else [int(x) for x in loss_tokens]
    problems = _Problems()
    with pa.memory_map(path, "r") as source:
        reader = pa.ipc.open_file(source)
        meta = json.loads(reader.schema.metadata[b"batchplan"])
        if not _check_header(reader, meta, lengths, loss_column, config, problems):
            return problems
        _check_drop_lists(meta, lengths, problems)
        step_base = meta.get("first_step", 0)
        tokens_base = meta.get("tokens_before_first_step", 0)
        first_epoch = meta.get("resharded_from", {}).get("epoch", 0)
        for epoch in range(meta["epochs"]):
            batches = [reader.get_batch(epoch * meta["world_size"] + r).to_pydict() for r in range(meta["world_size"])]
            if epoch < first_epoch:  # trained on the parent: nothing left here
                if any(batch["step"] for batch in batches) or meta["steps_per_epoch"][epoch]:
                    problems.add("layout", f"epoch {epoch} was trained on the parent plan but holds rows")
                continue
            trained = _trained_before(meta, epoch, len(lengths))
            checker = _EpochCheck(meta, epoch, batches, lengths, loss_column, step_base, tokens_base, problems)
            checker.trained_before = trained
            checker.run()
            step_base += checker.num_steps
            tokens_base += checker.total_tokens
    return problems


def _check_header(reader, meta, lengths, loss_column, config, problems: _Problems) -> bool:
    for key in REQUIRED_METADATA:
        if key not in meta:
            problems.add("metadata", f"key {key!r} missing")
    for key in ("batchplan", "numpy", "numba"):
        if key not in meta.get("versions", {}):
            problems.add("metadata", f"version of {key} not recorded")
    if problems:
        return False
    cfg = meta["config"]
    for key in ("world_size", "max_tokens", "mode", "epochs", "seed"):
        if meta[key] != cfg[key]:
            problems.add("metadata", f"{key} {meta[key]} differs from the config's {cfg[key]}")
    if config is not None and cfg != config.to_dict():
        problems.add("metadata", f"config {cfg} differs from the build config {config.to_dict()}")
    if meta["num_samples"] != len(lengths):
        problems.add("dataset", f"plan is for {meta['num_samples']} samples, dataset has {len(lengths)}")
    elif meta["lengths_fingerprint"] is not None:
        from batchplan.formats.lengths import fingerprint_lengths  # the fingerprint's one definition

        loss = None if loss_column is None else np.asarray(loss_column)
        found = fingerprint_lengths(np.asarray(lengths, dtype=np.int64), loss)
        if found != meta["lengths_fingerprint"]:
            problems.add("dataset", f"lengths fingerprint {found} is not the plan's {meta['lengths_fingerprint']}")
    for name, kind in REQUIRED_TYPES.items():
        if name not in reader.schema.names or reader.schema.field(name).type != kind:
            problems.add("schema", f"column {name!r} missing or not {kind}")
    samples_type = reader.schema.field("samples").type if "samples" in reader.schema.names else None
    want_index = pa.int32() if len(lengths) < 2**31 else pa.int64()
    if samples_type is None or not pa.types.is_list(samples_type) or samples_type.value_type != want_index:
        problems.add("schema", f"column 'samples' is {samples_type}, expected list<{want_index}>")
    if reader.num_record_batches != meta["epochs"] * meta["world_size"]:
        problems.add("layout", f"{reader.num_record_batches} record batches, expected one per (epoch, rank)")
    return not problems


def _trained_before(meta, epoch: int, num_samples: int) -> tuple[set[int], list[tuple[int, int, int]]]:
    """What the parent trained of ``epoch`` before ``first_step``: samples trained whole
    (bit ``i % 8`` of byte ``i // 8`` of the base64 bitmap) and pieces ``(sample, start, length)``."""
    consumed = meta.get("consumed")
    if not consumed or consumed["epoch"] != epoch:
        return set(), []
    bitmap = base64.b64decode(consumed["samples"])
    whole = {i for i in range(num_samples) if i // 8 < len(bitmap) and bitmap[i // 8] >> (i % 8) & 1}
    return whole, [tuple(piece) for piece in consumed["spans"]]


def _drop_limit(cfg, world_size: int) -> int:
    """Most tokens (whole samples) that drop_last may drop in one epoch: an incomplete step."""
    if cfg["tokens_per_step"] is not None:
        # the partial round, plus a final step that had not reached its target
        return (world_size - 1) * cfg["max_tokens"] + cfg["tokens_per_step"]
    return (world_size * (cfg["micro_batches"] or 1) - 1) * cfg["max_tokens"]


def _check_drop_lists(meta, lengths, problems: _Problems) -> None:
    """Each always-dropped sample is listed under a reason that holds, and each sample that
    a policy must drop is listed."""
    cfg = meta["config"]
    dropped = meta["dropped"]
    for reason in dropped:
        if reason not in ("empty", "oversize", "drop_last", "drop_last_spans"):
            problems.add("dropped", f"unknown drop reason {reason!r}")
    empty = sorted(i for i, n in enumerate(lengths) if n <= 0)
    oversize = sorted(i for i, n in enumerate(lengths) if n > cfg["max_tokens"])
    if empty and not cfg["drop_empty"]:
        problems.add("dropped", f"{len(empty)} empty samples planned without drop_empty")
    if sorted(dropped.get("empty", [])) != (empty if cfg["drop_empty"] else []):
        problems.add("dropped", "the 'empty' list is not exactly the empty samples")
    if oversize and cfg["oversize"] == "error":
        problems.add("dropped", f"{len(oversize)} oversize samples planned under oversize='error'")
    expected_oversize = oversize if cfg["oversize"] == "drop" else []
    if sorted(dropped.get("oversize", [])) != expected_oversize:
        problems.add("dropped", "the 'oversize' list is not exactly the samples above max_tokens")
    if dropped.get("drop_last") and not cfg["drop_last"]:
        problems.add("dropped", "samples listed under drop_last but drop_last is off")


class _EpochCheck:
    """All checks of one epoch, in plain loops over rows and entries."""

    def __init__(self, meta, epoch, batches, lengths, loss_column, step_base, tokens_base, problems):
        self.meta, self.cfg, self.epoch = meta, meta["config"], epoch
        self.batches, self.lengths, self.loss_column = batches, lengths, loss_column
        self.step_base, self.tokens_base, self.problems = step_base, tokens_base, problems
        self.world_size, self.max_tokens, self.mode = meta["world_size"], meta["max_tokens"], meta["mode"]
        self.num_steps = 0
        self.total_tokens = 0
        self.trained_before: tuple[set[int], list[tuple[int, int, int]]] = (set(), [])

    def add(self, guarantee: str, message: str) -> None:
        self.problems.add(guarantee, f"epoch {self.epoch}: {message}")

    def run(self) -> None:
        per_step = self.check_layout()
        if per_step is None:
            return
        self.num_steps = len(per_step)
        step_tokens, step_loss = self.check_rows(per_step)
        self.total_tokens = sum(step_tokens.values())
        self.check_step_sums(step_tokens, step_loss)
        self.check_step_sizes(per_step, step_tokens)
        self.check_seqlen_warmup(step_tokens)
        self.check_coverage()

    def check_layout(self) -> dict[int, int] | None:
        """Rank r's rows of this epoch are its record batch, in (step, micro) order, and
        every rank runs the same number of micro-batches in every step."""
        counts_of_rank = []
        for rank, batch in enumerate(self.batches):
            counts: dict[int, int] = {}
            previous = None
            for row in range(len(batch["step"])):
                if batch["epoch"][row] != self.epoch or batch["rank"][row] != rank:
                    self.add(
                        "layout",
                        f"record batch of rank {rank} holds a row of epoch "
                        f"{batch['epoch'][row]} rank {batch['rank'][row]}",
                    )
                    return None
                step, micro = batch["step"][row], batch["micro"][row]
                if micro != counts.get(step, 0) or (previous is not None and step < previous):
                    self.add("equal_micro_batches", f"rank {rank}: step {step} micro {micro} out of order")
                    return None
                counts[step] = micro + 1
                previous = step
            counts_of_rank.append(counts)
        for rank, counts in enumerate(counts_of_rank):
            if counts != counts_of_rank[0]:
                self.add(
                    "equal_micro_batches",
                    f"rank {rank} runs {counts} micro-batches per step, rank 0 {counts_of_rank[0]}",
                )
                return None
        per_step = counts_of_rank[0]
        expected_steps = list(range(self.step_base, self.step_base + len(per_step)))
        if sorted(per_step) != expected_steps:
            self.add("layout", f"steps {sorted(per_step)} are not {expected_steps[:1]}.. consecutive")
            return None
        num_rows = sum(per_step.values())
        for key, found in (("steps_per_epoch", len(per_step)), ("rows_per_rank", num_rows)):
            if key in self.meta and self.meta[key][self.epoch] != found:
                self.add("metadata", f"{key} says {self.meta[key][self.epoch]}, the rows {found}")
        for rank, batch in enumerate(self.batches):
            for row, step in enumerate(batch["step"]):
                if "num_micro" in batch and batch["num_micro"][row] != per_step[step]:
                    found = batch["num_micro"][row]
                    self.add("equal_micro_batches", f"rank {rank} num_micro {found} != {per_step[step]}")
                    return None
        return per_step

    def entries_of(self, batch, row) -> list[tuple[int, int, int]]:
        """(sample, start, length) of each entry of a row."""
        samples = batch["samples"][row]
        if "starts" in batch:
            return list(zip(samples, batch["starts"][row], batch["lengths"][row]))
        return [(s, 0, self.lengths[s] if 0 <= s < len(self.lengths) else -1) for s in samples]

    def entry_loss(self, sample: int, length: int) -> int:
        if self.loss_column is not None and "starts" not in self.batches[0]:
            return self.loss_column[sample]
        return length - 1

    def check_rows(self, per_step):
        """Caps, exact counts per row; returns per-step token and loss-token sums."""
        step_tokens: dict[int, int] = defaultdict(int)
        step_loss: dict[int, int] = defaultdict(int)
        last_step = self.step_base + len(per_step) - 1
        for rank, batch in enumerate(self.batches):
            for row in range(len(batch["step"])):
                entries = self.entries_of(batch, row)
                where = f"rank {rank} step {batch['step'][row]} micro {batch['micro'][row]}"
                if any(not 0 <= s < len(self.lengths) for s, _, _ in entries):
                    self.add("coverage", f"{where}: a sample index is outside the dataset")
                    continue
                tokens = sum(length for _, _, length in entries)
                longest = max([0] + [length for _, _, length in entries])
                load = tokens if self.mode == "pack" else len(entries) * longest
                if load > self.max_tokens:
                    self.add("max_tokens", f"{where}: {self.mode} load {load} > max_tokens {self.max_tokens}")
                if batch["tokens"][row] != tokens:
                    self.add("counts", f"{where}: tokens {batch['tokens'][row]}, samples hold {tokens}")
                loss = sum(self.entry_loss(s, length) for s, _, length in entries)
                if batch["loss_tokens"][row] != loss:
                    self.add("counts", f"{where}: loss_tokens {batch['loss_tokens'][row]}, samples hold {loss}")
                if "padded_tokens" in batch:
                    padded = tokens if self.mode == "pack" else len(entries) * longest
                    if batch["padded_tokens"][row] != padded:
                        self.add("counts", f"{where}: padded_tokens {batch['padded_tokens'][row]} != {padded}")
                if not entries and (self.cfg["drop_last"] or batch["step"][row] != last_step):
                    self.add("empty_micro_batches", f"{where}: empty micro-batch outside the last step's filler")
                step_tokens[batch["step"][row]] += batch["tokens"][row]
                step_loss[batch["step"][row]] += batch["loss_tokens"][row]
        return step_tokens, step_loss

    def check_step_sums(self, step_tokens, step_loss) -> None:
        """The loss normaliser is the exact sum over all ranks; token offsets run on."""
        before = {}
        running = self.tokens_base
        for step in sorted(step_tokens):
            before[step] = running
            running += step_tokens[step]
        for rank, batch in enumerate(self.batches):
            for row, step in enumerate(batch["step"]):
                if batch["step_loss_tokens"][row] != step_loss[step]:
                    self.add(
                        "loss_normaliser",
                        f"rank {rank} step {step}: step_loss_tokens "
                        f"{batch['step_loss_tokens'][row]}, rows hold {step_loss[step]}",
                    )
                    return
                if "step_tokens" in batch and batch["step_tokens"][row] != step_tokens[step]:
                    self.add("counts", f"rank {rank} step {step}: step_tokens wrong")
                    return
                if "tokens_before_step" in batch and batch["tokens_before_step"][row] != before[step]:
                    found = batch["tokens_before_step"][row]
                    self.add("counts", f"rank {rank} step {step}: tokens_before_step {found} != {before[step]}")
                    return

    def check_step_sizes(self, per_step, step_tokens) -> None:
        """Fixed micro-batches: every step but the epoch's last holds exactly that many per
        rank (all of them with drop_last). Token target: steps land within half a round.
        Ramp-up: the target of a step is linear in the tokens before it, from the ramp's
        start to the full step (with micro-batches: at most that many per rank, exactly
        that many once the ramp is over)."""
        steps = sorted(per_step)
        if self.cfg.get("rampup_start") is not None:
            self.check_ramp_sizes(steps, per_step, step_tokens)
            return
        fixed = self.cfg["micro_batches"] if self.cfg["tokens_per_step"] is None else None
        if self.cfg["tokens_per_step"] is None:
            fixed = 1 if fixed is None else fixed
            for step in steps:
                is_last = step == steps[-1]
                ok = per_step[step] == fixed or (is_last and not self.cfg["drop_last"] and per_step[step] < fixed)
                if not ok:
                    self.add("step_size", f"step {step}: {per_step[step]} micro-batches per rank, expected {fixed}")
            return
        target = self.cfg["tokens_per_step"]
        half_round = self.world_size * self.max_tokens / 2
        for step in steps:
            tokens = step_tokens[step]
            if tokens > target + half_round or (step != steps[-1] and tokens < target - half_round):
                self.add("step_size", f"step {step} holds {tokens} tokens, target {target} +- {half_round}")

    def check_ramp_sizes(self, steps, per_step, step_tokens) -> None:
        start, ramp = self.cfg["rampup_start"], self.cfg["rampup_tokens"]
        fixed = self.cfg["micro_batches"] if self.cfg["tokens_per_step"] is None else None
        round_size = self.world_size * self.max_tokens
        # With micro-batches the full step is the mean of M rounds: at most M x round.
        full = self.cfg["tokens_per_step"] if fixed is None else fixed * round_size
        done = self.tokens_base
        for step in steps:
            tokens = step_tokens[step]
            goal = full if done >= ramp else start + (full - start) * done / ramp
            last = step == steps[-1]
            if fixed is not None and done >= ramp:
                if per_step[step] != fixed and not (last and not self.cfg["drop_last"] and per_step[step] < fixed):
                    self.add(
                        "step_size",
                        f"step {step}: {per_step[step]} micro-batches per rank after the ramp, expected {fixed}",
                    )
            elif fixed is not None and per_step[step] > fixed:
                self.add("step_size", f"step {step}: {per_step[step]} micro-batches per rank, above {fixed}")
            if tokens > goal + round_size / 2 or (fixed is None and not last and tokens < goal - round_size / 2):
                self.add(
                    "step_size",
                    f"step {step} holds {tokens} tokens after {done}, ramp target {goal:.0f} +- {round_size / 2}",
                )
            done += tokens

    def check_seqlen_warmup(self, step_tokens) -> None:
        """Sequence-length warmup: a step that ends after ``t`` tokens of the run holds no
        sequence (sample or piece) longer than ``low + (max_tokens - low) * t // tokens``.
        Not checked on a resharded plan (its rest of a warmup is scheduled anew)."""
        low, span = self.cfg.get("seqlen_warmup_min"), self.cfg.get("seqlen_warmup_tokens")
        if low is None or "resharded_from" in self.meta:
            return
        if "starts" not in self.batches[0]:
            self.add("seqlen_warmup", "a plan with a sequence-length warmup has no spans")
            return
        end_of = {}
        done = self.tokens_base
        for step in sorted(step_tokens):
            done += step_tokens[step]
            end_of[step] = done
        for rank, batch in enumerate(self.batches):
            for row, step in enumerate(batch["step"]):
                t = end_of[step]
                cap = self.max_tokens if t >= span else low + (self.max_tokens - low) * t // span
                longest = max([0] + [length for _, _, length in self.entries_of(batch, row)])
                if longest > cap:
                    self.add(
                        "seqlen_warmup",
                        f"rank {rank} step {step}: a sequence of {longest} tokens, "
                        f"above the warmup cap {cap} after {t} tokens",
                    )
                    return

    def check_coverage(self) -> None:
        """Every sample exactly once (spans: its pieces tile it), except listed drops."""
        dropped = self.meta["dropped"]
        always = set(dropped.get("empty", [])) | set(dropped.get("oversize", []))
        last = set(dropped.get("drop_last", {}).get(str(self.epoch), []))
        if always & last:
            self.add("dropped", "a sample is listed under drop_last and another reason")
        pieces: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for batch in self.batches:
            for row in range(len(batch["step"])):
                for sample, start, length in self.entries_of(batch, row):
                    pieces[sample].append((start, length))
        spans = "starts" in self.batches[0]
        # A resharded plan: what its parent trained of this epoch before first_step counts too.
        whole, trained_pieces = self.trained_before
        for sample in whole:
            want = self.lengths[sample]
            pieces[sample].append((0, min(want, self.max_tokens) if self.cfg["oversize"] == "truncate" else want))
        for sample, start, length in trained_pieces:
            pieces[sample].append((start, length))
        # With spans, drop_last may drop only some pieces of a split sample: the plan lists
        # them as [sample, start, length]; planned plus dropped pieces must tile the sample.
        dropped_pieces: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for sample, start, length in dropped.get("drop_last_spans", {}).get(str(self.epoch), []):
            dropped_pieces[sample].append((start, length))
        if spans and set(dropped_pieces) != last:
            self.add("dropped", "drop_last_spans names other samples than drop_last")
        for sample in range(len(self.lengths)):
            got = sorted(pieces.get(sample, []))
            if sample in always or (sample in last and not spans):
                if got:
                    reason = "drop_last" if sample in last else "empty/oversize"
                    self.add("coverage", f"sample {sample} is listed as dropped ({reason}) but planned: {got}")
                continue
            got = sorted(got + dropped_pieces.get(sample, []))
            if not spans:
                if len(got) != 1:
                    self.add("coverage", f"sample {sample} is planned {len(got)} times")
                continue
            want = self.lengths[sample]
            if self.cfg["oversize"] == "truncate":
                want = min(want, self.max_tokens)
            position = 0
            for start, length in got:
                if start != position or length < 1:
                    break
                position += length
            if position != want or sum(length for _, length in got) != want:
                self.add("coverage", f"sample {sample} of {want} tokens: pieces {got} do not tile it")
        if last:
            self._check_drop_last_size(last)

    def _check_drop_last_size(self, last: set[int]) -> None:
        """drop_last drops only an incomplete final step: fewer micro-batches than one step
        holds, so fewer than that many times max_tokens tokens (whole samples only)."""
        if "starts" in self.batches[0]:
            return
        limit = _drop_limit(self.cfg, self.world_size)
        parent = self.meta.get("resharded_from")
        while parent is not None:  # a resharded plan keeps what each parent dropped
            limit += _drop_limit(parent["config"], parent["world_size"])
            parent = parent.get("resharded_from")
        tokens = sum(self.lengths[s] for s in last)
        if tokens > limit:
            self.add(
                "dropped",
                f"drop_last dropped {len(last)} samples of {tokens} tokens, more than "
                f"an incomplete step holds ({limit})",
            )
