"""Lightning plugins and callbacks of the pretraining app, and its console log handler.

- `AtomicCheckpointIO`: checkpoints are written to `<name>.tmp` in the same directory, fsynced and
  renamed over `<name>`, so a crash while writing never leaves a `last.ckpt` that cannot be loaded
  (conf/trainer/default.yaml sets it as the Trainer's CheckpointIO plugin; every strategy, the
  tensor-parallel one included, saves through it).
- `StepProgressBar`: Rich's progress bar counting optimizer steps (`step 120/400`) instead of batches
  of `Epoch 0/-2`, since training length is `trainer.max_steps` (conf/callbacks/default.yaml).
- `LiveStdoutHandler`: the console handler of Hydra's job logging (conf/pretrain.yaml).
"""

import logging
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose `save_checkpoint` replaces the file only once the new one is complete.

    Lightning's own save stages the file in the system temp directory and moves it into place, which
    is a copy (interruptible halfway) when that directory is on another filesystem, and never fsyncs.
    Here the temp file sits next to the target, so `os.replace` is an atomic rename: a process killed
    at any point leaves either the previous checkpoint or the new one, plus at most a stale `.tmp` that
    the next save overwrites.
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options.")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            # on disk before the rename, or a power cut could leave the new name on an empty file
            os.fsync(file.fileno())
        os.replace(tmp, path)
        # and the rename itself on disk
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


class StepProgressBar(RichProgressBar):
    """The training bar shows `step <global_step>/<max_steps>`, and resumes where the run left off.

    Lightning's bar counts the batches of the current epoch out of the epoch's length and labels them
    `Epoch <n>/<max_epochs - 1>` (`Epoch 0/-2` with `max_epochs=-1`). Without `trainer.max_steps` (< 1)
    it falls back to that per-epoch bar.
    """

    def _counts_steps(self) -> bool:
        return self.trainer.max_steps is not None and self.trainer.max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._counts_steps() else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        if not self._counts_steps():
            return super()._get_train_description(current_epoch)
        # padded to the validation bar's description so the two bars line up
        return f"{'step':{len(self.validation_description)}}"

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self._counts_steps():
            self._update(self.train_progress_bar_id, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self._counts_steps():
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()


class LiveStdoutHandler(logging.StreamHandler):
    """A StreamHandler that writes to `sys.stdout` as it is at each record, not as it was at start-up.

    Rich's live progress bar redirects `sys.stdout` while it runs and prints what arrives there above
    the bar; a handler holding the original stream would write through the bar and garble it.
    """

    def __init__(self, stream=None) -> None:  # stream: Hydra's default console config passes one; unused
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass  # always the current sys.stdout
