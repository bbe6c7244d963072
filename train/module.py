"""The LightningModule that pretrains any zoo causal LM, and the callback that prints its perplexity.

`CausalLMModule` owns the Hugging Face model (built by name from `models.ZOO`), the optimizer and the
learning-rate schedule, and the metrics every pretraining run reports:

- per training step: `train/loss`, `train/lr`, `train/grad_norm` (before clipping), `train/tokens_per_s`,
  and the parts of the loss, each on its own: `train/lm_loss` (the language-model loss, comparable across
  architectures) and `train/aux/<name>` for each auxiliary loss the model returns (MoE:
  `train/aux/load_balance`, already weighted), so that `train/loss` = `train/lm_loss` + sum of the aux ones
- per validation: `val/loss` (token-weighted mean over the whole validation set, all ranks) and
  `val/ppl` = exp(`val/loss`).

After each optimizer step, a model with auxiliary-loss-free balancing routers (DeepSeek-V3's balance bias,
`router_balance_bias=true`) moves their biases by the step's expert loads, summed over the ranks that route
different tokens (`models.common.moe.update_balance_biases`); for any other model that is a no-op.

It also guards training: a non-finite loss or gradient stops the run (`nonfinite_loss=stop`, before the
update, so the last checkpoint holds good weights) or skips that update (`skip`); and on resume the
optimizer settings of the config win over the checkpoint's (`optimizer.lr changed ... : applied`).

Its parts of their own: the optimizer, its schedule and what a resumed run takes from its checkpoint
(train/optimization.py), the `parallel` settings (train/parallel_config.py) and the failures a run explains
in one line (train/errors.py); their names are imported from here too.
"""

import logging
import math
import time

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.distributed.fsdp import MixedPrecisionPolicy

import models
import parallel
from models.common.moe import TopKRouter, update_balance_biases
from models.llama.configuration import check_fields
from parallel.fsdp import apply_fsdp, is_fsdp
from parallel.grad_sync import TOKEN_DIMS, mesh_degrees
from parallel.mesh import DIM_ORDER
from parallel.overlap import check_overlap
from parallel.state import clip_grad_norm_ as sharded_clip_grad_norm_
from parallel.state import grad_norm as sharded_grad_norm
from train.activation_checkpointing import apply_activation_checkpointing, compile_layers
from train.data import next_token_targets
from train.errors import Interrupted, NonFiniteLossError, TrainingError, describe_nonfinite, nonfinite_tensors
from train.metrics import IGNORE_INDEX, summed_token_loss
from train.optimization import OptimizationHooks, warmup_cosine
from train.parallel_config import check_degrees, engine_settings, parallel_degrees

# This module's own names and, imported from here across train/ and the tests, those of the files it is built from.
__all__ = [
    "NONFINITE_POLICIES",
    "CausalLMModule",
    "Interrupted",
    "NonFiniteLossError",
    "PrintValPerplexity",
    "TrainingError",
    "check_degrees",
    "describe_nonfinite",
    "engine_settings",
    "nonfinite_tensors",
    "parallel_degrees",
    "warmup_cosine",
]

NONFINITE_POLICIES = ("stop", "skip")

log = logging.getLogger(__name__)


class CausalLMModule(OptimizationHooks, L.LightningModule):
    """Next-token-prediction training of `models.build_model(model_name, vocab_size=..., **model_config)`.

    Args:
        model_name: an architecture in `models.ZOO` (e.g. "llama").
        model_config: keyword arguments of that architecture's config (hidden_size, ...).
        vocab_size: the tokenizer's vocabulary size.
        optimizer: lr, betas, weight_decay, warmup_steps, min_lr_ratio.
        parallel: the parallel layout (conf/parallel): the degrees `dp`, `ep`, `sp`, `tp` (and
            `timeout_s`, read by train.pretrain). Under `train.strategy.ZooParallelStrategy`
            `configure_model` shards the model over the strategy's mesh of these degrees.
        init_from: an HF checkpoint directory to start from (e.g. a converted Ladder model); the model's
            config then comes from that checkpoint and `model_config` must be empty or agree with it.
        nonfinite_loss: `stop` (raise `NonFiniteLossError` before the step's update) or `skip` (leave
            the weights and optimizer state as they are for that step) when the loss or the gradient
            norm is NaN or infinite.
        activation_checkpointing: `none`, `full` or `selective` (train/activation_checkpointing.py), applied
            in `configure_model` after the layout; `compile`: each decoder layer compiled in place.
    """

    def __init__(
        self,
        model_name: str,
        model_config: dict,
        vocab_size: int,
        optimizer: dict,
        parallel: dict | None = None,
        init_from: str | None = None,
        nonfinite_loss: str = "stop",
        activation_checkpointing: str = "none",
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.degrees = parallel_degrees(parallel)
        # The system-level overlap schedule (parallel/overlap.py), refused here if the architecture does not take it.
        self.overlap = (parallel or {}).get("overlap", "none")
        residual = "ladder" if models.standard_sibling(model_name) else model_config.get("residual", "standard")
        check_overlap(models.get(model_name).model_class, self.overlap, residual)
        if nonfinite_loss not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite_loss={nonfinite_loss!r}; use one of {NONFINITE_POLICIES}.")
        # The embedding must hold every id the tokenizer gives; a larger one (a padded vocabulary) is kept.
        embedding = model_config.get("vocab_size")
        if embedding is not None and embedding < vocab_size:
            raise ValueError(
                f"model.config.vocab_size={embedding} cannot hold the {vocab_size} token ids of the tokenizer "
                f"(data.tokenizer); drop model.config.vocab_size (the tokenizer's is taken) or give >= {vocab_size}."
            )
        if embedding is not None:
            model_config = {k: v for k, v in model_config.items() if k != "vocab_size"}
            vocab_size = embedding
        # Plain values only, so checkpoints and loggers record exactly what built the model.
        self.save_hyperparameters()
        if init_from:
            # from_pretrained returns the model in eval mode; Lightning switches modes per loop, but
            # starts fit from the mode it finds.
            self.model = models.get(model_name).model_class.from_pretrained(init_from).train()
            config = self.model.config
            if config.vocab_size < vocab_size:
                raise ValueError(
                    f"init_from={init_from} has an embedding of {config.vocab_size} token ids, fewer than the "
                    f"{vocab_size} of the tokenizer (data.tokenizer); train with the tokenizer it was made with "
                    f"(data.tokenizer={init_from})."
                )
            # A field the architecture does not know (a typo in model.config) is refused, as on every other path.
            check_fields(type(config), model_config)
            differ = {k: v for k, v in {**model_config, "vocab_size": vocab_size}.items() if getattr(config, k, v) != v}
            if differ:
                raise ValueError(
                    f"init_from={init_from} has a config that differs from the requested model in {differ}; "
                    f"its values are {({k: getattr(config, k) for k in differ})}."
                )
            # Training from NaN weights only ever gives NaN losses, whatever the optimizer settings.
            bad = nonfinite_tensors(self.model.state_dict())
            if bad:
                raise TrainingError(
                    f"Cannot train from init_from={init_from}: its weights hold non-finite values ({'; '.join(bad)}); "
                    "training from them gives NaN losses whatever optimizer.lr is. Start from a checkpoint "
                    "saved before they went bad, or convert / export it again."
                )
        else:
            self.model = models.build_model(model_name, vocab_size=vocab_size, **model_config)
        check_degrees(model_name, self.model.config, self.degrees)
        # Counted now, while every rank still holds the whole model (configure_model shards it later);
        # parameters() counts tied weights once.
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        # {"loss": ..., "ppl": ...} of the validation before any training; kept in checkpoints so that a
        # resumed run can still report it.
        self.val_at_start: dict | None = None
        # (global_step, val/loss, val/ppl) of every validation, for the summary at the end.
        self.val_history: list[tuple[int, float, float]] = []
        self._step_clock: float | None = None
        self._val_loss_sum: torch.Tensor | None = None
        self._val_tokens: torch.Tensor | None = None
        # the checkpoint's optimizer settings while resuming, until on_train_start applies ours
        self._resumed_optimizer_settings: dict | None = None
        self._resumed_max_steps: int | None = None  # the checkpoint's trainer.max_steps, for on_train_start's note
        self._skip_update = False  # set by a skipped training_step for on_before_optimizer_step
        self._layout_applied = False
        self._sp_group = None  # the sequence-parallel group (configure_model), whose ranks split each sequence
        self._balance_bias: bool | None = None  # whether any router has a balance bias (_has_balance_bias)

    def configure_model(self) -> None:
        # Lightning calls this on every rank once the process group and the device mesh exist, before
        # the optimizer is built or a checkpoint is loaded, and again on every validate/fit: the
        # layout is applied once. Every rank built the full model from the same seed, so the shards
        # are slices of the very model a one-process run would train.
        if self._layout_applied:
            return
        mesh = self.device_mesh  # ZooParallelStrategy's; None under any other strategy
        if mesh is None and any(self.degrees[d] > 1 for d in DIM_ORDER):
            raise ValueError(
                f"parallel degrees {self.degrees} need train.strategy.ZooParallelStrategy (train.pretrain "
                f"sets it), not {type(self.trainer.strategy).__name__}."
            )
        if mesh is not None:
            if mesh_degrees(mesh) != self.degrees:
                raise ValueError(f"The strategy's mesh has degrees {mesh_degrees(mesh)} but parallel says {self.degrees}.")
            parallel.parallelize(self.model, mesh)
            self._sp_group = parallel.mesh_group(mesh, "sp") if self.degrees["sp"] > 1 else None
        parallel.set_overlap(self.model, self.overlap)  # before compile: the schedule is part of what is traced
        # torchtitan's order: the layout, activation checkpointing, compile, FSDP (in place, no wrapper modules:
        # parameter names and ShardSpecs stay as they are; train/activation_checkpointing.py).
        apply_activation_checkpointing(self.model, self.hparams.activation_checkpointing)
        if self.hparams.compile:
            compile_layers(self.model)
        strategy = self.trainer.strategy
        if mesh is not None and getattr(strategy, "fsdp", False):
            # FSDP2 over the token dimensions, one unit per decoder layer (parallel/fsdp.py), after the
            # layout: parameters, gradients and optimizer state sharded over the data ranks.
            dtype = strategy.param_dtype
            policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32) if dtype else None
            apply_fsdp(self.model, mesh, self.model.model, strategy.reshard_after_forward, policy)
        self._layout_applied = True

    @property
    def sharded(self) -> bool:
        """Whether gradients, norms and state go through `parallel.state` (under ZooParallelStrategy)."""
        return self.device_mesh is not None

    # ----------------------------------------------------------------------------------------- training

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        input_ids = batch["input_ids"]
        labels = batch.get("labels", input_ids)
        if self._sp_group is not None:
            input_ids, labels, loss_kwargs = self._sequence_chunk(input_ids, labels)
            output = self.model(input_ids=input_ids, labels=labels, use_cache=False, **loss_kwargs)
        else:
            output = self.model(input_ids=input_ids, labels=labels, use_cache=False)
        loss = output.loss
        mean_loss, nonfinite, mean_parts = self._across_ranks(loss, self._loss_parts(output))
        # The loss of the global batch: the mean over ranks of their batches' (every rank's batch has the
        # same number of tokens). Logged even when skipped (nan): a metric not logged at a step repeats
        # its previous value.
        self.log("train/loss", mean_loss, on_step=True, on_epoch=False, prog_bar=True)
        for name, value in mean_parts.items():
            self.log(name, value, on_step=True, on_epoch=False)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], on_step=True, on_epoch=False)
        if nonfinite:
            self._nonfinite(f"train/loss is {loss.item()}")
            # skip: a zero loss that reaches every parameter, so that backward (and the gradient
            # all-reduce that follows it) runs as on any step on every rank (Lightning refuses a None loss when
            # distributed); on_before_optimizer_step then drops the update.
            self._skip_update = True
            if is_fsdp(self.model):  # FSDP's backward hooks (its reduce-scatters) run along the loss's graph
                return loss * 0.0
            return sum(p.sum() for p in self.parameters()) * 0.0
        return loss

    def _sequence_chunk(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple:
        """Sequence parallelism: (this rank's chunk of the inputs, of the next-token targets, the model's loss
        arguments). Every rank of the sp group holds the whole batch; rank r keeps tokens [r*N/P, (r+1)*N/P).
        The targets are shifted over the whole sequence BEFORE splitting (a chunk's last position predicts
        the next chunk's first token; the sequence's last predicts nothing), so the loss does not shift them
        again (`shift_labels`). Each rank's loss is its targets' summed loss over (targets in the whole batch
        / P): the mean over the sp ranks, which the logged loss and parallel.grad_sync take, is then the
        loss of the whole sequences, as one process computes it."""
        group = self._sp_group
        targets = next_token_targets(labels)
        chunk = parallel.sequence.split_sequence(targets, group)
        num_targets = (targets != IGNORE_INDEX).sum() / self.degrees["sp"]
        loss_kwargs = {"shift_labels": chunk, "num_items_in_batch": num_targets}
        return parallel.sequence.split_sequence(input_ids, group), chunk, loss_kwargs

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Called after backward and the gradient synchronisation (DDP's all-reduce, or
        # ZooParallelStrategy's sync_gradients) and before clipping, so this is the norm of the full,
        # unclipped gradient. (With shards each rank holds only part of the gradient: parallel.state
        # reduces the norm over the dimensions each parameter is sharded on.) The norm is the same on
        # every rank, so is the decision about a non-finite one.
        if self._skip_update:
            self._skip_update = False
            self._drop_gradients()
            self.log("train/grad_norm", math.nan, on_step=True, on_epoch=False)  # none was computed
            return
        if self.sharded:
            norm = sharded_grad_norm(self.model)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None])
        self.log("train/grad_norm", norm, on_step=True, on_epoch=False)
        # Under fp16 mixed precision an infinite gradient is routine: the grad scaler skips that step
        # and lowers its scale.
        if not torch.isfinite(norm) and getattr(self.trainer.precision_plugin, "scaler", None) is None:
            self._nonfinite(f"the gradient norm is {norm.item()}")
            self._drop_gradients()

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        # Lightning calls this once per optimizer step (after the last micro-batch under gradient
        # accumulation); the routers counted their tokens in every micro-batch of the step.
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self._has_balance_bias:
            update_balance_biases(self.model, groups=self._token_groups())

    @property
    def _has_balance_bias(self) -> bool:
        if self._balance_bias is None:  # once: the model's routers do not change
            self._balance_bias = any(isinstance(m, TopKRouter) and m.balance_bias for m in self.model.modules())
        return self._balance_bias

    def _token_groups(self) -> tuple:
        """The process groups whose ranks route different tokens through replicas of the same router
        (dp, ep, sp above 1): their expert loads are summed before the biases move, so every replica moves
        alike and as one process would. Not tp: tp ranks route the same tokens."""
        mesh = self.device_mesh
        if mesh is None:
            return ()
        return tuple(mesh.get_group(d) for d in TOKEN_DIMS if self.degrees[d] > 1)

    def _drop_gradients(self) -> None:
        # AdamW leaves a parameter without a gradient as it is (no moment update, no weight decay);
        # the step still counts (global_step and the lr schedule move on).
        for p in self.parameters():
            p.grad = None

    @staticmethod
    def _loss_parts(output) -> dict[str, torch.Tensor]:
        """The parts of the training loss, by metric name: `train/lm_loss` and `train/aux/<name>` (zoo
        outputs carry `lm_loss` and `aux_losses`; another model's output has neither)."""
        parts = {}
        if getattr(output, "lm_loss", None) is not None:
            parts["train/lm_loss"] = output.lm_loss
        for name, value in sorted((getattr(output, "aux_losses", None) or {}).items()):
            parts[f"train/aux/{name}"] = value
        return parts

    def _across_ranks(
        self, loss: torch.Tensor, parts: dict[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, bool, dict[str, torch.Tensor]]:
        """(the mean of every rank's loss, whether any rank's is NaN or infinite, the mean of each of
        `parts`): one all-reduce of a few numbers. Ranks that share a batch (tp, sp) count alike, so the
        mean over all ranks is the mean over the distinct batches. Every rank runs the same model, so
        every rank has the same parts."""
        loss = loss.detach()
        parts = {name: value.detach().float() for name, value in (parts or {}).items()}
        if self.trainer.world_size == 1:
            return loss, not bool(torch.isfinite(loss)), parts
        # Data-parallel ranks see other batches: all must skip or stop together, or the others would
        # wait for this rank's gradients in the gradient all-reduce.
        totals = torch.stack([loss.float(), (~torch.isfinite(loss)).float(), *parts.values()])
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        means = dict(zip(parts, totals[2:] / self.trainer.world_size, strict=True))
        return totals[0] / self.trainer.world_size, bool(totals[1] > 0), means

    def _nonfinite(self, what: str) -> None:
        """Stops (raises) or, with `nonfinite_loss=skip`, reports the step that the caller then skips."""
        step = self.trainer.global_step
        if self.hparams.nonfinite_loss == "skip":
            if self.trainer.is_global_zero:
                log.warning(f"step {step}: {what}; skipped this update (nonfinite_loss=skip)")
            return
        where = " (on this or another rank)" if self.trainer.world_size > 1 else ""
        checkpoint = getattr(self.trainer.checkpoint_callback, "last_model_path", "") or ""
        kept = f"; the last checkpoint, {checkpoint}, is untouched" if checkpoint else ""
        raise NonFiniteLossError(
            f"Training stopped at step {step}: {what}{where}{kept}. Lower optimizer.lr "
            f"(now {self.hparams.optimizer['lr']}) or trainer.gradient_clip_val and resume, or set "
            "nonfinite_loss=skip to skip such steps."
        )

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.sharded and gradient_clip_val:
            # The norm must be taken over the whole (sharded) gradient, or ranks would clip differently.
            if gradient_clip_algorithm not in (None, "norm"):
                raise ValueError(
                    f"gradient_clip_algorithm={gradient_clip_algorithm!r} is not supported under "
                    "ZooParallelStrategy; use 'norm'."
                )
            sharded_clip_grad_norm_(self.model, gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        if self._step_clock is None:
            self._step_clock = time.perf_counter()

    def on_train_batch_end(self, outputs, batch: dict, batch_idx: int) -> None:
        # Wall time from the end of the previous batch (data loading included); validation resets the
        # clock so its time is not charged to training. Every rank gets a batch of the same shape.
        now = time.perf_counter()
        seconds = now - self._step_clock
        self._step_clock = now
        # Global tokens: the ranks that see different batches (dp x ep under ZooParallelStrategy, every
        # rank under DDP) each had one of this shape; the ranks of an sp or tp group share theirs.
        replicas = (self.trainer.distributed_sampler_kwargs or {}).get("num_replicas", 1)
        tokens = batch["input_ids"].numel() * replicas
        self.log("train/tokens_per_s", tokens / max(seconds, 1e-9), on_step=True, on_epoch=False)

    # --------------------------------------------------------------------------------------- validation

    def on_validation_epoch_start(self) -> None:
        self._step_clock = None
        self._val_loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._val_tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        # With a mixture of sources (LMDataModule's source_names), (loss sum, tokens) of each source too.
        names = getattr(getattr(self.trainer, "datamodule", None), "source_names", None) or []
        self._val_source_names = list(names) if len(names) > 1 else []
        self._val_per_source = torch.zeros(len(self._val_source_names), 2, dtype=torch.float64, device=self.device)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        input_ids = batch["input_ids"]
        labels = batch.get("labels", input_ids)
        shifted = self._sp_group is not None
        if shifted:
            input_ids, labels, _ = self._sequence_chunk(input_ids, labels)
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        # Summed token losses (not the batch mean), so the final mean weights every token equally
        # whatever the batch sizes and however many labels are masked; the same loss as eval's. Under
        # sequence parallelism each rank sums its chunk's and on_validation_epoch_end adds the ranks up.
        sources = batch.get("source")
        if not self._val_source_names or sources is None:
            loss_sum, tokens = summed_token_loss(logits, labels, shifted=shifted)
            self._val_loss_sum += loss_sum.double()
            self._val_tokens += tokens
            return
        # A mixture: each source's rows summed apart (the total is their sum, each token counted once).
        for source in sources.unique().tolist():
            rows = sources == source
            part_sum, part_tokens = summed_token_loss(logits[rows], labels[rows], shifted=shifted)
            self._val_per_source[source, 0] += part_sum.double()
            self._val_per_source[source, 1] += part_tokens
            self._val_loss_sum += part_sum.double()
            self._val_tokens += part_tokens

    def on_validation_epoch_end(self) -> None:
        totals = self.trainer.strategy.reduce(
            torch.stack([self._val_loss_sum, self._val_tokens]), reduce_op="sum"
        )
        loss = (totals[0] / totals[1].clamp(min=1)).item()
        ppl = math.exp(min(loss, 100.0))  # capped so an untrained, diverged model does not print inf
        # Every rank already holds the same totals; sync_dist only averages identical values (one tiny
        # all-reduce per validation) and keeps Lightning from warning that epoch metrics are unsynced.
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", ppl, sync_dist=True)
        if self._val_source_names:
            per_source = self.trainer.strategy.reduce(self._val_per_source, reduce_op="sum")
            for name, (loss_sum, tokens) in zip(self._val_source_names, per_source.tolist(), strict=True):
                if tokens > 0:  # a source the validation batches did not reach (limit_val_batches) is not logged
                    self.log(f"val/loss/{name}", loss_sum / tokens, sync_dist=True)
        if not self.trainer.sanity_checking:
            self.val_history.append((self.trainer.global_step, loss, ppl))


class PrintValPerplexity(L.Callback):
    """Logs one line after every validation: the step, `val/loss` and `val/ppl` (rank 0)."""

    @rank_zero_only
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or "val/ppl" not in trainer.callback_metrics:
            return
        loss = float(trainer.callback_metrics["val/loss"])
        ppl = float(trainer.callback_metrics["val/ppl"])
        per_source = "".join(
            f"  {key} {float(value):.4f}" for key, value in trainer.callback_metrics.items() if key.startswith("val/loss/")
        )
        log.info(f"[val] step {trainer.global_step:>6d}  val/loss {loss:.4f}  val/ppl {ppl:.2f}{per_source}")
