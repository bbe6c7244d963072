"""eval.bench, the MoE section (bench_preset=moe): the ep point measured and llama skipped there, all-to-all
bytes per layer counted == the dropless formula, exposure per layer from the virtual clock, the expert-layer
throughput rows and report; with a device preset the MoE rows carry the same all-to-all columns."""


import pytest

from eval.bench import check_settings
from eval.bench.settings import model_config
from tests.benchkit import bench_settings, run_here, run_predicted


def test_moe_preset_compares_like_with_like():
    cfg = bench_settings("bench_preset=moe", "bench_shape=moe-small")
    assert cfg["archs"] == ["moe", "scmoe", "moepp"] and cfg["baseline"] == "moe"
    assert cfg["tp"] == [] and cfg["ep"] == [2, 4] and cfg["expert_throughput"]["enabled"]
    shape = cfg["bench_shape"]
    assert shape["intermediate_size"] % 8 == 0 and shape["hidden_size"] % 8 == 0  # grouped_mm
    moe, scmoe = (model_config(cfg, a, {"ep": 2}) for a in ("moe", "scmoe"))
    # moe's MoE layers are scmoe's MoE blocks (moe_layer_freq=2 against Position-2 pairs) ...
    layers = range(shape["num_hidden_layers"])
    assert [moe.is_moe_layer(i) for i in layers] == [scmoe.is_moe_layer(i) for i in layers]
    assert moe.num_moe_layers == scmoe.num_moe_layers == shape["num_hidden_layers"] // 2
    # ... with the same expert compute per token: top-2 vs top-1 + a shared expert, all as wide.
    assert moe.num_experts_per_tok * moe.intermediate_size == (
        scmoe.num_experts_per_tok * scmoe.intermediate_size + scmoe.shared_expert_intermediate_size
    )
    assert moe.num_local_experts == scmoe.num_local_experts == model_config(cfg, "moepp", {}).num_local_experts
    archs_at, skipped = check_settings(cfg)
    assert archs_at[(("ep", 4),)] == ["moe", "scmoe", "moepp"] and not skipped



MOE_ARCHS = ("moe", "scmoe", "moepp")


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """The MoE preset at the tiny shape with llama added: ep 2 (llama skipped there), a preset link and a
    per-dimension one, real gloo at ep 2, and the expert-layer throughput on a few tokens."""
    out = tmp_path_factory.mktemp("bench_moe")
    results = run_here(
        out, "bench_preset=moe",
        "bench_shape=tiny", "archs=[llama,moe,scmoe,moepp]", "ep=[2]", "batch_sizes=[1]", "prompt_len=16",
        "new_tokens=3", "warmup=1", "repeats=1", "simulated.links=[pcie4,{ep: nvlink-h100}]",
        "real.enabled=true", "real.ep=[2]", "expert_throughput.tokens=128", "expert_throughput.repeats=1",
    )  # fmt: skip
    return out, results


def test_moe_run_measures_the_ep_point_and_skips_llama(moe_run):
    out, results = moe_run
    rows = results["rows"]
    assert results["degrees"] == [{"ep": 2}] and results["real_degrees"] == [{"ep": 2}]
    got = {(r["arch"], r["variant"], r["link"]) for r in rows}
    for arch in MOE_ARCHS:
        for variant, link in [("simulated", "pcie4"), ("simulated", "ep=nvlink-h100"), ("upper_bound", None),
                              ("real", None), ("upper_bound_real", None)]:  # fmt: skip
            assert (arch, variant, link) in got
    assert len(rows) == 5 * len(MOE_ARCHS) and all(r["degrees"] == {"ep": 2} for r in rows)
    assert not any(r["arch"] == "llama" for r in rows)
    assert len(results["skipped"]) == 1 and "llama: no ep layout" in results["skipped"][0]
    readme = (out / "README.md").read_text()
    assert "## Skipped" in readme and "- ep=2: llama: no ep layout" in readme


def test_moe_all_to_all_bytes_per_layer_match_the_formula(moe_run):
    _, results = moe_run
    shape = results["settings"]["bench_shape"]
    h, prompt = shape["hidden_size"], 16
    by = {(r["arch"], r["variant"], r["link"]): r for r in results["rows"]}
    moe = by[("moe", "simulated", "pcie4")]
    k = model_config(results["settings"], "moe", {"ep": 2}).num_experts_per_tok
    # Dropless, fp32: every all-to-all carries T_local * k * h * 4 bytes (own chunk included), exactly;
    # the spec's (P-1)/P of it leaves the rank at balanced routing.
    for phase, tokens in (("prefill", prompt), ("decode", 1)):
        assert moe[f"{phase}_a2a_bytes"] == tokens * k * h * 4 == moe[f"{phase}_a2a_formula_bytes"]
        assert moe[f"{phase}_a2a_link_bytes_formula"] == tokens * k * h * 4 / 2
        assert moe[f"{phase}_a2a_rows_per_token"] == k
        assert moe[f"{phase}_moe_layers"] == model_config(results["settings"], "moe", {"ep": 2}).num_moe_layers
    assert by[("scmoe", "simulated", "pcie4")]["prefill_a2a_bytes"] == prompt * 1 * h * 4  # top-1
    # MoE++'s zero-computation experts never enter the all-to-all: fewer bytes than moe's top-2.
    moepp = by[("moepp", "simulated", "pcie4")]
    assert 0 < moepp["prefill_a2a_bytes"] < moe["prefill_a2a_bytes"]
    assert moepp["prefill_a2a_rows_per_token_formula"] == pytest.approx(2 * 0.75 * 8 / (0.75 * 8 + 4))  # k_eff
    # No collective, nothing counted, without communication.
    assert by[("moe", "upper_bound", None)].get("prefill_a2a_bytes") is None


def test_moe_all_to_all_exposure_from_the_virtual_clock(moe_run):
    _, results = moe_run
    by = {(r["arch"], r["variant"], r["link"]): r for r in results["rows"]}
    for arch in MOE_ARCHS:
        for link in ("pcie4", "ep=nvlink-h100"):
            r = by[(arch, "simulated", link)]
            for phase in ("prefill", "decode"):
                link_ms, exposed = r[f"{phase}_a2a_link_ms_per_layer"], r[f"{phase}_a2a_exposed_ms_per_layer"]
                assert link_ms > 0 and 0 <= exposed <= link_ms + 1e-9
                assert r[f"{phase}_a2a_hidden_share"] == pytest.approx(1 - exposed / link_ms)
                assert r[f"{phase}_count_exchange_exposed_ms_per_layer"] > 0  # blocking: never hidden
    # The published share is printed beside ours, by the preset of the ep link.
    assert by[("scmoe", "simulated", "pcie4")]["a2a_hidden_anchor"] == 0.7
    assert by[("scmoe", "simulated", "ep=nvlink-h100")]["a2a_hidden_anchor"] == 1.0
    assert by[("moe", "simulated", "pcie4")]["a2a_hidden_anchor"] is None
    assert by[("moe", "simulated", "pcie4")]["prefill_a2a_exposed_vs_baseline"] in (1.0, None)


def test_expert_throughput_rows_and_moe_report(moe_run):
    out, results = moe_run
    rows = results["expert_throughput"]
    assert [r["label"] for r in rows] == ["moe", "moepp tau=0.75", "moepp tau=0.25"]
    assert rows[0]["speedup"] == 1 and rows[0]["target_rows_per_token"] == 2
    for r, tau in zip(rows[1:], (0.75, 0.25), strict=True):
        assert r["target_rows_per_token"] == pytest.approx(2 * tau * 8 / (tau * 8 + 4))
        # The router is pushed to that load (bisection over 128 tokens: within a few assignments).
        assert r["ffn_rows_per_token"] == pytest.approx(r["target_rows_per_token"], abs=0.05)
    for r in rows:
        assert r["tokens"] == 128 and r["tokens_per_s"] > 0 and r["ms_min"] <= r["ms"] <= r["ms_max"]
    readme = (out / "README.md").read_text()
    for text in ("## MoE all-to-all per layer", "### simulated:pcie4", "### simulated:ep=nvlink-h100",
                 "## Expert-layer throughput (real, one device)", "| moepp tau=0.75 | 128 |", "pcie4 70%"):  # fmt: skip
        assert text in readme, text
    for name in ("a2a_exposed.png", "expert_throughput.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in readme



def test_device_preset_moe_rows_carry_the_all_to_all_columns(tmp_path):
    results = run_predicted(
        tmp_path, "bench_preset=moe", "bench_shape=tiny", "ep=[2]", "real.enabled=false", "expert_throughput.enabled=false",
        "batch_sizes=[1]", "simulated.links=[pcie4,{ep: nvlink-h100}]",
    )  # fmt: skip
    settings, rows = results["settings"], results["rows"]
    h, prompt = settings["bench_shape"]["hidden_size"], settings["prompt_len"]
    by = {(r["arch"], r["variant"], r["link"]): r for r in rows}
    predicted = {r["arch"] for r in rows}
    # MoE++ selects its FFN assignments by boolean masks: on meta they take the load its balance loss aims for.
    assert predicted == {"moe", "scmoe", "moepp"}
    for arch in predicted:
        k = model_config(settings, arch, {"ep": 2}).num_experts_per_tok if arch != "moepp" else None
        for link in ("pcie4", "ep=nvlink-h100"):
            r = by[(arch, "simulated", link)]
            for phase, tokens in (("prefill", prompt), ("decode", 1)):
                # Balanced routing on meta, bfloat16: the counted bytes are the dropless formula's (MoE++: its
                # k_eff rows per token, rounded to whole rows per layer).
                assert r[f"{phase}_a2a_bytes"] == pytest.approx(r[f"{phase}_a2a_formula_bytes"], abs=h * 2 / 2)
                if k is not None:
                    assert r[f"{phase}_a2a_bytes"] == tokens * k * h * 2
                link_ms, exposed = r[f"{phase}_a2a_link_ms_per_layer"], r[f"{phase}_a2a_exposed_ms_per_layer"]
                assert link_ms > 0 and 0 <= exposed <= link_ms + 1e-12
                assert r[f"{phase}_a2a_hidden_share"] == pytest.approx(1 - exposed / link_ms)
                assert r[f"{phase}_count_exchange_exposed_ms_per_layer"] > 0
        assert by[(arch, "upper_bound", None)].get("prefill_a2a_bytes") is None
    assert by[("scmoe", "simulated", "pcie4")]["a2a_hidden_anchor"] == 0.7
    assert "## MoE all-to-all per layer" in (tmp_path / "README.md").read_text()


