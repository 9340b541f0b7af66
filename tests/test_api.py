"""The top-level API: `batchplan.build_plan_file`, `open_plan`, `validate_plan`, `PlanConfig`."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchplan


def test_build_open_validate_through_the_top_level(tmp_path):
    lengths = np.random.default_rng(0).integers(1, 512, size=500)
    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"length": lengths}), data)
    config = batchplan.PlanConfig(max_tokens=1024, world_size=2, epochs=2)
    metadata = batchplan.build_plan_file(data, tmp_path / "plan.arrow", config)
    plan = batchplan.open_plan(tmp_path / "plan.arrow")
    assert isinstance(plan, batchplan.PlanFile)
    assert plan.num_samples == 500 and metadata["content_hash"] == plan.metadata["content_hash"]
    assert batchplan.validate_plan(plan, data) == []
    assert batchplan.validate_plan(tmp_path / "plan.arrow") == []
    assert batchplan.read_lengths(data).lengths.tolist() == lengths.tolist()


def test_every_name_in_all_resolves():
    for name in batchplan.__all__:
        assert getattr(batchplan, name) is not None
    assert set(batchplan.__all__) <= set(dir(batchplan))


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'build_plan'"):
        batchplan.build_plan  # noqa: B018
