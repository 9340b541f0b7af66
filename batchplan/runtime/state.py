"""The sampler's checkpoint: a small, versioned dict, checked strictly on load.

It holds where this rank is (epoch, micro-batches consumed) and what it is a
position *in*: the plan's content hash, its `plan_identity` and config fingerprint,
the rank and the world size. Loading it into a sampler of another plan, rank or
world size is a `PlanMismatchError` that names both values: a silent resume on the
wrong plan would train on the wrong data without any visible symptom. About 330 bytes.

A plan built as a file and as a directory has the same rows but not the same content
hash (a file's covers its rows, a directory's its manifest): the plan identity, a
hash of the plan's metadata less what only the layout holds, is the same for both,
so a state of one layout resumes on the other. A state without it (saved by an
earlier batchplan) is matched by content hash alone.

One exception: a plan made by ``batchplan reshard`` continues its parent from a step
``S`` on another world size, so it accepts a state of its parent (any rank) taken
exactly at the start of step ``S``, and resumes at its own start.
"""

from __future__ import annotations

import hashlib
from typing import Any

from batchplan.errors import PlanFormatError, PlanMismatchError
from batchplan.formats.plan_format import dump_json

__all__ = ["LAYOUT_KEYS", "STATE_KIND", "STATE_VERSION", "check_state", "make_identity", "make_state", "plan_identity"]

STATE_KIND = "batchplan.PlanSampler"
STATE_VERSION = 1
_KEYS = {"kind", "version", "content_hash", "config_fingerprint", "world_size", "rank", "epoch", "position"}
_OPTIONAL_KEYS = {"plan"}
# Metadata keys that differ between a plan file and a plan directory of the same plan.
LAYOUT_KEYS = frozenset({"content_hash", "layout", "plan", "epoch_files"})


def plan_identity(metadata: dict[str, Any]) -> str:
    """SHA-256 (16 hex) of a plan's metadata less `LAYOUT_KEYS`: the same for a plan's file and
    directory, different for another config, dataset, lineage or batchplan version."""
    content = {key: value for key, value in metadata.items() if key not in LAYOUT_KEYS}
    return hashlib.sha256(dump_json(content)).hexdigest()[:16]


def make_identity(metadata: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """What a sampler's state is a position in: the plan, its config, the rank and world size."""
    return {
        "content_hash": metadata.get("content_hash"),
        "plan": plan_identity(metadata),
        "config_fingerprint": metadata.get("config_fingerprint"),
        "world_size": world_size,
        "rank": rank,
    }


def make_state(identity: dict[str, Any], epoch: int, position: int) -> dict[str, Any]:
    """The state dict of a sampler at ``position`` micro-batches into ``epoch``."""
    return {"kind": STATE_KIND, "version": STATE_VERSION, **identity, "epoch": epoch, "position": position}


def check_state(
    state: dict[str, Any],
    identity: dict[str, Any],
    rows_per_epoch: list[int],
    parent: dict[str, Any] | None = None,
) -> tuple[int, int]:
    """Validate ``state`` against this sampler's identity; return ``(epoch, position)``.

    Args:
        state: a dict made by `make_state` (possibly after a round trip through
            ``torch.save``/``torch.load``).
        identity: this sampler's `make_identity`.
        rows_per_epoch: this rank's micro-batch count in each epoch.
        parent: the plan's ``resharded_from`` metadata, for a resharded plan.

    Raises:
        PlanFormatError: not a PlanSampler state, a newer version, or missing keys.
        PlanMismatchError: another plan, rank or world size; an impossible position;
            a parent's state not taken at the step the plan was resharded from.
    """
    _check_shape(state)
    same_plan = state["content_hash"] == identity["content_hash"] or state.get("plan") == identity["plan"]
    if parent is not None and not same_plan:
        if state["content_hash"] == parent.get("content_hash"):
            return _check_parent_state(state, parent)
        raise PlanMismatchError(
            f"sampler state was saved for a plan with content hash {state['content_hash']!r} but this "
            f"sampler's plan has {identity['content_hash']!r} and was resharded from {parent.get('content_hash')!r}; "
            "give it a state of this plan or of the plan it was resharded from"
        )
    if not same_plan:
        raise PlanMismatchError(
            f"sampler state was saved for a plan with content hash {state['content_hash']!r} (plan identity "
            f"{state.get('plan')!r}) but this sampler has a plan with content hash {identity['content_hash']!r} "
            f"(plan identity {identity['plan']!r}); resume with the plan the run started with (its file or "
            "its directory)"
        )
    for key, what, fix in (
        ("config_fingerprint", "a plan with config fingerprint", "resume with the plan file the run started with"),
        ("world_size", "world_size", "resume with the world size the run started with"),
        ("rank", "rank", "give each rank the state its own sampler saved"),
    ):
        if state[key] != identity[key]:
            raise PlanMismatchError(
                f"sampler state was saved for {what} {state[key]!r} but this sampler has "
                f"{what} {identity[key]!r}; {fix}"
            )
    epoch, position = state["epoch"], state["position"]
    if not (isinstance(epoch, int) and 0 <= epoch < len(rows_per_epoch)):
        raise PlanMismatchError(
            f"sampler state is at epoch {epoch!r} but the plan has epochs 0..{len(rows_per_epoch) - 1}; "
            "the state does not belong to this plan"
        )
    if not (isinstance(position, int) and 0 <= position <= rows_per_epoch[epoch]):
        raise PlanMismatchError(
            f"sampler state is at micro-batch {position!r} of epoch {epoch} but this rank has "
            f"{rows_per_epoch[epoch]} there; the state does not belong to this plan"
        )
    return epoch, position


def _check_parent_state(state: dict[str, Any], parent: dict[str, Any]) -> tuple[int, int]:
    """A state of the plan this one was resharded from: accepted when it is exactly at the
    start of the step the reshard began at; the resume starts at this plan's beginning."""
    needed = {"config_fingerprint", "world_size", "rows_per_rank", "epoch", "position", "from_step"}
    missing = sorted(needed - set(parent))
    if missing:
        raise PlanFormatError(f"the plan's resharded_from metadata lacks {missing}; the plan is corrupt, reshard again")
    for key, what in (("config_fingerprint", "config fingerprint"), ("world_size", "world_size")):
        if state[key] != parent[key]:
            raise PlanMismatchError(
                f"sampler state was saved for {what} {state[key]!r} but the plan this one was resharded "
                f"from has {what} {parent[key]!r}; the state does not belong to that plan"
            )
    rows = parent["rows_per_rank"]
    epoch, position = state["epoch"], state["position"]
    if not (
        isinstance(epoch, int) and 0 <= epoch < len(rows) and isinstance(position, int) and 0 <= position <= rows[epoch]
    ):
        raise PlanMismatchError(
            f"sampler state is at micro-batch {position!r} of epoch {epoch!r}, which the plan it was "
            "saved on does not have; the state is corrupt"
        )
    # Per rank, micro-batches done since the parent's first row: equal at the same point.
    done = sum(rows[:epoch]) + position
    wanted = sum(rows[: parent["epoch"]]) + parent["position"]
    if done != wanted:
        where = "before" if done < wanted else "after"
        raise PlanMismatchError(
            f"sampler state is at micro-batch {position} of epoch {epoch} of the parent plan, "
            f"{abs(done - wanted):,} micro-batch(es) per rank {where} step {parent['from_step']:,}, where this "
            f"plan was resharded from (micro-batch {parent['position']} of epoch {parent['epoch']}); "
            "reshard the parent again with `from_step` set to the optimizer steps done when the state was "
            "saved (save states right after an optimizer step)"
        )
    return parent["epoch"], 0


def _check_shape(state: Any) -> None:
    if not isinstance(state, dict) or state.get("kind") != STATE_KIND:
        kind = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise PlanFormatError(
            f"expected a {STATE_KIND} state dict, got {kind!r}; pass what PlanSampler.state_dict returned"
        )
    version = state.get("version")
    if not isinstance(version, int) or version > STATE_VERSION:
        raise PlanFormatError(
            f"sampler state version {version!r} is newer than this batchplan reads ({STATE_VERSION}); upgrade batchplan"
        )
    missing = sorted(_KEYS - set(state))
    unknown = sorted(set(state) - _KEYS - _OPTIONAL_KEYS)
    if missing or unknown:
        raise PlanFormatError(
            f"sampler state has missing keys {missing} and unknown keys {unknown}; "
            "pass what PlanSampler.state_dict returned, unmodified"
        )
