"""torchdata's StatefulDataLoader: the plain loop checkpointed by the loader's own state_dict (2 processes).

Pack (``--micro-batches 2``) and ``--tokens-per-step`` plans, 2 epochs, ``num_workers``
0 and 2: a run stopped inside epoch 2 and resumed from ``loader.state_dict()`` in fresh
objects trains exactly the plan's remaining micro-batches and ends with the parameters
of the uninterrupted plain loop.
"""

from __future__ import annotations

import pytest
import torch
from _ddp_plans import free_port, sample_lengths
from _integration_worker import stateful_checks
from _spawn import launch
from test_integrations_transformers import integration_plans, planned

pytest.importorskip("torchdata")
WORLD_SIZE = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("torchdata")
    lengths = sample_lengths()
    plans = integration_plans(directory / "plans", lengths)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(WORLD_SIZE)}
    launch(stateful_checks, (plans, lengths, str(directory)), WORLD_SIZE, timeout_s=600, env=env)
    return [torch.load(directory / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)], plans


@pytest.mark.slow
def test_a_resume_from_the_loaders_own_state_trains_exactly_the_rest(runs):
    results, plans = runs
    for rank, result in enumerate(results):
        for name, path in plans.items():
            reference = result[(name, 0)]["plain"]
            assert reference["seen"] == planned(path, rank)
            for workers in (0, 2):
                run = result[(name, workers)]
                assert run["first"]["seen"] + run["rest"]["seen"] == planned(path, rank), (rank, name, workers)
                for key, value in reference["params"].items():
                    torch.testing.assert_close(run["rest"]["params"][key], value, rtol=0, atol=1e-6)
