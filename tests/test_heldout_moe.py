"""The held-out validation's two MoE rows (eval/simulator/heldout/scmoe.py, moepp.py): the interface of
eval.simulator.heldout, the headline recomputed from the cells, determinism, and one fact per row checked by hand."""

import json
import math

import pytest

from eval.simulator.heldout import PAPERS, ROW_KEYS, device_model, geomean, module, moepp, scmoe
from parallel.link import collective_time, get_link


@pytest.fixture(scope="module")
def quick_rows():
    return {m.PAPER: m.validate(quick=True) for m in (scmoe, moepp)}


@pytest.mark.parametrize("paper", ["scmoe", "moepp"])
def test_every_interface_key(paper, quick_rows):
    assert paper in PAPERS and module(paper).PAPER == paper
    row = quick_rows[paper]
    assert set(row) == set(ROW_KEYS)
    assert isinstance(row["predicted"], float) and row["predicted"] > 0
    assert isinstance(row["lacks"], str) and isinstance(row["notes"], list) and row["notes"]
    assert row["cells"] and row["sensitivity"]
    for cell in row["cells"]:
        assert {"label", "published", "predicted", "what"} <= set(cell)
        assert cell["predicted"] > 0
    for entry in row["sensitivity"]:
        assert {"effect", "value", "predicted"} <= set(entry) and entry["predicted"] > 0


def test_headlines_recomputed_from_cells(quick_rows):
    sc = quick_rows["scmoe"]
    assert sc["predicted"] == pytest.approx(geomean(c["predicted"] for c in sc["cells"][:2]))
    assert sc["published"] == pytest.approx(math.sqrt(1.66 * 1.17))
    pp = quick_rows["moepp"]
    at_075 = [c["predicted"] for c in pp["cells"] if c["label"].endswith("tau=0.75")]
    assert len(at_075) == 1  # quick: one size
    assert pp["predicted"] == pytest.approx(geomean(at_075))
    # The full row's published headline: Table 3's four tau = 0.75 increases.
    assert geomean(moepp.PUBLISHED[(size, 0.75)] for size in moepp.SIZES) == pytest.approx(
        (1.252 * 1.221 * 1.218 * 1.278) ** 0.25
    )


def test_two_quick_runs_identical(quick_rows):
    for m in (scmoe, moepp):
        assert json.dumps(m.validate(quick=True), sort_keys=True) == json.dumps(
            quick_rows[m.PAPER], sort_keys=True
        )


def test_moepp_k_eff_and_expert_flops_by_hand():
    """0.6B/(8+4)E at tau 0.75: k_eff = 2 x 0.75 x 8 / (0.75 x 8 + 4) = 1.2 FFN experts per token, and the grouped
    FFN experts of one layer are charged 6 x rows x d x f FLOPs (gate, up, down), rows = 1.2 T against top-2's 2 T."""
    tokens = 640
    vanilla, config = moepp._configs(moepp.SIZES["0.6B/(8+4)E"], 0.75)
    assert moepp.k_eff(config) == pytest.approx(1.2)
    d, f = 768, 2048
    for arch, cfg, rows in (("moe", vanilla, 2 * tokens), ("moepp", config, round(1.2 * tokens))):
        clock, spans = moepp.record_experts(moepp._layer(arch, cfg), tokens)
        grouped = sum(
            clock.flops[i] for a, b in spans for i in range(a, b) if clock.names[i] == "aten::_grouped_mm"
        )
        assert grouped == 6 * rows * d * f


def test_scmoe_all_to_all_bytes_and_link_time_by_hand():
    """SwinV2-MoE-S stage 3 at the paper's setting (128 images of 144 tokens per GPU, 8 experts, capacity factor
    1.25, hidden 384, bf16): one padded all-to-all of the top-2 baseline carries E x ceil(1.25 x T x 2 / E) rows =
    8 x 5760 x 384 x 2 bytes, ScMoE's top-1 half of that; on pcie4 one call costs 7 alpha + 7/8 x bytes / beta."""
    stage = next(s for s in scmoe.swin_stages() if s.name == "stage 3")
    tokens = 128 * 144
    for variant, k in (("top2", 2), ("scmoe", 1)):
        rec = scmoe.record_stage(stage, variant, scmoe.EP)
        a2a = rec.phase.counts["all_to_all"]
        assert a2a["calls"] == 2 * 9  # dispatch and combine of each of the 9 MoE blocks
        per_call = 8 * math.ceil(1.25 * tokens * k / 8) * 384 * 2
        assert a2a["bytes"] == a2a["calls"] * per_call
        assert per_call == (35_389_440 if k == 2 else 17_694_720)
        busy = rec.phase.replay(device_model("a30"), {"ep": "pcie4"})["busy_by"]["all_to_all"]
        link = get_link("pcie4")
        assert busy / a2a["calls"] == pytest.approx(7 * link.alpha_s + 7 / 8 * per_call / link.beta_Bps)
        assert busy / a2a["calls"] == pytest.approx(collective_time("all_to_all", per_call, 8, link))
