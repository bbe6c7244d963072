"""Parallelism: meshes and process groups, communication (real / none / simulated link), shard layouts
(`parallel.layout`; the tensor-parallel roles in `parallel.tp`, the expert-parallel ones in `parallel.ep`),
sequence-parallel attention (`parallel.sequence`: LASP-2, LASP-2H and the ring baselines), system-level overlap
schedules (`parallel.overlap`) and unsharded state (`parallel.state`)."""

from parallel import comm, ep, sequence, tp  # noqa: F401 (importing tp and ep registers their shard roles)
from parallel.layout import MeshDim, ShardSpec, parallelize, register_role, shard_specs
from parallel.mesh import init_mesh, mesh_group
from parallel.overlap import SCHEDULES, check_overlap, set_overlap

__all__ = [
    "SCHEDULES",
    "MeshDim",
    "ShardSpec",
    "comm",
    "check_overlap",
    "init_mesh",
    "mesh_group",
    "parallelize",
    "register_role",
    "sequence",
    "set_overlap",
    "shard_specs",
]
