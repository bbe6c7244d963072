"""parallel.comm: collectives are right on gloo (values and gradients), identity without a group,
skipped in `none` mode, and the simulated link's clock follows a hand-computed schedule, with each
collective timed by its own group's size and its own mesh dimension's link."""

import pytest
import torch
import torch.distributed as dist

import parallel
from parallel import comm
from parallel.link import LINK_PRESETS, LinkPreset, collective_time
from parallel.mesh import group_dim
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


# --- all-to-all with unequal splits -----------------------------------------------------------


def _split_matrix(p: int) -> list[list[int]]:
    """S[r][j] = rows rank r sends to rank j; the same on every rank. Random, with zeros: rank p-1 sends
    nothing, rank 1 receives nothing, rank 0 keeps nothing for itself."""
    s = torch.randint(0, 4, (p, p), generator=torch.Generator().manual_seed(0))
    s[p - 1, :] = 0
    s[:, 1] = 0
    s[0, 0] = 0
    s[0, 2] = 3  # at least one non-empty exchange whatever the draw
    return s.tolist()


def _p2p_all_to_all(chunks: list[torch.Tensor], recv_rows: list[int], width: int) -> torch.Tensor:
    """Reference: chunk j goes to rank j by point-to-point sends; stack what arrives, in rank order."""
    me, p = dist.get_rank(), dist.get_world_size()
    received = [torch.empty(n, width, dtype=chunks[0].dtype) for n in recv_rows]
    ops = []
    for j in range(p):
        if j == me:
            received[j] = chunks[j].clone()
            continue
        if chunks[j].shape[0]:  # both sides know the counts: empty messages are not sent
            ops.append(dist.isend(chunks[j].contiguous(), j))
        if recv_rows[j]:
            ops.append(dist.irecv(received[j], j))
    for op in ops:
        op.wait()
    return torch.cat(received)


def _uneven_all_to_all(rank, world_size):
    mesh = parallel.init_mesh(ep=world_size)
    group = mesh.get_group("ep")
    s = _split_matrix(world_size)
    send = s[rank]
    recv = [s[j][rank] for j in range(world_size)]
    width = 3
    x = torch.randn(sum(send), width, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    x.requires_grad_()

    # exchange_splits: what every peer sends me (a list or a tensor of counts)
    assert comm.exchange_splits(send, group) == recv
    assert comm.exchange_splits(torch.tensor(send), group) == recv

    # values: receive counts found by the exchange, and given explicitly
    comm.reset_counters()
    y = comm.all_to_all(x, group, send_splits=send).wait()
    assert comm.snapshot_counters() == {
        "exchange_splits": {"calls": 1, "bytes": 8 * world_size},
        "all_to_all": {"calls": 1, "bytes": x.numel() * 8},
    }
    expected = _p2p_all_to_all(list(x.detach().split(send)), recv, width)
    assert y.shape == (sum(recv), width)
    assert torch.equal(y, expected)
    y2 = comm.all_to_all(x, group, send_splits=send, recv_splits=recv).wait()
    assert torch.equal(y2, expected)

    # gradients: the adjoint sends each upstream gradient row back to the rank its row came from
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)
    (y * upstream).sum().backward()
    adjoint = _p2p_all_to_all(list(upstream.split(recv)), send, width)
    assert torch.equal(x.grad, adjoint)
    assert comm.snapshot_counters()["all_to_all"]["calls"] == 3  # two forwards, one backward

    # `none` mode: nothing sent, the receive counts taken as the send counts, the local tensor back
    comm.reset_counters()
    with comm.use_mode("none"):
        assert comm.exchange_splits(send, group) == send
        assert comm.all_to_all(x, group, send_splits=send).wait() is x
    assert comm.snapshot_counters() == {}


def test_uneven_all_to_all_on_gloo_matches_point_to_point():
    run_ranks(_uneven_all_to_all, 4)


@pytest.fixture
def fake_mesh():
    """A 4 x 2 (ep x tp) mesh on the fake process group: this process is rank 0 of 8."""
    mesh = parallel.init_mesh(ep=4, tp=2, fake=True)
    yield mesh
    dist.destroy_process_group()
    comm.set_mode("real")


def test_mesh_groups_remember_their_dimension(fake_mesh):
    ep, tp = fake_mesh.get_group("ep"), fake_mesh.get_group("tp")
    assert (dist.get_world_size(ep), dist.get_world_size(tp)) == (4, 2)
    assert (group_dim(ep), group_dim(tp), group_dim(dist.group.WORLD), group_dim(None)) == ("ep", "tp", None, None)


def test_all_to_all_split_errors_are_clear(fake_mesh):
    ep = fake_mesh.get_group("ep")
    x = torch.zeros(5, 2)
    with pytest.raises(ValueError, match=r"send_splits \[2, 2, 0, 0\] sum to 4 rows but the tensor has 5 rows"):
        comm.all_to_all(x, ep, send_splits=[2, 2, 0, 0])
    with pytest.raises(ValueError, match=r"recv_splits must be 4 non-negative row counts .* got \[1, -1, 0, 0\]"):
        comm.all_to_all(x, ep, send_splits=[2, 3, 0, 0], recv_splits=[1, -1, 0, 0])
    with pytest.raises(ValueError, match=r"equal-split all-to-all over 4 ranks needs rows divisible by 4, got 5"):
        comm.all_to_all(x, ep)
    with pytest.raises(ValueError, match=r"send_splits must be 1 non-negative row counts"):
        comm.all_to_all(x, None, send_splits=[2, 3])
    assert comm.all_to_all(x, None, send_splits=[5]).wait() is x
    assert comm.exchange_splits([5], None) == [5]


def test_uneven_all_to_all_in_none_mode_has_the_receive_shape(fake_mesh):
    """Receive counts that differ from the send counts: each send chunk is cut or zero-padded to its
    receive count, differentiably (the adjoint pads or cuts back); nothing is counted."""
    ep = fake_mesh.get_group("ep")
    x = torch.arange(10.0).repeat_interleave(2).reshape(10, 2).requires_grad_()
    send, recv = [5, 0, 3, 2], [2, 1, 3, 4]
    comm.reset_counters()
    with comm.use_mode("none"):
        y = comm.all_to_all(x, ep, send_splits=send, recv_splits=recv).wait()
        rows = torch.tensor([0.0, 1, 0, 5, 6, 7, 8, 9, 0, 0])  # cut 5->2, pad 0->1, keep 3, pad 2->4
        assert torch.equal(y, rows[:, None].repeat(1, 2))
        y.sum().backward()
    assert torch.equal(x.grad[:, 0], torch.tensor([1.0, 1, 0, 0, 0, 1, 1, 1, 1, 1]))
    assert comm.snapshot_counters() == {}


def _simulated_step(ep, tp, t):
    """Rank 0 of ep (P=4) sends 0/3/2 rows of 8 fp32 to ranks 1-3 (160 B) and gets 4/0/6 back (320 B);
    rank 0 of tp (P=2) all-reduces 1000 fp32 (4000 B). Both issued at once, no compute in between."""
    x = torch.zeros(10, 8, requires_grad=True)
    a2a = comm.all_to_all(x, ep, send_splits=[5, 0, 3, 2], recv_splits=[5, 4, 0, 6])
    ar = comm.all_reduce(torch.zeros(1000), tp)
    return x, a2a, ar


def _a2a_s(link):  # one collective's latency, 3 peers' + the larger direction (320 B received) over the link
    return link.base_s + 3 * link.alpha_s + 320 / link.beta_Bps


def _ar_s(link):  # ring all-reduce at P=2: one collective's latency, 2 hops, 2 * (1/2) * 4000 B
    return link.base_s + 2 * link.alpha_s + 4000 / link.beta_Bps


def test_simulated_collectives_use_their_own_group_size(fake_mesh):
    """One link for every group (and a fallback world size that must NOT be used): the all-to-all is
    timed at P=4, the all-reduce at P=2, one after the other on the shared FIFO link."""
    ep, tp = fake_mesh.get_group("ep"), fake_mesh.get_group("tp")
    nvlink = LINK_PRESETS["nvlink-h100"]
    t = [0.0]
    with comm.use_mode("simulated", link="nvlink-h100", world_size=8, now=lambda: t[0]) as clock:
        clock.start()
        comm.reset_counters()
        x, a2a, ar = _simulated_step(ep, tp, t)
        y = a2a.wait()
        assert y.shape == (15, 8)
        assert clock.clock == pytest.approx(_a2a_s(nvlink))
        ar.wait()
        assert clock.clock == pytest.approx(_a2a_s(nvlink) + _ar_s(nvlink))
        assert clock.exposed == pytest.approx(clock.clock)
        # Backward: the all-to-all with the splits swapped (15 rows in, 10 out), timed the same way.
        busy = clock.comm_busy
        y.sum().backward()
        assert x.grad.shape == x.shape
        assert clock.comm_busy - busy == pytest.approx(_a2a_s(nvlink))
        # The split exchange: a blocking all-to-all of 4 int64 counts at P=4 (3/4 of 32 B leave the rank).
        before = clock.elapsed()
        assert comm.exchange_splits([5, 0, 3, 2], ep) == [5, 0, 3, 2]
        assert clock.elapsed() - before == pytest.approx(nvlink.base_s + 3 * nvlink.alpha_s + 24 / nvlink.beta_Bps)
    assert comm.snapshot_counters() == {
        "all_to_all": {"calls": 2, "bytes": (10 + 15) * 32},
        "all_reduce": {"calls": 1, "bytes": 4000},
        "exchange_splits": {"calls": 1, "bytes": 32},
    }
    # Receive counts left to the exchange: peers are taken to send back what they get, so the input's shape.
    with comm.use_mode("simulated", link="nvlink-h100"):
        assert comm.all_to_all(torch.ones(10, 8), ep, send_splits=[5, 0, 3, 2]).wait().shape == (10, 8)


def test_simulated_links_per_mesh_dimension(fake_mesh):
    """tp on NVLink, ep on 25 GbE: two independent links, so the all-reduce does not queue behind the
    all-to-all; a group outside the mesh or a dimension without a link is a clear error."""
    ep, tp = fake_mesh.get_group("ep"), fake_mesh.get_group("tp")
    nvlink, ethernet = LINK_PRESETS["nvlink-h100"], LINK_PRESETS["ethernet-25g"]
    t = [0.0]
    with comm.use_mode("simulated", link={"tp": "nvlink-h100", "ep": "ethernet-25g"}, now=lambda: t[0]) as clock:
        clock.start()
        _, a2a, ar = _simulated_step(ep, tp, t)
        ar.wait()
        assert clock.clock == pytest.approx(_ar_s(nvlink))
        t[0] += 1e-6  # compute that hides part of the all-to-all
        a2a.wait()
        assert clock.clock == pytest.approx(_a2a_s(ethernet))
        assert clock.exposed == pytest.approx(_a2a_s(ethernet) - 1e-6)
        assert clock.comm_busy == pytest.approx(_a2a_s(ethernet) + _ar_s(nvlink))
        with pytest.raises(ValueError, match=r"not a dimension of a mesh"):
            comm.all_reduce(torch.zeros(4), dist.group.WORLD)
    with comm.use_mode("simulated", link={"tp": "nvlink-h100"}):
        with pytest.raises(ValueError, match=r"over mesh dimension 'ep' but the simulated links name only \['tp'\]"):
            comm.all_to_all(torch.zeros(4, 2), ep)
