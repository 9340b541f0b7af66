"""The build configuration: one frozen, keyword-only dataclass that checks itself.

The CLI builds it, library users build it, and the plan file stores it (``to_dict``),
so a plan always says exactly how it was made. ``fingerprint`` is stable across
processes and machines (canonical JSON, SHA-256).

Errors name the fields, in backticks (`` `max_tokens` ``, `` `mode="pad"` ``): the words
of a library caller; the CLI turns them into its options (``batchplan_cli.flags``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Literal, TypeAlias, get_args

from batchplan.errors import ConfigError

__all__ = ["MODES", "OVERSIZE_POLICIES", "PlanConfig", "num_threads", "parse_count"]

# The allowed values of the choices: as types (the fields of PlanConfig) and as tuples (checks, CLI).
Mode: TypeAlias = Literal["pack", "pad"]
Oversize: TypeAlias = Literal["error", "drop", "truncate", "split"]
Balance: TypeAlias = Literal["tokens", "compute"]
MODES: tuple[Mode, ...] = get_args(Mode)
OVERSIZE_POLICIES: tuple[Oversize, ...] = get_args(Oversize)
BALANCE_MODES: tuple[Balance, ...] = get_args(Balance)
LAYOUTS = ("file", "directory")  # how a plan is written (not part of the plan)

# Steps are formed from micro-batches of similar cost within windows of this many
# steps (then the steps are shuffled): 1 would mean purely random step composition.
DEFAULT_BALANCE_WINDOW = 64

# Pad mode sorts lengths inside windows of this many samples: large enough that
# neighbours in a window have near-equal lengths (padding < 1 % on the shared data),
# small enough that each window is a random slice of the epoch.
DEFAULT_SHUFFLE_WINDOW = 16_384


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """How to turn sample lengths into a plan.

    Attributes:
        max_tokens: token cap of one micro-batch (pack: sum of lengths; pad: count x longest).
        mode: ``"pack"`` (samples concatenated) or ``"pad"`` (samples padded to the longest).
        world_size: number of data-parallel ranks.
        epochs: number of epochs to plan.
        seed: root of all randomness (``SeedSequence([seed, epoch, stream])``).
        micro_batches: micro-batches per rank per step (default 1 unless ``tokens_per_step``).
        tokens_per_step: global token target per step; micro-batches per step then vary.
        oversize: what to do with samples longer than ``max_tokens``.
        drop_empty: drop samples of length 0 (or null) instead of failing.
        drop_last: drop an epoch's incomplete final step instead of completing it.
        shuffle_window: pad mode: samples sorted by length inside windows of this size.
        batch_multiple: pad mode: keep samples per micro-batch a multiple of this.
        balance: what steps and ranks are balanced on: ``"tokens"``, or ``"compute"``
            (tokens + attention, `batchplan.planning.cost`; needs ``hidden_size`` or
            ``attention_coefficient``). Default: compute when either is given, else tokens.
        balance_window: rounds (one micro-batch per rank; a step is one or more rounds)
            are formed from micro-batches of similar cost (tokens or compute) within
            windows of this many rounds, then shuffled; 1 = random rounds.
        hidden_size: model width, for the attention term of the cost model
            (coefficient ``1 / (12 hidden_size)``).
        attention_coefficient: the attention term's coefficient given directly (e.g.
            fitted to measured step times, as ``bench/balance.py`` does); instead of
            ``hidden_size``.
        rampup_start: batch-size ramp-up: global tokens per step at the start of the run
            (with ``rampup_tokens``). Steps grow linearly in the tokens done to the full
            step: ``tokens_per_step``, or with ``micro_batches`` M the mean tokens of a
            step of M micro-batches per rank (then exactly M once the ramp is over).
        rampup_tokens: tokens of the run (across epochs) over which the ramp-up runs.
        seqlen_warmup_min: sequence-length warmup: during the first
            ``seqlen_warmup_tokens`` tokens of the run, samples are split into pieces of at
            most a cap that grows from this to ``max_tokens`` (`batchplan.planning.warmup`).
        seqlen_warmup_tokens: tokens of the first epoch over which the cap grows.
    """

    max_tokens: int
    mode: Mode = "pack"
    world_size: int = 1
    epochs: int = 1
    seed: int = 0
    micro_batches: int | None = None
    tokens_per_step: int | None = None
    oversize: Oversize = "error"
    drop_empty: bool = False
    drop_last: bool = False
    shuffle_window: int = DEFAULT_SHUFFLE_WINDOW
    batch_multiple: int = 1
    balance: Balance | None = None
    balance_window: int = DEFAULT_BALANCE_WINDOW
    hidden_size: int | None = None
    attention_coefficient: float | None = None
    rampup_start: int | None = None
    rampup_tokens: int | None = None
    seqlen_warmup_min: int | None = None
    seqlen_warmup_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("world_size", self.world_size, minimum=1)
        _check_int("epochs", self.epochs, minimum=1)
        _check_int("seed", self.seed, minimum=0)
        _check_int("shuffle_window", self.shuffle_window, minimum=1)
        _check_int("batch_multiple", self.batch_multiple, minimum=1)
        _check_int("balance_window", self.balance_window, minimum=1)
        _check_choice("mode", self.mode, MODES)
        _check_choice("oversize", self.oversize, OVERSIZE_POLICIES)
        self._check_cost_model()
        self._check_steps()
        self._check_padding()
        self._check_rampup()
        self._check_seqlen_warmup()

    def _check_cost_model(self) -> None:
        if self.hidden_size is not None:
            _check_int("hidden_size", self.hidden_size, minimum=1)
        if self.attention_coefficient is not None:
            value = self.attention_coefficient
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"`attention_coefficient` must be a finite number >= 0, got {value!r}")
            if self.hidden_size is not None:
                raise ConfigError(
                    "`hidden_size` and `attention_coefficient` were both given; the width only sets the "
                    "coefficient (1 / (12 x width)), pass one of them"
                )
        if self.balance is None:  # resolved here, so the stored config is explicit
            object.__setattr__(self, "balance", "tokens" if self.cost_coefficient is None else "compute")
        _check_choice("balance", self.balance, BALANCE_MODES)
        if self.balance == "compute" and self.cost_coefficient is None:
            raise ConfigError(
                '`balance="compute"` needs the attention term of the cost model; pass `hidden_size` '
                "or `attention_coefficient`"
            )

    def _check_steps(self) -> None:
        if self.micro_batches is not None and self.tokens_per_step is not None:
            raise ConfigError(
                "`micro_batches` and `tokens_per_step` were both given; steps are sized "
                "either by a fixed count of micro-batches per rank or by a global token "
                "target, pass only one"
            )
        if self.micro_batches is not None:
            _check_int("micro_batches", self.micro_batches, minimum=1)
        if self.tokens_per_step is not None:
            _check_int("tokens_per_step", self.tokens_per_step, minimum=1)
            smallest = self.world_size * self.max_tokens
            if self.tokens_per_step < smallest:
                raise ConfigError(
                    f"`tokens_per_step` {self.tokens_per_step:,} is smaller than one micro-batch "
                    f"per rank (world_size {self.world_size} x max_tokens {self.max_tokens:,} = "
                    f"{smallest:,}); raise `tokens_per_step` or use `micro_batches`"
                )

    def _check_padding(self) -> None:
        if self.batch_multiple > 1 and self.mode != "pad":
            raise ConfigError(
                f'`batch_multiple` {self.batch_multiple} only applies to `mode="pad"` '
                f'(mode is {self.mode!r}); drop it or use `mode="pad"`'
            )
        if self.batch_multiple > self.max_tokens:
            raise ConfigError(
                f"`batch_multiple` {self.batch_multiple:,} cannot fit: a micro-batch of "
                f"{self.batch_multiple:,} samples of length >= 1 exceeds max_tokens "
                f"{self.max_tokens:,}; lower `batch_multiple`"
            )

    def _check_rampup(self) -> None:
        if not _check_pair("rampup_start", "rampup_tokens", self.rampup_start, self.rampup_tokens):
            return
        start = _check_int("rampup_start", self.rampup_start, minimum=1)
        _check_int("rampup_tokens", self.rampup_tokens, minimum=1)
        smallest = self.world_size * self.max_tokens  # the smallest step: one micro-batch per rank
        if start < smallest:
            raise ConfigError(
                f"`rampup_start` {start:,} is smaller than one micro-batch per rank "
                f"(world_size {self.world_size} x max_tokens {self.max_tokens:,} = {smallest:,}), the "
                f"smallest step; raise `rampup_start` to at least {smallest:,}"
            )
        if self.tokens_per_step is not None:
            if start >= self.tokens_per_step:
                raise ConfigError(
                    f"`rampup_start` {start:,} must be below `tokens_per_step` "
                    f"{self.tokens_per_step:,} (the ramp grows the step up to it); lower `rampup_start`"
                )
            return
        per_step = self.micro_batches_per_step
        assert per_step is not None  # steps are sized by micro-batches: tokens_per_step is None
        if per_step == 1:
            raise ConfigError(
                "a ramp-up needs a full step larger than one micro-batch per rank (the smallest "
                "step): pass `tokens_per_step` (the ramp's target) or `micro_batches` above 1"
            )
        full = smallest * per_step
        if start >= full:
            raise ConfigError(
                f"`rampup_start` {start:,} must be below a full step of `micro_batches` "
                f"{per_step} (at most {per_step} x {smallest:,} = {full:,} tokens); lower `rampup_start` "
                "or raise `micro_batches`"
            )

    def _check_seqlen_warmup(self) -> None:
        if not _check_pair(
            "seqlen_warmup_min", "seqlen_warmup_tokens", self.seqlen_warmup_min, self.seqlen_warmup_tokens
        ):
            return
        warmup_min = _check_int("seqlen_warmup_min", self.seqlen_warmup_min, minimum=1)
        _check_int("seqlen_warmup_tokens", self.seqlen_warmup_tokens, minimum=1)
        if warmup_min >= self.max_tokens:
            raise ConfigError(
                f"`seqlen_warmup_min` {warmup_min:,} must be below max_tokens "
                f"{self.max_tokens:,} (the cap grows from it to max_tokens); lower `seqlen_warmup_min`"
            )

    @property
    def has_rampup(self) -> bool:
        return self.rampup_start is not None

    @property
    def has_seqlen_warmup(self) -> bool:
        return self.seqlen_warmup_min is not None

    @property
    def cost_coefficient(self) -> float | None:
        """The cost model's attention coefficient, or None (no compute cost)."""
        if self.attention_coefficient is not None:
            return float(self.attention_coefficient)
        if self.hidden_size is not None:
            return 1.0 / (12.0 * self.hidden_size)  # batchplan.planning.cost.attention_coefficient
        return None

    @property
    def micro_batches_per_step(self) -> int | None:
        """Micro-batches per rank per step, or None when steps are sized by tokens."""
        if self.tokens_per_step is not None:
            return None
        return 1 if self.micro_batches is None else self.micro_batches

    def to_dict(self) -> dict[str, Any]:
        """All fields as plain JSON-able values."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PlanConfig:
        """Inverse of `to_dict`; unknown keys are an error (a newer plan's config)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}: the plan was made by a newer batchplan; upgrade it")
        return cls(**values)

    def fingerprint(self) -> str:
        """SHA-256 (hex, 16 chars) of the canonical JSON of `to_dict`."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_int(name: str, value: object, *, minimum: int) -> int:
    """``value``, checked to be an integer (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"`{name}` must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"`{name}` must be >= {minimum}, got {value:,}")
    return value


def _check_pair(first_name: str, second_name: str, first: object, second: object) -> bool:
    """Both fields of a pair (a ramp-up's start and length) given (True) or neither (False)."""
    if (first is None) != (second is None):
        raise ConfigError(
            f"`{first_name}` and `{second_name}` go together: give both or neither, got {first!r} and {second!r}"
        )
    return first is not None


def parse_count(text: str) -> int:
    """``"262_144"`` -> 262144, ``"100M"`` -> 10^8: digits with ``_`` separators and an optional
    ``k``/``M``/``G``/``T`` suffix (powers of 1,000).

    Raises:
        ValueError: anything else (callers turn it into a `ConfigError` naming their option).
    """
    text = text.strip()
    scale = {"k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.replace("_", "").isdigit():
        raise ValueError(text)
    return int(digits) * scale


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"`{name}` must be one of {', '.join(choices)}; got {value!r}")


def num_threads() -> int:
    """Threads for planning epochs: ``BATCHPLAN_THREADS``, else the usable cores."""
    value = os.environ.get("BATCHPLAN_THREADS")
    if value is not None:
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"BATCHPLAN_THREADS must be a positive integer, got {value!r}")
        return int(value)
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
