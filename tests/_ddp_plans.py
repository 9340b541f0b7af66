"""Small plans, the matching random-token dataset and model, for the runtime tests.

Shared by the single-process tests and the DDP workers (spawned processes import
this module by name: it sits beside the tests on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from datetime import timedelta
from pathlib import Path

import numpy as np

from batchplan.config import PlanConfig
from batchplan.formats.plan_writer import write_plan
from batchplan.planning.epochs import build_plan

VOCAB_SIZE = 97


def sample_lengths(num_samples: int = 50, seed: int = 7) -> np.ndarray:
    """Lengths 1..47 plus three longer than 64 tokens (so split/truncate make spans)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 48, num_samples)
    lengths[[3, 17, 31]] = [150, 90, 65]
    return lengths.astype(np.int32)


def write_test_plan(path: Path, lengths: np.ndarray, **options) -> Path:
    """Build a plan of ``lengths`` with ``PlanConfig(**options)`` and write it to ``path``."""
    write_plan(build_plan(lengths, PlanConfig(**options)), path)
    return path


def standard_plans(directory: Path) -> dict[str, Path]:
    """The plans the DDP tests use.

    pack: spans (split), steps sized by tokens (2 to 4 micro-batches per rank); pad: spans
    (truncate), 2 micro-batches per step; single: one sample, so one rank gets an empty micro-batch.
    """
    lengths = sample_lengths()
    directory.mkdir(parents=True, exist_ok=True)
    return {
        "pack": write_test_plan(
            directory / "pack.arrow",
            lengths,
            max_tokens=64,
            world_size=2,
            epochs=2,
            tokens_per_step=400,
            oversize="split",
            seed=3,
        ),
        "pad": write_test_plan(
            directory / "pad.arrow",
            lengths,
            max_tokens=96,
            mode="pad",
            world_size=2,
            epochs=1,
            micro_batches=2,
            oversize="truncate",
            shuffle_window=8,
            seed=5,
        ),
        "single": write_test_plan(
            directory / "single.arrow", np.array([20], dtype=np.int32), max_tokens=64, world_size=2
        ),
    }


def make_dataset(lengths: np.ndarray | None = None):
    from batchplan.toy import RandomTokens

    return RandomTokens(sample_lengths() if lengths is None else lengths, VOCAB_SIZE)


def make_model(seed: int = 0, attention: str = "documents"):
    """A float64 TinyGPT, identical in every process for the same seed."""
    import torch

    from batchplan.toy import TinyGPT

    torch.manual_seed(seed)
    model = TinyGPT(VOCAB_SIZE, d_model=32, num_heads=4, num_layers=2, max_positions=160, attention=attention)
    return model.to(torch.float64)


def free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768-60999): a port the kernel hands
    out (bind to 0) may be handed again to a client socket of another test before rank 0
    listens on it (EADDRINUSE); a random one below that range is not."""
    rng = random.Random()
    while True:
        port = rng.randrange(20_000, 32_768)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


@contextlib.contextmanager
def process_group(rank: int, world_size: int, port: int):
    """A gloo process group on CPU for one spawned rank; the sampler must find rank and
    world size through torch.distributed, so RANK/WORLD_SIZE are cleared."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.pop("RANK", None)
    os.environ.pop("WORLD_SIZE", None)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        yield
        # Tear down together: a rank destroying its group while a peer still talks to it
        # can abort the peer inside gloo ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()
