"""Process groups and the named `DeviceMesh` every parallel layout is applied over.

`init_mesh(tp=2)` inside torchrun (or with explicit `rank`/`world_size`) starts the default process
group (gloo on CPU, nccl on CUDA) and returns a mesh with named dimensions ("dp", "ep", "sp", "tp",
outermost first). `init_mesh(tp=4, fake=True)` builds a real 4-way mesh in ONE process on PyTorch's
fake process group: the simulated-link bench plays rank 0 of it (or `rank`).

Every process group of a mesh dimension remembers its dimension name (`group_dim`), so the simulated
link can time a collective on that dimension's link (`parallel.comm.set_mode("simulated",
link={"tp": ..., "ep": ...})`). Groups built elsewhere can be named with `name_group`.
"""

import math
import os
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIM_ORDER = ("dp", "ep", "sp", "tp")

# Process group -> mesh dimension name. Weak keys: a destroyed group's entry goes with it.
_GROUP_DIMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def name_group(group, dim: str) -> None:
    """Remember that `group` spans mesh dimension `dim` (init_mesh and mesh_group do this for theirs)."""
    _GROUP_DIMS[group] = dim


def group_dim(group) -> str | None:
    """The mesh dimension name `group` spans, or None if it is not a known mesh group."""
    return _GROUP_DIMS.get(group) if group is not None else None


def init_mesh(
    *,
    tp: int = 1,
    dp: int = 1,
    ep: int = 1,
    sp: int = 1,
    rank: int | None = None,
    world_size: int | None = None,
    backend: str | None = None,
    fake: bool = False,
    device_type: str | None = None,
) -> DeviceMesh:
    degrees = {"dp": dp, "ep": ep, "sp": sp, "tp": tp}
    for name, degree in degrees.items():
        if not isinstance(degree, int) or degree < 1:
            raise ValueError(f"Parallel degree {name}={degree!r} must be a positive integer.")
    size = math.prod(degrees.values())
    # `device_type`: a launcher that picked the device itself (Lightning with accelerator=cpu on a CUDA machine).
    device_type = device_type or ("cuda" if torch.cuda.is_available() and not fake else "cpu")
    if fake:
        if dist.is_initialized():
            dist.destroy_process_group()
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank or 0, world_size=size)
    elif not dist.is_initialized():
        world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
        rank = rank if rank is not None else int(os.environ.get("RANK", 0))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        backend = backend or ("nccl" if device_type == "cuda" else "gloo")
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    if dist.get_world_size() != size:
        raise ValueError(
            f"Parallel degrees {degrees} multiply to {size} but the process group has "
            f"world size {dist.get_world_size()}; launch {size} processes or change the degrees."
        )
    mesh = init_device_mesh(device_type, tuple(degrees[d] for d in DIM_ORDER), mesh_dim_names=DIM_ORDER)
    # A dimension spanning every rank is handed the default group, which outlives meshes: drop the name
    # an earlier mesh gave it. Size-1 dimensions never communicate and are left unnamed.
    _GROUP_DIMS.pop(dist.group.WORLD, None)
    for dim in DIM_ORDER:
        if degrees[dim] > 1:
            name_group(mesh.get_group(dim), dim)
    return mesh


def mesh_group(mesh: DeviceMesh | None, dim: str, needed_by: str = "this layout"):
    """The process group of `mesh` dimension `dim`, with one clear error if the mesh lacks it."""
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    if dim not in names:
        raise ValueError(f"The mesh has dimensions {names} but {needed_by} needs a {dim!r} dimension.")
    group = mesh.get_group(dim)
    if mesh.size(names.index(dim)) > 1:
        name_group(group, dim)
    return group
