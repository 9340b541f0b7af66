"""What each process of the integration tests runs (2 real processes, gloo on CPU).

Every path trains the same tiny random-init ``LlamaForCausalLM`` (float32, SGD) on a
Hugging Face ``datasets.Dataset`` through a plan, and logs, per micro-batch, what it
trained: ``(epoch, step, micro, samples, starts)``. The plain runtime loop is the
reference: the tests compare each path's log and final parameters with it, and a
resumed run (stopped inside epoch 2, restarted from the path's own checkpoint)
with the uninterrupted one.

One spawn (`every_stack`, the session fixture ``integration_runs``) runs the plain loop once
per plan, then each stack's checks in turn, and saves them by stack; a stack whose library is
missing, or whose checks raise, saves why, and `stack_runs` skips or fails only its tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import traceback
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from batchplan.runtime import (
    PackCollator,
    PadCollator,
    PlanDataset,
    PlanSampler,
    token_loss_sum,
)

LR = 0.1
VOCAB_SIZE = 97


def integration_plans(directory: Path, lengths) -> dict[str, str]:
    """A pack plan with 2 micro-batches per step and one with steps of 300 tokens, 2 ranks, 2 epochs."""
    from _ddp_plans import write_test_plan

    directory.mkdir(parents=True, exist_ok=True)
    return {
        "pack": str(
            write_test_plan(
                directory / "pack.arrow",
                lengths,
                max_tokens=64,
                world_size=2,
                epochs=2,
                micro_batches=2,
                oversize="split",
                seed=3,
            )
        ),
        "tokens": str(
            write_test_plan(
                directory / "tokens.arrow",
                lengths,
                max_tokens=64,
                world_size=2,
                epochs=2,
                tokens_per_step=300,
                oversize="split",
                seed=4,
            )
        ),
    }


def run_integration(checks, directory: Path, *leading, timeout_s: float = 600.0) -> tuple[list[dict], dict[str, str]]:
    """``checks(rank, *leading, plans, lengths, out_dir)`` on 2 real ranks over `integration_plans`:
    each rank's saved results, and the plans."""
    from _ddp_plans import sample_lengths
    from _spawn import run_ranks

    lengths = sample_lengths()
    plans = integration_plans(directory / "plans", lengths)
    return run_ranks(checks, (*leading, plans, lengths), directory, timeout_s=timeout_s), plans


def stack_runs(runs: tuple[list[dict], dict[str, str]], stack: str) -> tuple[list[dict], dict[str, str]]:
    """One stack's results from ``integration_runs``: each rank's, and the plans. A stack whose
    library is missing skips the test; one that raised fails it with the traceback."""
    import pytest

    results, plans = runs
    for rank, result in enumerate(results):
        if "missing" in result[stack]:
            pytest.skip(f"{stack} needs {result[stack]['missing']}")
        if "error" in result[stack]:
            pytest.fail(f"rank {rank}, {stack}:\n{result[stack]['error']}")
    return [result[stack] for result in results], plans


def planned(path: str, rank: int) -> list[tuple]:
    """What ``rank`` must train, micro-batch by micro-batch: `key` of each of its plan rows."""
    from batchplan.formats.opening import open_plan

    plan = open_plan(path)
    out = []
    for epoch in range(plan.num_epochs):
        for row in plan.read_rank(epoch, rank).to_pylist():
            out.append((epoch, row["step"], row["micro"], tuple(row["samples"]), tuple(row.get("starts") or ())))
    return out


def assert_same_params(actual: dict, expected: dict) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def assert_resumed(first: dict, rest: dict, full: dict, path: str, rank: int) -> None:
    """A run stopped and resumed trained exactly the plan, to the uninterrupted run's parameters."""
    assert first["seen"] + rest["seen"] == planned(path, rank), (path, rank)
    assert_same_params(rest["params"], full["params"])


def make_dataset(lengths):
    import datasets

    rng = np.random.default_rng(0)
    ids = [rng.integers(0, VOCAB_SIZE, int(n)).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids})


def make_model(attention: str = "sdpa"):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attention,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def make_tokenizer():
    """A word-level tokenizer over the model's ids, built in memory (SFTTrainer needs one)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB_SIZE)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t1")


def key(record) -> tuple:
    return (record.epoch, record.step, record.micro, tuple(record.indices), tuple(record.starts or ()))


def params(model) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def init_group() -> None:
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")


# -- the plain loop -------------------------------------------------------------------------


def train_micro_batch(ddp, batch, optimizer) -> bool:
    """The plain loop's body for one micro-batch; True when it ended a step (optimizer stepped)."""
    mb = batch.record
    with contextlib.nullcontext() if mb.is_last else ddp.no_sync():
        (token_loss_sum(ddp(**batch), batch) * mb.loss_scale()).backward()
    if mb.is_last:
        optimizer.step()
        optimizer.zero_grad()
    return mb.is_last


def plain_loop(plan: str, lengths) -> dict:
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    sampler = PlanSampler(plan)
    collate = PackCollator() if sampler.mode == "pack" else PadCollator()
    loader = DataLoader(PlanDataset(make_dataset(lengths)), batch_sampler=sampler, collate_fn=collate)
    model = make_model()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    seen = []
    while not sampler.finished:
        for batch in loader:
            seen.append(key(batch.record))
            train_micro_batch(ddp, batch, optimizer)
    return {"seen": seen, "params": params(model), "initial": params(make_model())}


# -- Hugging Face Trainer and TRL -----------------------------------------------------------


def trainer_class(base: str):
    from batchplan.integrations.transformers import PlanTrainer, PlanTrainerMixin

    if base == "trainer":
        parent = PlanTrainer
    else:
        from trl import SFTTrainer

        parent = type("PlanSFTTrainer", (PlanTrainerMixin, SFTTrainer), {})

    class Logged(parent):
        """Logs what each step trained; nothing else changes."""

        seen: list

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.seen.extend(key(batch.record) for batch in inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    return Logged


def trainer_args(base: str, out: str, *, max_steps: int = -1, save_steps: int | None = None, workers: int = 0):
    options = dict(
        output_dir=out,
        max_steps=max_steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        disable_tqdm=True,
        logging_steps=1000,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        dataloader_num_workers=workers,
        seed=0,
    )
    if base == "trainer":
        import transformers

        return transformers.TrainingArguments(**options)
    from trl import SFTConfig

    # SFTConfig defaults to bf16 mixed precision; the comparison with the plain loop is in float32.
    return SFTConfig(**options, bf16=False, max_length=None, dataset_kwargs={"skip_prepare_dataset": True})


def run_trainer(
    base: str, plan: str, lengths, out: str, *, max_steps=-1, save_steps=None, resume=None, workers: int = 0
) -> dict:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    cls = trainer_class(base)
    trainer = cls(
        model=model,
        args=trainer_args(base, out, max_steps=max_steps, save_steps=save_steps, workers=workers),
        train_dataset=make_dataset(lengths),
        optimizers=(optimizer, None),
        plan=plan,
        **({} if base == "trainer" else {"processing_class": make_tokenizer()}),
    )
    trainer.seen = []
    trainer.train(resume_from_checkpoint=resume)
    return {"seen": trainer.seen, "params": params(trainer.model), "global_step": trainer.state.global_step}


def trainer_checks(base: str, plans: dict[str, str], lengths, out_dir: str, plain: dict[str, dict]) -> dict:
    results = {}
    for name, plan in plans.items():
        where = os.path.join(out_dir, f"{base}-{name}")
        results[name] = {"plain": plain[name], "full": run_trainer(base, plan, lengths, where)}
        stop = _step_inside_last_epoch(plan)
        first = run_trainer(base, plan, lengths, where + "-resume", max_steps=stop, save_steps=stop)
        rest = run_trainer(
            base,
            plan,
            lengths,
            where + "-resume",
            resume=f"{where}-resume/checkpoint-{stop}",
            workers=2 if name == "pack" else 0,
        )
        results[name].update(first=first, rest=rest, stop=stop)
    return results


def _step_inside_last_epoch(plan: str) -> int:
    steps = PlanSampler(plan, rank=0, world_size=dist.get_world_size()).steps_per_epoch
    return sum(steps[:-1]) + max(steps[-1] // 2, 1)


# -- Accelerate custom loop -----------------------------------------------------------------


def accelerate_loop(
    plan: str, lengths, out: str, *, stop_after: int | None = None, resume: bool = False, workers: int = 0
) -> dict:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from batchplan.integrations.accelerate import prepare_plan_loader

    accelerator = Accelerator(cpu=True)
    sampler = PlanSampler(plan)
    loader = DataLoader(
        PlanDataset(make_dataset(lengths)),
        batch_sampler=sampler,
        collate_fn=PackCollator(),
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
    )
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    loader = prepare_plan_loader(accelerator, loader)
    accelerator.register_for_checkpointing(loader)
    if resume:
        accelerator.load_state(out)
    seen, steps = [], 0
    while not sampler.finished:
        for batch in loader:
            mb = batch.record
            with contextlib.nullcontext() if mb.is_last else accelerator.no_sync(model):
                loss = token_loss_sum(model(**batch), batch) * mb.loss_scale()
                accelerator.backward(loss)
            seen.append(key(mb))
            if mb.is_last:
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
                if steps == stop_after:
                    accelerator.save_state(out)
                    return {"seen": seen}
    return {"seen": seen, "params": params(model)}


def refuse_prepare(plan: str, lengths) -> str:
    """What accelerator.prepare(plan loader) does: it reads batch_size to re-shard, and is refused."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    loader = DataLoader(PlanDataset(make_dataset(lengths)), batch_sampler=PlanSampler(plan), collate_fn=PackCollator())
    try:
        Accelerator(cpu=True).prepare(loader)
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


def accelerate_checks(plans: dict[str, str], lengths, out_dir: str, plain: dict[str, dict]) -> dict:
    results = {"refused": refuse_prepare(plans["pack"], lengths)}
    for name, plan in plans.items():
        where = os.path.join(out_dir, f"accelerate-{name}")
        stop = _step_inside_last_epoch(plan)
        results[name] = {
            "plain": plain[name],
            "full": accelerate_loop(plan, lengths, where, workers=2 if name == "pack" else 0),
            "first": accelerate_loop(plan, lengths, where, stop_after=stop, workers=2 if name == "pack" else 0),
            "rest": accelerate_loop(plan, lengths, where, resume=True),
        }
    return results


# -- torchdata StatefulDataLoader ---------------------------------------------------------------


def stateful_loop(
    plan: str, lengths, *, workers: int, stop_after: int | None = None, checkpoint: dict | None = None
) -> dict:
    """The plain loop over a StatefulDataLoader, checkpointing the loader's own state_dict."""
    from torch.nn.parallel import DistributedDataParallel
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = PlanSampler(plan)
    loader = StatefulDataLoader(
        PlanDataset(make_dataset(lengths)), batch_sampler=sampler, collate_fn=PackCollator(), num_workers=workers
    )
    model = make_model()
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        loader.load_state_dict(checkpoint["loader"])
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    seen, steps = [], 0
    while True:
        for batch in loader:
            seen.append(key(batch.record))
            if train_micro_batch(ddp, batch, optimizer):
                steps += 1
                if steps == stop_after:
                    state = {
                        "model": {k: v.clone() for k, v in model.state_dict().items()},
                        "loader": loader.state_dict(),
                    }
                    return {"seen": seen, "checkpoint": state}
        if sampler.finished:
            break
    return {"seen": seen, "params": params(model)}


def stateful_checks(plans: dict[str, str], lengths, out_dir: str, plain: dict[str, dict]) -> dict:
    results = {}
    for name, plan in plans.items():
        stop = _step_inside_last_epoch(plan)
        for workers in (0, 2):
            first = stateful_loop(plan, lengths, workers=workers, stop_after=stop)
            rest = stateful_loop(plan, lengths, workers=workers, checkpoint=first.pop("checkpoint"))
            results[(name, workers)] = {"plain": plain[name] if workers == 0 else None, "first": first, "rest": rest}
    return results


# -- every stack in one spawn -------------------------------------------------------------------


def _lightning_checks(plans: dict[str, str], lengths, out_dir: str, plain: dict[str, dict]) -> dict:
    from _lightning_worker import lightning_checks

    return lightning_checks(plans, lengths, out_dir, plain)


# Each stack: the modules it needs, and its checks, in the order `_mixture_training_worker` runs
# its paths in one process too (Lightning's fits last).
STACKS = {
    "torchdata": (("torchdata",), stateful_checks),
    "accelerate": (("accelerate",), accelerate_checks),
    "trainer": ((), partial(trainer_checks, "trainer")),
    "sft": (("trl",), partial(trainer_checks, "sft")),
    "lightning": (("lightning",), _lightning_checks),
}


def every_stack(rank: int, plans: dict[str, str], lengths, out_dir: str) -> None:
    """The plain loop once per plan, then each of `STACKS`' checks against it; saves
    ``{"plain": ..., stack: results | {"missing": module} | {"error": traceback}}``."""
    init_group()
    results: dict = {"plain": {name: plain_loop(plan, lengths) for name, plan in plans.items()}}
    for stack, (modules, checks) in STACKS.items():
        missing = [module for module in modules if importlib.util.find_spec(module) is None]
        if missing:
            results[stack] = {"missing": missing[0]}
            continue
        try:
            results[stack] = checks(plans, lengths, os.path.join(out_dir, stack), results["plain"])
        except Exception:  # noqa: BLE001 - the stack's tests report it
            results[stack] = {"error": traceback.format_exc()}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
