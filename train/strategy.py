"""Lightning strategy for the zoo's tensor parallelism.

`parallel.parallelize` shards weights as plain tensors (each rank holds its slice, the model's
forward communicates through `parallel.comm`). Lightning's `ModelParallelStrategy` provides the
process group, the ("data_parallel", "tensor_parallel") device mesh and the `configure_model` hook,
but its checkpoints only gather DTensors; this subclass makes a checkpoint hold the UNSHARDED model
and optimizer state in one file (gathered over the TP group, re-sliced on load), so a TP run resumes
exactly and its checkpoint also loads at any other TP degree.

The process group gets a finite `timeout` (conf/parallel: `parallel.timeout_s`): a rank that stops
answering fails the collectives of the others after that long instead of hanging them. (Under gloo a
rank that dies fails them at once: its sockets close.) Checkpoints are written by the Trainer's
CheckpointIO plugin (`train.callbacks.AtomicCheckpointIO`), like every other strategy's.
"""

from datetime import timedelta
from pathlib import Path

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy

from parallel.tp import full_optimizer_state, full_state_dict, load_full_optimizer_state, load_full_state_dict

TP_DIM = "tensor_parallel"  # the name ModelParallelStrategy gives the TP dimension of its mesh


class TensorParallelStrategy(ModelParallelStrategy):
    def __init__(
        self,
        tensor_parallel_size: int,
        data_parallel_size: int = 1,
        process_group_backend=None,
        timeout: timedelta | None = default_pg_timeout,
    ):
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=False,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    @property
    def tp_group(self):
        return self.device_mesh.get_group(TP_DIM)

    def _tp_rank_and_size(self) -> tuple[int, int]:
        return self.device_mesh.get_local_rank(TP_DIM), self.device_mesh.size(self.device_mesh.mesh_dim_names.index(TP_DIM))

    def lightning_module_state_dict(self) -> dict:
        return full_state_dict(self.lightning_module, self.tp_group)

    def optimizer_state(self, optimizer) -> dict:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return full_optimizer_state(self.lightning_module, optimizer, self.tp_group)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = Path(self.broadcast(checkpoint_path))
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        rank, tp = self._tp_rank_and_size()
        load_full_state_dict(self.lightning_module, checkpoint["state_dict"], rank, tp)
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", []), strict=False):
            load_full_optimizer_state(self.lightning_module, optimizer, state, rank, tp)
        return checkpoint
