"""Shared fixtures: hypothesis profiles, deterministic length sets, plan building helpers, the
integration stacks' one spawn, and how ``pytest -n`` hands tests to its workers.

Hypothesis runs the ``batchplan`` profile (modest example counts, no deadline: the
first call of a kernel may load it from numba's cache); ``HYPOTHESIS_PROFILE=thorough``
runs ten times more examples.

Under ``pytest -n N`` without ``--dist``, a worker takes whole units (`unit_of`): the tests of
one module, of several (`UNITS`: the tests of a fixture that one spawn builds for several
modules), or one test alone (`ALONE`: tests of minutes). A module's or a spawn's fixture is then
built on one worker, not on each, and units that hold a ``slow`` test are handed out first, so
that the many short tests come last and the workers finish together.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from batchplan.config import PlanConfig

settings.register_profile("batchplan", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "batchplan"))

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
REAL_FILES = {
    "squad": "squad11_bert384.parquet",
    "sharegpt_dialogues": "sharegpt_dialogues_cl100k.parquet",
    "sharegpt_segments": "sharegpt_segments_cl100k.parquet",
}


def synthetic_lengths(name: str) -> np.ndarray:
    """Deterministic synthetic length sets (int32), by name.

    - ``lognormal``: typical pretraining documents; ~4 % above 2,048.
    - ``uniform``: 1..2,048, none oversize at 2,048.
    - ``heavy_tail``: Pareto; some samples 100x above 1,024.
    - ``chat``: tiny chat turns, 1..48 tokens, many equal.
    - ``with_empty``: lognormal with 5 % empty samples.
    """
    rng = np.random.default_rng(sum(map(ord, name)))
    if name == "lognormal":
        values = np.maximum(rng.lognormal(6.2, 1.0, 3000), 1)
    elif name == "uniform":
        values = rng.integers(1, 2049, 2000)
    elif name == "heavy_tail":
        values = rng.pareto(1.1, 1200) * 150 + 1
    elif name == "chat":
        values = rng.integers(1, 49, 5000)
    elif name == "with_empty":
        values = np.maximum(rng.lognormal(6.0, 1.0, 800), 1)
        values[rng.random(800) < 0.05] = 0
    else:
        raise KeyError(name)
    return np.minimum(values, 2**30).astype(np.int32)


_REAL_CACHE: dict[str, np.ndarray] = {}


def real_lengths(name: str) -> np.ndarray:
    """Lengths of a file in data/ (read once per session)."""
    if name not in _REAL_CACHE:
        from batchplan.formats.lengths import read_lengths

        _REAL_CACHE[name] = read_lengths(DATA_DIR / REAL_FILES[name]).lengths
    return _REAL_CACHE[name]


def dataset_lengths(name: str) -> np.ndarray:
    return real_lengths(name) if name in REAL_FILES else synthetic_lengths(name)


def build_and_write(
    lengths: np.ndarray,
    config: PlanConfig,
    path: Path,
    *,
    loss_tokens: np.ndarray | None = None,
):
    """Build a plan in memory and write it with the lengths fingerprint; return the Plan."""
    from batchplan.formats.lengths import fingerprint_lengths
    from batchplan.formats.plan_writer import write_plan
    from batchplan.planning.epochs import build_plan

    plan = build_plan(lengths, config, loss_tokens=loss_tokens)
    write_plan(plan, path, lengths_fingerprint=fingerprint_lengths(np.asarray(lengths), loss_tokens))
    return plan


@pytest.fixture
def write_built_plan(tmp_path):
    """``write_built_plan(lengths, config, name="plan.arrow", loss_tokens=None) -> (path, plan)``."""

    def _write(lengths, config, name="plan.arrow", loss_tokens=None):
        path = tmp_path / name
        plan = build_and_write(lengths, config, path, loss_tokens=loss_tokens)
        return path, plan

    return _write


@pytest.fixture
def small_lengths() -> np.ndarray:
    """400 samples of 1..300 tokens: a quick, well-mixed dataset."""
    return np.random.default_rng(7).integers(1, 301, 400).astype(np.int32)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The runtime tests' plans (`_ddp_plans.standard_plans`), built once per module; modules
    that need other plans define their own ``plans``."""
    from _ddp_plans import standard_plans

    return standard_plans(tmp_path_factory.mktemp("plans"))


@pytest.fixture(autouse=True)
def one_torch_thread_per_worker():
    """Under ``pytest -n``, torch in a worker computes on one thread: each worker has one core's
    share, and tiny models only lose to threads that wait for each other (a test that loads
    Accelerate or Lightning may have set more)."""
    torch = sys.modules.get("torch")
    if torch is not None and "PYTEST_XDIST_WORKER" in os.environ:
        torch.set_num_threads(1)


@pytest.fixture
def no_launcher_environment(monkeypatch):
    """No RANK or WORLD_SIZE from a launcher: samplers take their rank from arguments."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture(scope="session")
def integration_runs(tmp_path_factory):
    """Every integration stack on 2 real processes, in one spawn (`_integration_worker.every_stack`):
    ``(each rank's results, the plans)``; `_integration_worker.stack_runs` picks one stack's.
    A module whose tests use it belongs in `UNITS`' "integration stacks"."""
    pytest.importorskip("datasets")
    pytest.importorskip("transformers")
    from _integration_worker import every_stack, run_integration

    return run_integration(every_stack, tmp_path_factory.mktemp("integrations"), timeout_s=1800)


# -- how `pytest -n` hands out tests ---------------------------------------------------------------

# Units other than a whole module, by node id prefix. A fixture that one spawn builds for tests of
# several modules needs them in one unit; otherwise each worker that runs one builds it again.
UNITS = {
    "tests/test_integrations_accelerate.py": "integration stacks",  # integration_runs
    "tests/test_integrations_lightning.py": "integration stacks",
    "tests/test_integrations_torchdata.py": "integration stacks",
    "tests/test_integrations_transformers.py": "integration stacks",
}
# Tests that are each a unit of their own: minutes each, so that both workers share them.
ALONE = ("tests/test_docs_integrations.py::test_each_launch_of_the_page_runs_as_written",)


def unit_of(nodeid: str) -> str:
    """The unit a test runs in under ``pytest -n``: one of `UNITS`, itself (`ALONE`), or its module."""
    if nodeid.startswith(ALONE):
        return nodeid
    return next((unit for prefix, unit in UNITS.items() if nodeid.startswith(prefix)), nodeid.split("::")[0])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` without ``--dist``: xdist's scope scheduling over `unit_of`, in collection order."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # the order of `pytest_collection_modifyitems`, not by size
    return UnitScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Tells each worker that the controller hands out units (`pytest_collection_modifyitems`)."""
    node.workerinput["batchplan_units"] = node.config.getoption("dist") == "load"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """On a worker of ``-n N``: units that hold a slow test first (a stable sort: each unit, and
    the rest, keep their order), so that short tests fill in at the end."""
    if not getattr(config, "workerinput", {}).get("batchplan_units"):
        return
    slow = {unit_of(item.nodeid) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: unit_of(item.nodeid) not in slow)
