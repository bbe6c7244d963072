"""parallel.comm: collectives are right on gloo (values and gradients), identity without a group,
skipped in `none` mode, and the simulated link's clock follows a hand-computed schedule."""

import pytest
import torch
import torch.distributed as dist

import parallel
from parallel import comm
from parallel.link import LinkPreset, collective_time
from tests.distributed import run_ranks


def _collectives(rank, world_size):
    mesh = parallel.init_mesh(tp=world_size)
    group = mesh.get_group("tp")
    p = world_size
    # all_reduce
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    y = comm.all_reduce(x, group).wait()
    assert torch.equal(y, torch.full((2, 3), float(sum(range(1, p + 1)))))
    # all_gather along dim 1; gradient = sum over ranks of their upstream gradient for my slice
    x = torch.arange(6.0).reshape(2, 3).add(10 * rank).requires_grad_()
    y = comm.all_gather(x, group, dim=1).wait()
    assert torch.equal(y, torch.cat([torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(p)], dim=1))
    coeff = lambda r: torch.arange(2 * 3 * p, dtype=torch.float).reshape(2, 3 * p) * (r + 1)  # noqa: E731
    (y * coeff(rank)).sum().backward()
    expected = sum(coeff(r) for r in range(p)).chunk(p, dim=1)[rank]
    assert torch.equal(x.grad, expected)
    # reduce_scatter along dim 0 and its gradient (an all-gather)
    x = (torch.arange(4.0 * p).reshape(2 * p, 2) * (rank + 1)).requires_grad_()
    y = comm.reduce_scatter(x, group, dim=0).wait()
    total = sum(torch.arange(4.0 * p).reshape(2 * p, 2) * (r + 1) for r in range(p))
    assert torch.equal(y, total.chunk(p, dim=0)[rank])
    (y * (rank + 1)).sum().backward()
    assert torch.equal(x.grad, torch.cat([torch.full((2, 2), float(r + 1)) for r in range(p)]))
    # all_to_all: chunk i of rank r goes to rank i
    x = (torch.arange(float(p))[:, None] + 100 * rank).repeat(1, 2).requires_grad_()
    y = comm.all_to_all(x, group).wait()
    assert torch.equal(y, (torch.full((p,), float(rank)) + 100 * torch.arange(float(p)))[:, None].repeat(1, 2))
    (y * (rank + 1)).sum().backward()
    assert torch.equal(x.grad, torch.arange(1.0, p + 1)[:, None].repeat(1, 2))
    # `none` mode issues nothing and returns the local tensor
    comm.reset_counters()
    with comm.use_mode("none"):
        z = torch.ones(3)
        assert comm.all_reduce(z, group).wait() is z
    assert comm.snapshot_counters() == {}


def test_collectives_on_gloo():
    run_ranks(_collectives, 2)


def test_no_group_is_identity_and_uncounted():
    comm.reset_counters()
    x = torch.randn(4)
    for fn in (comm.all_reduce, comm.all_gather, comm.reduce_scatter, comm.all_to_all):
        assert fn(x, None).wait() is x
    assert comm.snapshot_counters() == {}


def test_collective_time_alpha_beta():
    link = LinkPreset("toy", alpha_s=1e-6, beta_Bps=1e9)
    # Ring all-reduce on 4 ranks: 2*3 hops of latency, 2*3/4 of the bytes over the link.
    assert collective_time("all_reduce", 8000, 4, link) == pytest.approx(6e-6 + 1.5 * 8000 / 1e9)
    assert collective_time("all_gather", 8000, 4, link) == pytest.approx(3e-6 + 0.75 * 8000 / 1e9)
    assert collective_time("all_reduce", 8000, 1, link) == 0.0


def test_simulated_clock_matches_hand_computed_schedule():
    """Toy schedule on a link where an all-reduce of n bytes takes n seconds at P=2 (alpha=0, beta=1):
    compute 3 | issue AR(4B): link busy 3..7 | compute 2 | issue AR(2B): queued behind, 7..9 |
    compute 1 | wait AR1 at 6: exposed 1, clock -> 7 | compute 3 (clock 10) | wait AR2 (ready 9): free.
    """
    parallel.init_mesh(tp=2, fake=True)
    try:
        group = dist.group.WORLD
        t = [0.0]
        toy = LinkPreset("toy", alpha_s=0.0, beta_Bps=1.0)
        with comm.use_mode("simulated", link=toy, world_size=2, now=lambda: t[0]) as clock:
            clock.start()
            t[0] += 3
            first = comm.all_reduce(torch.zeros(1, dtype=torch.float32), group)  # 4 bytes
            t[0] += 2
            second = comm.all_reduce(torch.zeros(1, dtype=torch.float16), group)  # 2 bytes
            t[0] += 1
            first.wait()
            assert clock.clock == 7 and clock.exposed == 1
            t[0] += 3
            second.wait()
            assert clock.elapsed() == 10 and clock.exposed == 1 and clock.comm_busy == 6
    finally:
        dist.destroy_process_group()


def test_unknown_mode_and_link_are_clear_errors():
    with pytest.raises(ValueError, match=r"Unknown communication mode 'fast'; choose one of"):
        comm.set_mode("fast")
    with pytest.raises(ValueError, match=r"Unknown link preset 'nvlink9'; choose one of"):
        comm.set_mode("simulated", link="nvlink9", world_size=2)
    comm.set_mode("real")
