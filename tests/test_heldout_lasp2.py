"""The LASP-2 held-out row (eval/simulator/heldout/lasp2.py) and the hierarchical link it runs on (parallel/link.py)."""

import dataclasses

import pytest

from eval.simulator.heldout import ROW_KEYS, lasp2
from parallel.link import LINK_PRESETS, HierarchicalLink, VirtualClock, collective_time


@pytest.fixture(scope="module")
def quick_row():
    return lasp2.validate(quick=True)


def test_row_has_every_interface_key(quick_row):
    assert set(quick_row) >= set(ROW_KEYS)
    assert lasp2.PAPER == "lasp2"
    for cell in quick_row["cells"]:
        assert {"label", "published", "predicted", "what"} <= set(cell)
        assert cell["predicted"] > 0
    for entry in quick_row["sensitivity"]:
        assert {"effect", "value", "predicted"} <= set(entry)
    assert isinstance(quick_row["notes"], list) and isinstance(quick_row["lacks"], str)


def test_headline_is_recomputed_from_its_cell(quick_row):
    cell = quick_row["cells"][0]
    assert cell["label"].startswith("LASP-2 over LASP-1")
    assert quick_row["predicted"] == cell["predicted"] == cell["times"]["lasp1_s"] / cell["times"]["lasp2_s"]
    ring = quick_row["cells"][1]
    assert ring["predicted"] == ring["times"]["ring_s"] / ring["times"]["lasp2_s"]
    # the per-length throughput cells are N / step time of the same LASP-2 step
    n = lasp2.QUICK["headline_n"]
    tokens = next(c for c in quick_row["cells"] if c["label"].startswith(f"LASP-2 tokens/s, N={n},"))
    assert tokens["predicted"] == pytest.approx(n * lasp2.BATCH / cell["times"]["lasp2_s"])


def test_two_quick_runs_are_identical(quick_row):
    assert lasp2.validate(quick=True) == quick_row


def test_full_row_publishes_the_two_headlines():
    assert lasp2.PUBLISHED == {"lasp1": 1.152, "ring": 1.366}
    assert lasp2.P == 64 and lasp2.DGX_A100_IB.ranks_per_node == 8 and lasp2.HEADLINE_N == 2048 * 1024


# --- the hierarchical link, by hand ---------------------------------------------------------------------------

NVL, IB = LINK_PRESETS["nvlink-a100"], LINK_PRESETS["ib-hdr-200g"]
LINK = HierarchicalLink("test", NVL, IB, ranks_per_node=8, nics_per_node=8, p2p_launch_s=10e-6)


def test_ring_shift_across_nodes_is_charged_by_one_nic():
    n = 1 << 20  # one LASP-1 hop: 16 heads of 128 x 128 fp32 states
    by_hand = 8.4e-6 + 14e-6 + n / 22.5e9 + 10e-6  # network base + hop + bytes over ONE NIC + host launch
    assert collective_time("send_recv", n, 64, LINK) == pytest.approx(by_hand)
    # inside one node: NVLink's own hop (and the launch, which is the host's whatever the link)
    assert collective_time("send_recv", n, 8, LINK) == pytest.approx(4.9e-6 + 1.5e-6 + n / 230e9 + 10e-6)


def test_all_gather_across_nodes_is_a_ring_on_the_node_nics():
    n = 64 << 20  # LASP-2's all-gather at P=64: 64 states of 1 MiB
    # NCCL ring: 63 steps each charged the network latency; bytes at min(NVLink 230, 8 NICs x 22.5 = 180) GB/s
    by_hand = 8.4e-6 + 63 * 14e-6 + 63 / 64 * n / 180e9
    assert collective_time("all_gather", n, 64, LINK) == pytest.approx(by_hand)
    assert collective_time("all_gather", n, 8, LINK) == collective_time("all_gather", n, 8, NVL)
    # with a single NIC per node the node's NIC is the bottleneck
    one_nic = dataclasses.replace(LINK, nics_per_node=1)
    assert collective_time("all_gather", n, 64, one_nic) == pytest.approx(8.4e-6 + 63 * 14e-6 + 63 / 64 * n / 22.5e9)


def test_virtual_clock_takes_a_hierarchical_link():
    clock = VirtualClock(LINK, world_size=64, now=iter([0.0] * 8).__next__)
    clock.start()
    ready = clock.issue("send_recv", 1 << 20)
    clock.wait(ready)
    assert clock.exposed == pytest.approx(collective_time("send_recv", 1 << 20, 64, LINK))


def test_lasp1_pays_p_minus_1_hops_each_pass():
    """The whole model's training step (eval.simulator.training): LASP-1's P-1 ring hops per layer and pass, each
    paying the host's launch; LASP-2 one all-gather per layer and pass; then the replicated trainer's all-reduce."""
    q = lasp2.QUICK
    p, n, layers = q["p"], q["headline_n"], q["shape"]["num_hidden_layers"]
    run = lasp2.record(q["shape"], "lasp1", n, p)
    issued = [args[0] for name, args, _ in run.recorder.calls if name == "issue"]
    assert issued == ["send_recv"] * (2 * (p - 1) * layers) + ["all_reduce"]  # forward and backward hops, the sync
    link = dataclasses.replace(lasp2.DGX_A100_IB, ranks_per_node=2, nics_per_node=2)
    dm = lasp2.device_model("a100-sxm")
    with_launch = lasp2.step_parts(run, dm, link)
    without = lasp2.step_parts(run, dm, dataclasses.replace(link, p2p_launch_s=0.0))
    # every hop's host launch is on the link's busy time and, the hops being waited in turn, on the step's time
    hops = 2 * (p - 1) * layers
    assert with_launch["busy_s"] - without["busy_s"] == pytest.approx(hops * link.p2p_launch_s)
    assert with_launch["step_s"] - without["step_s"] >= (hops - 2 * layers) * link.p2p_launch_s
    run2 = lasp2.record(q["shape"], "lasp2", n, p)
    issued2 = [args[0] for name, args, _ in run2.recorder.calls if name == "issue"]
    assert issued2 == ["all_gather", "all_gather"] * layers + ["all_reduce"]
