"""The optimizer and learning-rate schedule of `CausalLMModule`, and what a resumed run takes from its
checkpoint: the validation history and the schedule's horizon, while the config's `optimizer.*` settings win
over the checkpoint's (`optimizer.lr changed ... : applied`).
"""

import logging
import math
from functools import partial

import lightning as L
import torch
from torch import nn

log = logging.getLogger("train.module")  # the training module's lines, wherever they are written from


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1 over `warmup_steps`, then cosine decay to `min_lr_ratio`."""
    if step < warmup_steps:
        # (step + 1): the very first update already moves the weights
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class OptimizationHooks:
    """`CausalLMModule`'s Lightning hooks for the optimizer, its schedule and checkpoints (mixed in before
    `L.LightningModule`): reads `hparams.optimizer`, `model`, `val_at_start` and `val_history` of the module."""

    # ------------------------------------------------------------------------------------- optimization

    def configure_optimizers(self):
        hp = self.hparams.optimizer
        # No weight decay on embeddings (tied to the LM head in the tiny models), norm gains and biases:
        # decaying them only pulls useful scales towards zero.
        embedding_ids = {id(m.weight) for m in self.model.modules() if isinstance(m, nn.Embedding)}
        decay, no_decay = [], []
        for param in self.model.parameters():
            if param.requires_grad:
                (no_decay if param.ndim < 2 or id(param) in embedding_ids else decay).append(param)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hp["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hp["lr"],
            betas=tuple(hp["betas"]),
        )
        total_steps = int(self.trainer.estimated_stepping_batches)
        # The warm-up is not shortened to fit max_steps: the lr of step k then does not depend on max_steps
        # while k is in warm-up, so a run continued to a higher max_steps is the run that never stopped
        # (train.pretrain warns when max_steps ends inside the warm-up). warmup_steps=0 is no warm-up.
        schedule = partial(
            warmup_cosine,
            warmup_steps=max(1, hp["warmup_steps"]),
            total_steps=total_steps,
            min_lr_ratio=hp["min_lr_ratio"],
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------------------- checkpoints

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["val_at_start"] = self.val_at_start
        checkpoint["val_history"] = self.val_history
        # the horizon of the schedule the steps so far followed, for the note on resume
        checkpoint["max_steps"] = self.trainer.max_steps
        count_cut_epoch_as_unfinished(checkpoint, self.trainer)
        keep_train_loader_position(checkpoint, getattr(self, "_train_loader_states", None))
        log_steps_as_saved_in_fit(checkpoint, self.trainer)

    def on_train_end(self) -> None:
        # The train loader's position as fit leaves it: a validation after fit (train.pretrain's final one)
        # attaches the data anew and Lightning's fit loop forgets its loader before the final checkpoint.
        loader = self.trainer.train_dataloader
        self._train_loader_states = [loader.state_dict()] if hasattr(loader, "state_dict") else None

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.val_at_start = checkpoint.get("val_at_start")
        self.val_history = list(checkpoint.get("val_history", []))
        self._resumed_max_steps = checkpoint.get("max_steps")
        # Lightning restores the optimizer and schedule with the checkpoint's lr, betas and weight
        # decay after this hook; on_train_start replaces them with this run's.
        self._resumed_optimizer_settings = checkpoint.get("hyper_parameters", {}).get("optimizer")

    def on_train_start(self) -> None:
        if self._resumed_optimizer_settings is not None:
            self._apply_optimizer_settings(self._resumed_optimizer_settings)
            self._resumed_optimizer_settings = None
        saved, now = self._resumed_max_steps, self.trainer.max_steps
        if saved is not None and saved != now and self.trainer.is_global_zero:
            step, warmup = self.trainer.global_step, self.hparams.optimizer["warmup_steps"]
            past = (
                f"; steps {warmup}..{step - 1} already followed the decay towards step {saved}"
                if step > warmup
                else " (the steps so far were all warm-up, which does not depend on it)"
            )
            log.info(f"trainer.max_steps changed {saved} -> {now} on resume: the cosine decay now ends at step {now}{past}")
        self._resumed_max_steps = None

    def _apply_optimizer_settings(self, saved: dict) -> None:
        """Puts this run's `optimizer.*` settings into the optimizer and schedule restored from a
        checkpoint (trained with `saved`), so that a changed setting takes effect from the first step."""
        hp = self.hparams.optimizer
        optimizer = self.optimizers(use_pl_optimizer=False)
        scheduler = self.lr_schedulers()
        decay_group = optimizer.param_groups[0]  # the groups configure_optimizers built: decay, no decay
        decay_group["weight_decay"] = hp["weight_decay"]
        for group in optimizer.param_groups:
            group["betas"] = tuple(hp["betas"])
            group["initial_lr"] = hp["lr"]
        scheduler.base_lrs = [hp["lr"]] * len(optimizer.param_groups)
        # The lr of the coming step: the restored one was the checkpoint's lr at the checkpoint's
        # schedule. The schedule itself (warmup_steps, min_lr_ratio, max_steps) is already this run's:
        # configure_optimizers built it and LambdaLR does not save its function.
        for group, base_lr, schedule in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
            group["lr"] = base_lr * schedule(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        if self.trainer.is_global_zero:
            for key in sorted(hp):
                if key in saved and saved[key] != hp[key]:
                    log.info(f"optimizer.{key} changed {saved[key]} -> {hp[key]} on resume: applied")


def count_cut_epoch_as_unfinished(checkpoint: dict, trainer: L.Trainer) -> None:
    """A checkpoint written after fit stopped at `trainer.max_steps` in the middle of an epoch: saved as the
    middle of that epoch, the fit loop's state in every periodic checkpoint (epoch started, not processed).

    Lightning's FitLoop counts the epoch that max_steps cut short as processed and completed; a run continued
    from that state (a higher max_steps) would start the next epoch, reshuffled, skipping the rest of this
    one, while the same run never stopped goes on with this epoch's next batch. The train loader's own
    position (`ResumableDataLoader`, batches consumed) is in the checkpoint either way."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop")
    if not fit or trainer.max_steps is None or trainer.global_step < trainer.max_steps:
        return
    epoch, batches = fit["epoch_progress"], fit["epoch_loop.batch_progress"]["current"]
    current = epoch["current"]
    counted_done = current["ready"] == current["started"] == current["processed"] == current["completed"] > 0
    batches_left = batches["completed"] < trainer.num_training_batches
    if counted_done and batches_left:
        for progress in (epoch["total"], epoch["current"]):
            progress["processed"] -= 1
            progress["completed"] -= 1


def keep_train_loader_position(checkpoint: dict, states: list[dict] | None) -> None:
    """A checkpoint written after fit (the final one, after a validation outside fit) gets the train loader's
    position that fit ended at, where Lightning's fit loop no longer has a loader to ask: a run continued
    from it (a higher max_steps) then takes the next batch of the epoch, as the run that never stopped does."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop")
    if fit is None or not states or fit.get("state_dict", {}).get("combined_loader"):
        return
    fit.setdefault("state_dict", {})["combined_loader"] = states


def log_steps_as_saved_in_fit(checkpoint: dict, trainer: L.Trainer) -> None:
    """The loggers' step counter of a checkpoint written after fit, as a checkpoint written inside it has it.

    Inside fit, checkpoints are written at the end of a batch, before Lightning counts the batch for the
    loggers (`_batches_that_stepped` = global_step - 1), and a restart adds the one back. A checkpoint
    written after fit (the final one) holds the counter already advanced; restarted from it, every step
    would be logged one higher than in the run that never stopped."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop")
    state = (fit or {}).get("epoch_loop.state_dict")
    if state is not None and trainer.global_step > 0 and state.get("_batches_that_stepped") == trainer.global_step:
        state["_batches_that_stepped"] = trainer.global_step - 1
