"""Lightning plugins and callbacks of the pretraining app, and its console log handler.

- `AtomicCheckpointIO`: checkpoints are written to `<name>.tmp` in the same directory, fsynced and
  renamed over `<name>`, so a crash while writing never leaves a `last.ckpt` that cannot be loaded
  (conf/trainer/default.yaml sets it as the Trainer's CheckpointIO plugin; every strategy, the
  tensor-parallel one included, saves through it).
- `StepProgressBar`: Rich's progress bar counting optimizer steps (`step 120/400`) instead of batches
  of `Epoch 0/-2`, since training length is `trainer.max_steps` (conf/callbacks/default.yaml).
- `LiveStdoutHandler`: the console handler of Hydra's job logging (conf/pretrain.yaml).
- `StopOnSigterm`: SIGTERM during fit writes the checkpoint at the end of the current step and ends the run
  with exit status 143 (train.pretrain adds it to every run).
- `StallNotice`: in a multi-process run, one line when no batch has finished for a while, saying what is
  waited for and when the wait gives up (train.pretrain adds it to every run; a no-op in one process).
"""

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.plugins.io import TorchCheckpointIO

from train.checkpoint_space import tensor_bytes, write_failed
from train.module import Interrupted

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose `save_checkpoint` replaces the file only once the new one is complete.

    Lightning's own save stages the file in the system temp directory and moves it into place, which
    is a copy (interruptible halfway) when that directory is on another filesystem, and never fsyncs.
    Here the temp file sits next to the target, so `os.replace` is an atomic rename: a process killed
    at any point leaves either the previous checkpoint or the new one, plus at most a stale `.tmp` that
    the next save overwrites. A write that fails (a full disk) removes its `.tmp` and says so in one line
    (train.checkpoint_space).
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options.")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                # on disk before the rename, or a power cut could leave the new name on an empty file
                os.fsync(file.fileno())
        except (OSError, RuntimeError) as error:  # a full disk: torch.save's RuntimeError follows the OSError
            tmp.unlink(missing_ok=True)
            raise write_failed(path, error, tensor_bytes(checkpoint)) from error
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


class StopOnSigterm(L.Callback):
    """SIGTERM during `fit`: the current optimizer step finishes, `path` (last.ckpt) is written, and the run
    raises `Interrupted` (exit status 143), on every rank at the same step.

    Lightning's own handling raises `SIGTERMException`, a SystemExit with status 0 (a scheduler reads success),
    writes no checkpoint, and decides per rank, so that ranks signalled at slightly different moments stop at
    different steps. Here the handler only notes the signal; at the end of each optimizer step the ranks agree
    whether any of them got it (one small all-reduce, only with several processes) and all stop there, at the
    point where ModelCheckpoint writes its periodic checkpoints, which resume exactly. The handler is this
    callback's from the start of training to its end; Lightning's is restored after that (step-0 and final
    validations stop as Lightning does, and train.pretrain reports what is on disk).
    """

    def __init__(self, path: str | Path, resume_hint: str = "") -> None:
        self.path = Path(path)
        self.resume_hint = resume_hint
        self._received = False
        self._previous = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._received = False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame) -> None:
        self._received = True
        log.info("Received SIGTERM: stopping after this step, once its checkpoint is written.")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # Only where an optimizer step ended (not between the micro-batches of gradient accumulation).
        if (trainer.fit_loop.total_batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        stop = self._received
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop:
            return
        if trainer.fast_dev_run:
            raise Interrupted(f"Stopped by SIGTERM at step {trainer.global_step} (fast_dev_run: no checkpoint).")
        trainer.save_checkpoint(self.path)
        raise Interrupted(
            f"Stopped by SIGTERM at step {trainer.global_step}, after writing {self.path}{self.resume_hint} "
            "(exit status 143)."
        )

    def teardown(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
        self._previous = None


class StallNotice(L.Callback):
    """With several processes: when rank 0 has finished no batch for `after_s` seconds, one line saying that it
    is waiting for the other ranks and when that wait gives up (`timeout_s`, the process group's timeout,
    `parallel.timeout_s`). A rank that was stopped (SIGSTOP, a debugger, a hung device) otherwise leaves
    the others silent until the timeout, 5 minutes by default. One line per stall; a legitimately long step
    (a first compilation, a large checkpoint) prints it too, which is harmless."""

    def __init__(self, timeout_s: float | None, after_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        # never later than half the timeout, so that the line comes before the failure
        self.after_s = min(after_s, timeout_s / 2) if timeout_s else after_s
        self._last = time.monotonic()
        self._step = 0
        self._noticed = False
        self._stop: threading.Event | None = None

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if trainer.world_size == 1 or not trainer.is_global_zero or self._stop is not None:
            return
        self._beat(trainer)
        self._stop = threading.Event()
        threading.Thread(target=self._watch, args=(self._stop,), daemon=True, name="stall-notice").start()

    def teardown(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None

    def _beat(self, trainer: L.Trainer) -> None:
        self._last, self._step, self._noticed = time.monotonic(), trainer.global_step, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._beat(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._beat(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._beat(trainer)

    def _watch(self, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            idle = time.monotonic() - self._last
            if idle >= self.after_s and not self._noticed:
                self._noticed = True
                gives_up = (
                    f"a collective gives up after parallel.timeout_s={self.timeout_s:g} s and the run then fails"
                    if self.timeout_s
                    else "there is no timeout"
                )
                log.warning(
                    f"Rank 0 has finished no batch for {self.after_s:g} s (at step {self._step}): it is waiting for the "
                    f"other ranks in a collective; if one of them stopped or hung, {gives_up}."
                )
