"""The one Lightning strategy of the zoo's parallel layouts: data x expert x sequence x tensor parallelism.

`ZooParallelStrategy(dp=, ep=, sp=, tp=)` is Lightning's `ModelParallelStrategy` (its launcher starts one
process per device, its `configure_model` hook, its process group with a finite timeout) with what is ours:

- the mesh: `parallel.init_mesh` builds the named 4-D ("dp", "ep", "sp", "tp") `DeviceMesh` over the
  process group Lightning started, instead of Lightning's 2-D ("data_parallel", "tensor_parallel") one;
  `CausalLMModule.configure_model` applies the architecture's `sharding.py` over it (`parallel.parallelize`)
  and then, with `fsdp=True` (the default), FSDP2 over the token dimensions (`parallel.fsdp.apply_fsdp`).
  The dp x ep ranks see different batches (`distributed_sampler_kwargs`); the ranks of one sp or tp group
  share a batch (the sp layout splits its sequences itself).
- gradients: under FSDP2 they are reduce-scattered during the backward by FSDP's own hooks; after the
  backward of an optimizer step's last micro-batch only the experts' get their 1/ep
  (`parallel.fsdp.scale_expert_gradients`). With `fsdp=False` (the replicated trainer, kept to compare
  against) the gradients are averaged after the backward by `parallel.grad_sync.sync_gradients`. Either
  way before Lightning's `on_before_optimizer_step`, unscaling checks and clipping see them.
- checkpoints: with `fsdp=True`, a torch.distributed.checkpoint directory behind a link
  (`train.sharded_checkpoint`): each rank writes its own shards of the model and the optimizer, shown to
  DCP with every cut that made them (`parallel.checkpoint`), so the checkpoint resumes at other dp / tp /
  ep / sp degrees; no rank ever holds the whole model or optimizer state. With `fsdp=False`, one file of
  the UNSHARDED state (`parallel.state` gathers it on every rank), written by the Trainer's CheckpointIO
  plugin (`train.callbacks.AtomicCheckpointIO`). Either format loads under either setting.

The process group's `timeout` (`parallel.timeout_s`): a rank that stops answering fails the collectives
of the others after that long instead of hanging them (under gloo a rank that dies fails them at once:
its sockets close). `train.pretrain` builds this strategy from `parallel.{dp,ep,sp,tp}` whenever one of
them is above 1, and to resume a sharded checkpoint in one process.
"""

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.tensor import DTensor

from models.checkpoint import nonfinite_counts
from parallel.checkpoint import (
    init_optimizer_state,
    load_full_optimizer,
    load_full_state,
    load_param_groups,
    model_views,
    optimizer_param_groups,
    optimizer_views,
)
from parallel.fsdp import scale_expert_gradients
from parallel.grad_sync import sync_gradients
from parallel.mesh import init_mesh
from parallel.state import (
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    load_full_state_dict,
)
from train import sharded_checkpoint
from train.checkpoint_space import tensor_bytes
from train.errors import TrainingError


class ZooParallelStrategy(ModelParallelStrategy):
    def __init__(
        self,
        dp: int = 1,
        ep: int = 1,
        sp: int = 1,
        tp: int = 1,
        fsdp: bool = True,
        reshard_after_forward: bool = True,
        param_dtype: str | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ):
        # Lightning's data/tensor-parallel sizes only size the mesh this class does not build.
        super().__init__(
            save_distributed_checkpoint=False, process_group_backend=process_group_backend, timeout=timeout
        )
        self.degrees = {"dp": dp, "ep": ep, "sp": sp, "tp": tp}
        # Read by CausalLMModule.configure_model, which applies FSDP2 with them.
        self.fsdp = fsdp
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype

    @property
    def num_data_ranks(self) -> int:
        """How many ranks see different batches: dp x ep."""
        return self.degrees["dp"] * self.degrees["ep"]

    def setup_environment(self) -> None:
        # ModelParallelStrategy.setup_environment with our mesh in place of its 2-D one: the process group
        # (rank, world size, backend, timeout) as Lightning starts it, then the mesh over it.
        # (init_mesh fails in one sentence if the degrees do not multiply to the world size.)
        self._setup_distributed()
        # Once per run: Lightning sets up again for every validate / fit, and the model keeps the groups of
        # the mesh it was sharded over.
        if self._device_mesh is None:
            self._device_mesh = init_mesh(**self.degrees, device_type=self.root_device.type)
        # what LightningModule.device_mesh returns, in configure_model and after
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict:
        # The ranks of one sp x tp block share a batch: the data rank is the coordinate in the dp x ep plane.
        mesh = self.device_mesh
        rank = mesh.get_local_rank("dp") * self.degrees["ep"] + mesh.get_local_rank("ep")
        return {"num_replicas": self.num_data_ranks, "rank": rank}

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        # Lightning calls this once per optimizer step (not for the micro-batches that only accumulate),
        # and the precision plugin runs `closure` (the last micro-batch's forward and backward) before its
        # own work on the gradients (unscaling, on_before_optimizer_step, clipping): sync right after it.
        def closure_then_sync():
            loss = closure()
            if self.fsdp:  # FSDP reduce-scattered during the backward; the experts lack their 1/ep
                scale_expert_gradients(self.lightning_module, self.degrees["ep"])
            else:
                sync_gradients(self.lightning_module, self.device_mesh)
            return loss

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    # --- checkpoints -------------------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict:
        if self.fsdp:  # this rank's shards, as DCP views: nothing gathered
            return model_views(self.lightning_module, self.device_mesh)
        return full_state_dict(self.lightning_module)

    def optimizer_state(self, optimizer) -> dict:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self.fsdp:
            return {
                "state": optimizer_views(self.lightning_module, optimizer, self.device_mesh),
                "param_groups": optimizer_param_groups(optimizer),
            }
        return full_optimizer_state(self.lightning_module, optimizer)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if not self.fsdp:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        link = Path(self.broadcast(str(filepath)))
        directory = Path(self.broadcast(str(sharded_checkpoint.new_directory(link))))
        tensors = {
            "state_dict": checkpoint.pop("state_dict"),
            "optimizer_states": [o["state"] for o in checkpoint.get("optimizer_states", [])],
        }
        checkpoint["optimizer_states"] = [{"param_groups": o["param_groups"]} for o in checkpoint.get("optimizer_states", [])]
        checkpoint["model_config"] = self.lightning_module.model.config.to_dict()
        checkpoint["nonfinite"] = self._nonfinite(tensors["state_dict"])
        checkpoint["sharded_degrees"] = dict(self.degrees)
        if self.is_global_zero:
            directory.mkdir(parents=True)
        self.barrier("sharded checkpoint directory")
        # a rank's failure is raised on every rank; rank 0 removes the directory
        needed = tensor_bytes(tensors) * self.world_size
        sharded_checkpoint.write(directory, tensors, checkpoint if self.is_global_zero else None, needed)
        if self.is_global_zero:
            sharded_checkpoint.swap_in(link, directory)
        self.barrier("sharded checkpoint saved")

    def _nonfinite(self, state: dict) -> list[tuple[str, int, int, int]]:
        """(name, NaN count, inf count, values) of the weights holding NaN or inf, over every rank's shards."""
        local = [(n, nan, inf, numel) for n, nan, inf, numel in nonfinite_counts(
            (name, t._local_tensor if isinstance(t, DTensor) else t) for name, t in state.items()
        )]
        found: list = [None] * self.world_size
        dist.all_gather_object(found, local)
        merged: dict[str, list[int]] = {}
        for rank_found in found:
            for name, nan, inf, numel in rank_found:
                merged.setdefault(name, [0, 0, 0])
                merged[name] = [a + b for a, b in zip(merged[name], (nan, inf, numel), strict=True)]
        return [(name, *counts) for name, counts in merged.items()]

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            sharded_checkpoint.remove(filepath)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = Path(self.broadcast(str(checkpoint_path)))
        if sharded_checkpoint.is_sharded(path):
            return self._load_sharded(path)
        # A one-file checkpoint (the replicated trainer's, or one process's): the unsharded state, sliced.
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        module, mesh = self.lightning_module, self.device_mesh
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        states = checkpoint.get("optimizer_states", [])
        if self.fsdp:
            load_full_state(module, mesh, checkpoint["state_dict"])
            for optimizer, state in zip(optimizers, states, strict=False):
                load_full_optimizer(module, optimizer, mesh, state)
        else:
            load_full_state_dict(module, checkpoint["state_dict"])
            for optimizer, state in zip(optimizers, states, strict=False):
                load_full_optimizer_state(module, optimizer, state)
        return checkpoint

    def _load_sharded(self, path: Path) -> dict:
        """Load a DCP checkpoint at this run's degrees, whatever degrees saved it: each rank reads the regions
        of the saved shards that its own views cover."""
        meta = sharded_checkpoint.read_meta(path)
        module, mesh = self.lightning_module, self.device_mesh
        try:  # every record read is checked against its CRC-32
            sharded_checkpoint.load({"state_dict": model_views(module, mesh)}, path)
            optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
            saved_groups = meta.get("optimizer_states", [])
            if optimizers and saved_groups:
                for optimizer in optimizers:
                    init_optimizer_state(optimizer)
                views = [optimizer_views(module, o, mesh) for o in optimizers]
                # Partial: a parameter whose state the saving run never created keeps the fresh (zero) state.
                planner = DefaultLoadPlanner(allow_partial_load=True)
                sharded_checkpoint.load({"optimizer_states": views}, path, planner=planner)
                for optimizer, saved in zip(optimizers, saved_groups, strict=False):
                    load_param_groups(optimizer, saved["param_groups"])
        except sharded_checkpoint.DamagedCheckpoint as error:
            others = sharded_checkpoint.loadable_siblings(path)
            older = f" ({others[0]} is the newest other one)" if others else ""
            raise TrainingError(
                f"Cannot resume: {error}; nothing of it is used. Resume from another checkpoint with "
                f"resume=<path>{older}, or start over with resume=never overwrite=true."
            ) from None
        return meta
