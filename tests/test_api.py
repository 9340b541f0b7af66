"""The top-level API: `batchplan.build_plan_file`, `build_plan` + `write_plan`, `open_plan`,
`validate_plan`, mixtures; each name is the library's object, and importing batchplan stays light."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _modules import loaded_after

import batchplan
from batchplan.formats.lengths import fingerprint_lengths, read_lengths
from batchplan.formats.mixture_file import read_mixture
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.formats.opening import open_plan
from batchplan.formats.plan_directory import PlanDirectory
from batchplan.formats.plan_file import PlanFile
from batchplan.formats.plan_writer import write_plan
from batchplan.mixture import Mixture, MixtureSource
from batchplan.operations.build import build_plan_file
from batchplan.operations.build_mixture import build_mixture_plan_file
from batchplan.operations.reshard import reshard_plan_file
from batchplan.operations.validate import Violation, validate_plan
from batchplan.planning.epochs import build_plan

# Each top-level name and the object it must be.
EXPORTS = {
    "Mixture": Mixture,
    "MixtureSource": MixtureSource,
    "OpenedPlan": OpenedPlan,
    "PlanDirectory": PlanDirectory,
    "PlanFile": PlanFile,
    "Violation": Violation,
    "build_mixture_plan_file": build_mixture_plan_file,
    "build_plan": build_plan,
    "build_plan_file": build_plan_file,
    "fingerprint_lengths": fingerprint_lengths,
    "open_plan": open_plan,
    "read_lengths": read_lengths,
    "read_mixture": read_mixture,
    "reshard_plan_file": reshard_plan_file,
    "validate_plan": validate_plan,
    "write_plan": write_plan,
}


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


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_each_top_level_name_is_the_library_object(name):
    assert name in batchplan.__all__
    assert getattr(batchplan, name) is EXPORTS[name]


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'plan_everything'"):
        batchplan.plan_everything  # noqa: B018


@pytest.mark.slow
def test_import_batchplan_loads_no_numba_torch_or_typer():
    assert loaded_after("import batchplan\nbatchplan.__all__, batchplan.PlanConfig") == set()


def test_lengths_in_memory_build_write_and_open_round_trip(tmp_path):
    lengths = np.random.default_rng(1).integers(1, 400, size=300).astype(np.int64)
    config = batchplan.PlanConfig(max_tokens=512, world_size=2, epochs=2, seed=4)
    plan = batchplan.build_plan(lengths, config)
    path = tmp_path / "plan.arrow"
    written = batchplan.write_plan(plan, path, lengths_fingerprint=batchplan.fingerprint_lengths(lengths))
    opened = batchplan.open_plan(path)
    assert opened.metadata["content_hash"] == written["content_hash"]
    assert opened.metadata["lengths_fingerprint"] == batchplan.fingerprint_lengths(lengths)
    assert opened.num_samples == 300 and opened.num_epochs == 2 and opened.world_size == 2
    for epoch in range(2):
        samples = np.concatenate(
            [opened.read_rank(epoch, rank).column("samples").flatten().to_numpy() for rank in range(2)]
        )
        assert np.sort(samples).tolist() == list(range(300))  # every sample once per epoch
    assert batchplan.validate_plan(opened) == []


def test_a_plan_written_from_memory_is_checked_against_its_lengths(tmp_path):
    from batchplan.runtime import PlanSampler

    lengths = np.random.default_rng(2).integers(1, 200, size=100)
    plan = batchplan.build_plan(lengths, batchplan.PlanConfig(max_tokens=256, world_size=1))
    path = tmp_path / "plan.arrow"
    batchplan.write_plan(plan, path, lengths_fingerprint=batchplan.fingerprint_lengths(lengths))
    sampler = PlanSampler(batchplan.open_plan(path), rank=0, world_size=1)
    sampler.check_dataset(100, lengths)
    with pytest.raises(batchplan.PlanMismatchError):
        sampler.check_dataset(100, lengths[::-1])
