"""PlanConfig validates itself and round-trips through the plan metadata."""

from __future__ import annotations

import pytest

from batchplan.config import PlanConfig
from batchplan.errors import ConfigError


def test_round_trip_and_fingerprint():
    config = PlanConfig(max_tokens=4096, mode="pad", world_size=8, epochs=3, tokens_per_step=1 << 20)
    again = PlanConfig.from_dict(config.to_dict())
    assert again == config
    assert again.fingerprint() == config.fingerprint()
    assert PlanConfig(max_tokens=4096).fingerprint() != PlanConfig(max_tokens=4097).fingerprint()


def test_micro_batches_default_to_one():
    assert PlanConfig(max_tokens=8).micro_batches_per_step == 1
    assert PlanConfig(max_tokens=8, micro_batches=4).micro_batches_per_step == 4
    assert PlanConfig(max_tokens=8, tokens_per_step=8).micro_batches_per_step is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "`max_tokens` must be >= 1, got 0"),
        ({"max_tokens": 8, "world_size": 0}, "`world_size` must be >= 1"),
        ({"max_tokens": 8, "epochs": 0}, "`epochs` must be >= 1"),
        ({"max_tokens": 8, "seed": -1}, "`seed` must be >= 0"),
        ({"max_tokens": 8, "mode": "bogus"}, "`mode` must be one of pack, pad"),
        ({"max_tokens": 8, "oversize": "keep"}, "`oversize` must be one of"),
        ({"max_tokens": 8, "micro_batches": 2, "tokens_per_step": 64}, "both given"),
        ({"max_tokens": 8, "world_size": 4, "tokens_per_step": 16}, "smaller than one micro-batch per rank"),
        ({"max_tokens": 8, "batch_multiple": 2}, 'only applies to `mode="pad"`'),
        ({"max_tokens": 8, "mode": "pad", "batch_multiple": 9}, "cannot fit"),
        ({"max_tokens": 8.5}, "must be an integer"),
    ],
)
def test_bad_options_are_clear_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PlanConfig(**kwargs)


def test_unknown_keys_from_a_newer_plan_are_rejected():
    values = PlanConfig(max_tokens=8).to_dict() | {"future_knob": 1}
    with pytest.raises(ConfigError, match="future_knob"):
        PlanConfig.from_dict(values)
