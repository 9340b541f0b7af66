"""The sampler's checkpoint: a small, versioned dict, checked strictly on load.

It holds where this rank is (epoch, micro-batches consumed) and what it is a
position *in*: the plan's content hash and config fingerprint, the rank and the
world size. Loading it into a sampler of another plan, rank or world size is a
`PlanMismatchError` that names both values: a silent resume on the wrong plan
would train on the wrong data without any visible symptom. About 300 bytes.
"""

from __future__ import annotations

from typing import Any

from batchplan.errors import PlanFormatError, PlanMismatchError

__all__ = ["STATE_KIND", "STATE_VERSION", "check_state", "make_state"]

STATE_KIND = "batchplan.PlanSampler"
STATE_VERSION = 1
_KEYS = {"kind", "version", "content_hash", "config_fingerprint", "world_size", "rank", "epoch", "position"}


def make_state(identity: dict[str, Any], epoch: int, position: int) -> dict[str, Any]:
    """The state dict of a sampler at ``position`` micro-batches into ``epoch``."""
    return {"kind": STATE_KIND, "version": STATE_VERSION, **identity, "epoch": epoch, "position": position}


def check_state(state: dict[str, Any], identity: dict[str, Any], rows_per_epoch: list[int]) -> tuple[int, int]:
    """Validate ``state`` against this sampler's identity; return ``(epoch, position)``.

    Args:
        state: a dict made by `make_state` (possibly after a round trip through
            ``torch.save``/``torch.load``).
        identity: this sampler's ``content_hash``, ``config_fingerprint``,
            ``world_size`` and ``rank``.
        rows_per_epoch: this rank's micro-batch count in each epoch.

    Raises:
        PlanFormatError: not a PlanSampler state, a newer version, or missing keys.
        PlanMismatchError: another plan, rank or world size; an impossible position.
    """
    _check_shape(state)
    for key, what, fix in (
        ("content_hash", "a plan with content hash", "resume with the plan file the run started with"),
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
    unknown = sorted(set(state) - _KEYS)
    if missing or unknown:
        raise PlanFormatError(
            f"sampler state has missing keys {missing} and unknown keys {unknown}; "
            "pass what PlanSampler.state_dict returned, unmodified"
        )
