"""What each process of the plan_batch DDP test runs (gloo on CPU, spawned by `_spawn.launch`).

Every step draws fresh random lengths (the same on every rank, as a rollout broadcast
would give them), calls `plan_batch` on each rank independently, and trains a float64
TinyGPT on this rank's micro-batches with the exact token-mean loss, with a collective per
micro-batch (unequal counts would hang, not pass). Rank 0 then trains a single-process
reference on the same batches: every sample alone, loss summed and divided by the batch's
loss tokens. Results go to ``rank{r}.pt``; the test compares them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from _ddp_plans import VOCAB_SIZE, make_model, process_group
from torch.nn.parallel import DistributedDataParallel

from batchplan import plan_batch
from batchplan.runtime import PackCollator, token_loss_sum
from batchplan.toy import RandomTokens

STEPS = 4
MAX_TOKENS = 64
GROUP_SIZE = 4
LEARNING_RATE = 0.05


def step_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """A step's lengths (fresh each step, some groups above MAX_TOKENS) and group labels."""
    rng = np.random.default_rng([31, step])
    count = GROUP_SIZE * int(rng.integers(1, 7))
    return rng.integers(1, 40, count), np.arange(count) // GROUP_SIZE


def run(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with process_group(rank, world_size, port):
        model = make_model(seed=4)
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        result = {"plans": [], "micro_batches_run": [], "first_grads": None}
        for step in range(STEPS):
            lengths, groups = step_batch(step)
            plan = plan_batch(lengths, world_size, MAX_TOKENS, groups=groups, hidden_size=32, seed=step)
            dataset = RandomTokens(lengths, VOCAB_SIZE, seed=step)
            result["plans"].append((plan.samples.copy(), plan.offsets.copy()))
            ran = 0
            for micro, samples in enumerate(plan.ranks[rank]):
                batch = PackCollator()([dataset[int(i)] for i in samples])
                last = micro == plan.num_micro - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    (token_loss_sum(ddp(**batch), batch) * plan.loss_scale()).backward()
                count = torch.ones(1)
                dist.all_reduce(count)  # lockstep: every rank runs this once per micro-batch
                ran += 1
            result["micro_batches_run"].append(ran)
            if step == 0:
                result["first_grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        result["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if rank == 0:
            result["reference"] = reference_training()
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def reference_training() -> dict:
    """One process, no DDP: each step's mean token loss over all its samples, each alone."""
    model = make_model(seed=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    first_grads = None
    for step in range(STEPS):
        lengths, _ = step_batch(step)
        dataset = RandomTokens(lengths, VOCAB_SIZE, seed=step)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for index in range(len(lengths)):
            batch = PackCollator()([dataset[index]])
            loss_sum = loss_sum + token_loss_sum(model(**batch), batch)
        (loss_sum / int((lengths - 1).sum())).backward()
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return {"first_grads": first_grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
