"""What each process of the real reshard test runs (gloo on CPU, spawned by `launch`).

``train_until`` trains a plan with DDP for a number of optimizer steps and saves what
each rank ran plus its sampler state; ``resume_on`` starts a run of another world
size on the resharded plan from those states and trains to the end. A collective
per micro-batch keeps ranks in lockstep (unequal counts would hang, not pass).
Results go to ``{tag}{rank}.pt``; tests/test_reshard.py compares them.

Spawned processes import only torch and the runtime (no numba: not `_ddp_plans`),
since each start costs seconds on a small CPU machine.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from _ddp_plans import process_group
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from batchplan.runtime import PackCollator, PadCollator, PlanDataset, PlanSampler, token_loss_sum
from batchplan.toy import RandomTokens, TinyGPT

VOCAB_SIZE = 97


def train_until(rank: int, world_size: int, port: int, plan: str, lengths, steps: int, out_dir: str) -> None:
    """Train ``plan`` for ``steps`` optimizer steps; save what ran and the sampler state."""
    with process_group(rank, world_size, port):
        result = _train(plan, lengths, stop_after=steps)
        torch.save(result, Path(out_dir) / f"old{rank}.pt")


def resume_on(rank: int, world_size: int, port: int, plan: str, lengths, states: str, out_dir: str) -> None:
    """Load an old rank's state into a sampler of the resharded ``plan`` and train to the end."""
    with process_group(rank, world_size, port):
        saved = torch.load(states, weights_only=True)  # one state per old rank
        result = _train(plan, lengths, state=saved[rank % len(saved)])
        torch.save(result, Path(out_dir) / f"new{rank}.pt")


def _train(path: str, lengths, *, stop_after: int | None = None, state: dict | None = None) -> dict:
    sampler = PlanSampler(path)
    if state is not None:
        sampler.load_state_dict(state)
    torch.manual_seed(2)
    model = TinyGPT(VOCAB_SIZE, d_model=16, num_heads=2, num_layers=1, max_positions=160).to(torch.float64)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    collate = PackCollator() if sampler.mode == "pack" else PadCollator()
    loader = DataLoader(PlanDataset(RandomTokens(lengths, VOCAB_SIZE)), batch_sampler=sampler, collate_fn=collate)
    seen, steps = [], 0
    while not sampler.finished:
        for batch in loader:
            mb = batch.record
            _check_lockstep(mb)
            with contextlib.nullcontext() if mb.is_last else ddp.no_sync():
                (token_loss_sum(ddp(**batch), batch) * mb.loss_scale()).backward()
            seen.append(
                (mb.epoch, mb.step, mb.micro, tuple(mb.indices), tuple(mb.starts or ()), tuple(mb.lengths or ()))
            )
            if mb.is_last:
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
                if steps == stop_after:
                    return {"seen": seen, "state": sampler.state_dict(after=mb)}
    return {"seen": seen, "state": sampler.state_dict()}


def _check_lockstep(mb) -> None:
    here = torch.tensor([mb.step, mb.micro, mb.num_micro], dtype=torch.int64)
    total = here.clone()
    dist.all_reduce(total)
    if not torch.equal(total, here * dist.get_world_size()):
        raise AssertionError(f"ranks out of lockstep at {here.tolist()}: sum {total.tolist()}")
