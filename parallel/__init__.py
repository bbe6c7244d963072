"""Parallelism: meshes and process groups, communication (real / none / simulated link), shard layouts
(`parallel.layout`; the tensor-parallel roles in `parallel.tp`) and unsharded state (`parallel.state`)."""

from parallel import comm, tp  # noqa: F401 (importing tp registers the tensor-parallel roles)
from parallel.layout import MeshDim, ShardSpec, parallelize, register_role, shard_specs
from parallel.mesh import init_mesh, mesh_group

__all__ = [
    "MeshDim",
    "ShardSpec",
    "comm",
    "init_mesh",
    "mesh_group",
    "parallelize",
    "register_role",
    "shard_specs",
]
