"""Parallelism: meshes and process groups, communication (real / none / simulated link), TP layouts."""

from parallel import comm
from parallel.mesh import init_mesh, mesh_group
from parallel.tp import parallelize

__all__ = ["comm", "init_mesh", "mesh_group", "parallelize"]
