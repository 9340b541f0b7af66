"""What each process of the Lightning test runs (2 real processes, gloo on CPU), as the last
stack of `_integration_worker.every_stack`.

Each rank gets ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK``/``LOCAL_RANK``
from `_spawn.launch`, so Lightning's DDP strategy finds the processes already
started (it launches none) and joins the process group the plain loop made. For
each plan it runs a full Lightning fit, a fit stopped inside epoch 2 with a
checkpoint, and a fit resumed from that checkpoint (2 loader workers for the pack
plan), logging what every ``training_step`` trained; the plain loop's run of the
plan comes in as the reference.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _integration_worker import LR, _step_inside_last_epoch, key, make_dataset, make_model, params

from batchplan.formats.opening import open_plan
from batchplan.runtime import PlanSampler, token_loss_sum


def module_class():
    import lightning.pytorch as pl

    from batchplan.integrations.lightning import plan_backward, plan_loss

    class PlanLM(pl.LightningModule):
        """The tiny Llama; logs what each training_step trained."""

        def __init__(self, manual: bool) -> None:
            super().__init__()
            self.model = make_model()
            self.automatic_optimization = not manual
            self.seen: list = []

        def training_step(self, batch, batch_idx):
            self.seen.append(key(batch.record))
            loss_sum = token_loss_sum(self.model(**batch), batch)
            if self.automatic_optimization:
                return plan_loss(loss_sum, batch, self.trainer)
            optimizer = self.optimizers()
            if plan_backward(self, loss_sum, batch):
                optimizer.step()
                optimizer.zero_grad()
            return None

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=LR)

    return PlanLM


def make_trainer(out: str, *, manual: bool, micro: int, max_steps: int = -1, save_every: int | None = None, **extra):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    callbacks = []
    if save_every:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(
            ModelCheckpoint(
                dirpath=out,
                filename="resume",
                every_n_train_steps=save_every,
                save_top_k=-1,
                enable_version_counter=False,
            )
        )
    options = dict(
        accelerator="cpu",
        devices=dist.get_world_size(),
        num_nodes=1,
        strategy=DDPStrategy(process_group_backend="gloo"),
        use_distributed_sampler=False,
        max_epochs=2,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(save_every),
        callbacks=callbacks,
        num_sanity_val_steps=0,
        default_root_dir=out,
        accumulate_grad_batches=1 if manual else micro,
    )
    options.update(extra)
    return pl.Trainer(**options)


def run_lightning(
    plan: str,
    lengths,
    out: str,
    *,
    manual: bool,
    max_steps: int = -1,
    save_every=None,
    resume=None,
    workers: int = 0,
    **extra,
) -> dict:
    from batchplan.integrations.lightning import PlanDataModule

    micro = 1 if manual else open_plan(plan).metadata["config"]["micro_batches"]
    module = module_class()(manual)
    data = PlanDataModule(plan, make_dataset(lengths), num_workers=workers)
    trainer = make_trainer(out, manual=manual, micro=micro, max_steps=max_steps, save_every=save_every, **extra)
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    return {"seen": module.seen, "params": params(module.model), "global_step": trainer.global_step}


def lightning_checks(plans: dict[str, str], lengths, out_dir: str, plain: dict[str, dict]) -> dict:
    results = {}
    for name, plan in plans.items():
        manual = name == "tokens"
        where = os.path.join(out_dir, f"lightning-{name}")
        results[name] = {"plain": plain[name], "full": run_lightning(plan, lengths, where, manual=manual)}
        stop = _step_inside_last_epoch(plan)
        first = run_lightning(plan, lengths, where + "-first", manual=manual, max_steps=stop, save_every=stop)
        rest = run_lightning(
            plan,
            lengths,
            where + "-rest",
            manual=manual,
            resume=f"{where}-first/resume.ckpt",
            workers=2 if name == "pack" else 0,
        )
        results[name].update(first=first, rest=rest, stop=stop)
        end = PlanSampler(plan, rank=0, world_size=dist.get_world_size()).steps_per_epoch[0]
        first = run_lightning(plan, lengths, where + "-end", manual=manual, max_steps=end, save_every=end)
        rest = run_lightning(plan, lengths, where + "-end-rest", manual=manual, resume=f"{where}-end/resume.ckpt")
        results[name].update(first_at_end=first, rest_after_end=rest, end=end)
    results["reload"] = run_lightning(
        plans["pack"], lengths, os.path.join(out_dir, "reload"), manual=False, reload_dataloaders_every_n_epochs=1
    )
    results["replaced_sampler"] = replaced_sampler_error(plans["pack"], lengths, os.path.join(out_dir, "replaced"))
    return results


def replaced_sampler_error(plan: str, lengths, out: str) -> str:
    """The error a fit with Lightning's default ``use_distributed_sampler=True`` raises."""
    from batchplan.errors import ConfigError

    try:
        run_lightning(plan, lengths, out, manual=False, use_distributed_sampler=True)
    except ConfigError as error:
        return str(error)
    return "no error"
