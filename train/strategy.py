"""The one Lightning strategy of the zoo's parallel layouts: data x expert x sequence x tensor parallelism.

`ZooParallelStrategy(dp=, ep=, sp=, tp=)` is Lightning's `ModelParallelStrategy` (its launcher starts one
process per device, its `configure_model` hook, its process group with a finite timeout) with three
things of ours in place of Lightning's:

- the mesh: `parallel.init_mesh` builds the named 4-D ("dp", "ep", "sp", "tp") `DeviceMesh` over the
  process group Lightning started, instead of Lightning's 2-D ("data_parallel", "tensor_parallel") one;
  `CausalLMModule.configure_model` applies the architecture's `sharding.py` over it
  (`parallel.parallelize`). The dp x ep ranks see different batches (`distributed_sampler_kwargs`); the
  ranks of one sp or tp group share a batch (the sp layout splits its sequences itself).
- gradient synchronisation: the weights are plain tensors, not DTensors, and neither DDP nor FSDP2
  wraps them; after the backward of an optimizer step's last micro-batch, `optimizer_step` averages the
  gradients over the token dimensions with `parallel.grad_sync.sync_gradients` (its doc says which
  parameter over which dimension), before Lightning's `on_before_optimizer_step`, gradient unscaling
  checks and clipping see them.
- checkpoints: one file holding the UNSHARDED model and optimizer state (`parallel.state` gathers over
  every dimension the layout recorded and re-slices on load), so a run resumes exactly and its checkpoint
  also loads at any other degrees. They are written by the Trainer's CheckpointIO plugin
  (`train.callbacks.AtomicCheckpointIO`), like every other strategy's.

The process group's `timeout` (`parallel.timeout_s`): a rank that stops answering fails the collectives
of the others after that long instead of hanging them (under gloo a rank that dies fails them at once:
its sockets close). `train.pretrain` builds this strategy from `parallel.{dp,ep,sp,tp}` whenever one of
them is above 1.
"""

from datetime import timedelta
from pathlib import Path

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy

from parallel.grad_sync import sync_gradients
from parallel.mesh import init_mesh
from parallel.state import (
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    load_full_state_dict,
)


class ZooParallelStrategy(ModelParallelStrategy):
    def __init__(
        self,
        dp: int = 1,
        ep: int = 1,
        sp: int = 1,
        tp: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ):
        # Lightning's data/tensor-parallel sizes only size the mesh this class does not build.
        super().__init__(
            save_distributed_checkpoint=False, process_group_backend=process_group_backend, timeout=timeout
        )
        self.degrees = {"dp": dp, "ep": ep, "sp": sp, "tp": tp}

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
            sync_gradients(self.lightning_module, self.device_mesh)
            return loss

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    # --- unsharded checkpoints ---------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict:
        return full_state_dict(self.lightning_module)

    def optimizer_state(self, optimizer) -> dict:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return full_optimizer_state(self.lightning_module, optimizer)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = Path(self.broadcast(checkpoint_path))
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        load_full_state_dict(self.lightning_module, checkpoint["state_dict"])
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", []), strict=False):
            load_full_optimizer_state(self.lightning_module, optimizer, state)
        return checkpoint

