"""Run a function on P gloo ranks on 127.0.0.1 (started processes), for multi-process tests.

Ranks are forked from one forkserver that has imported the zoo once (`PRELOAD`): a spawned rank would
import torch, transformers and the zoo afresh, seconds per rank on 2 cores, for every test. Each rank
still starts from a clean process (the server has only imported modules, run nothing) with the caller's
environment of the moment, as a spawned one would."""

import multiprocessing
import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = [
    "torch", "torch.distributed", "transformers", "models", "parallel", "lightning", "train.pretrain", "tests.distributed",
]
multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts, at the first run_ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, environ: dict, fn, args) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the caller's, not the server's (started at the first call)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    import torch

    torch.set_num_threads(1)  # P ranks share 2 cores
    try:
        fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` processes; a failure on any rank fails the test."""
    mp.start_processes(
        _entry, args=(world_size, free_port(), dict(os.environ), fn, args), nprocs=world_size, join=True,
        start_method="forkserver",
    )


def assert_shard_grads(grads: dict, full_grads: dict, rank: int, world_size: int, atol: float, label: str = "") -> None:
    """Each of a sharded model's gradients equals the unsharded model's, or (a TP shard) this rank's slice of it."""
    import torch

    for name, grad in grads.items():
        want = full_grads[name]
        if want.shape != grad.shape:  # a TP shard: the rank's slice of the full gradient
            (dim,) = [d for d, (a, b) in enumerate(zip(want.shape, grad.shape, strict=True)) if a != b]
            want = want.chunk(world_size, dim=dim)[rank]
        torch.testing.assert_close(grad, want, rtol=0, atol=atol, msg=lambda m, n=f"{label}{name}": f"{n}: {m}")
