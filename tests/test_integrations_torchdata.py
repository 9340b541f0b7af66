"""torchdata's StatefulDataLoader: the plain loop checkpointed by the loader's own state_dict (2 processes).

Pack (``--micro-batches 2``) and ``--tokens-per-step`` plans, 2 epochs, ``num_workers``
0 and 2: a run stopped inside epoch 2 and resumed from ``loader.state_dict()`` in fresh
objects trains exactly the plan's remaining micro-batches and ends with the parameters
of the uninterrupted plain loop.
"""

from __future__ import annotations

import pytest
from _integration_worker import assert_resumed, planned, stack_runs

pytest.importorskip("torchdata")


@pytest.fixture
def runs(integration_runs):
    return stack_runs(integration_runs, "torchdata")


@pytest.mark.slow
def test_a_resume_from_the_loaders_own_state_trains_exactly_the_rest(runs):
    results, plans = runs
    for rank, result in enumerate(results):
        for name, path in plans.items():
            reference = result[(name, 0)]["plain"]
            assert reference["seen"] == planned(path, rank)
            for workers in (0, 2):
                run = result[(name, workers)]
                assert_resumed(run["first"], run["rest"], reference, path, rank)
