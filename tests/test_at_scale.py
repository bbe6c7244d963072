"""eval.at_scale: the simulator's predictions of every architecture against its baseline, one report.
At tiny shapes (the real runs are conf/at_scale.yaml's 8B / 70B shapes, reports/at-scale)."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from eval import at_scale

CONF = str(Path(__file__).resolve().parents[1] / "conf")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("at_scale")
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("at_scale")
        with open_dict(cfg):
            cfg.common = ["compute=h100-sxm", "prompt_len=16", "new_tokens=4", "batch_sizes=[1,2]", "logger=none"]
            cfg.runs = {
                "dense": {"title": "tiny dense", "overrides": [
                    "bench_shape=tiny", "archs=[llama,ladder,parallel,gqla,gqla_ladder]", "baseline=llama", "tp=[2]",
                    "simulated.links=[nvlink-h100]"]},
                "moe": {"title": "tiny moe", "overrides": [
                    "bench_preset=moe", "bench_shape=tiny", "archs=[moe,scmoe,moe_ladder]", "baseline=moe", "ep=[2]",
                    "simulated.links=[pcie4]", "expert_throughput.enabled=false"]},
                "ttft": {"title": "tiny ttft", "prompt_lens": [8, 16], "overrides": [
                    "bench_shape=tiny", "archs=[llama,kraken]", "baseline=llama", "tp=[2]", "batch_sizes=[1]",
                    "new_tokens=2", "simulated.links=[nvlink-a100]"]},
            }  # fmt: skip
        return at_scale.run_all(cfg, out), out


def test_every_architecture_gets_its_speed_ups_over_its_baseline(result):
    res, out = result
    rows = {(r["run"], r["arch"], r["batch"]): r for r in res["rows"]}
    dense = ("llama", "ladder", "parallel", "gqla", "gqla_ladder", "llama (no communication)")
    moe = ("moe", "scmoe", "moe_ladder", "moe (no communication)")
    ttft = ("llama", "kraken", "llama (no communication)")
    assert set(rows) == {(run, arch, b) for run, archs in (("dense", dense), ("moe", moe)) for arch in archs
                         for b in (1, 2)} | {(f"ttft@{n}", a, 1) for n in (8, 16) for a in ttft}  # fmt: skip
    for (run, _arch, batch), r in rows.items():
        base = rows[(run, r["against"], batch)]
        assert r["speedup_total"] == pytest.approx(r["tok_s"] / base["tok_s"])
    # the baseline with its links free (the bench's upper bound) is faster than it, on each link's row
    for run, base_arch, batch in (("dense", "llama", 1), ("dense", "llama", 2), ("moe", "moe", 2), ("ttft@16", "llama", 1)):
        free, base = rows[(run, f"{base_arch} (no communication)", batch)], rows[(run, base_arch, batch)]
        assert free["against"] == base_arch and free["prefill_ms"] < base["prefill_ms"]
        assert free["speedup_prefill"] == pytest.approx(base["prefill_ms"] / free["prefill_ms"])
    # llama waits every all-reduce at once (all of its link time exposed); ladder defers each by one sub-block
    assert rows[("dense", "llama", 1)]["exposed_share"] == pytest.approx(1.0)
    assert rows[("dense", "ladder", 1)]["exposed_share"] < 0.5
    assert rows[("dense", "ladder", 1)]["speedup_decode"] > 1
    # a run with prompt_lens runs once per prompt length; the time to first token is prefill over the baseline's
    assert rows[("ttft@8", "kraken", 1)]["prompt_len"] == 8 and rows[("ttft@16", "kraken", 1)]["prompt_len"] == 16
    ttft = rows[("ttft@16", "kraken", 1)]
    assert ttft["ttft_change"] == pytest.approx(1 / ttft["speedup_prefill"] - 1)


def test_report_names_the_runs_the_published_numbers_and_the_compute(result):
    res, out = result
    text = (out / "README.md").read_text()
    for piece in ("## tiny dense", "## tiny moe", "## tiny ttft, prompt 8", "## Published numbers", "**ladder**: 70B, TP 8",
                  "`h100-sxm`", "[its bench report](dense/README.md)", "**kraken: time to first token"):
        assert piece in text
    assert (out / "dense" / "results.json").exists() and (out / "at_scale.json").exists()


def test_a_ladder_variant_is_set_against_its_standard_sibling(result):
    """gqla_ladder against gqla (and llama, the run's baseline); moe_ladder against moe, with the share of the
    combine all-to-all its attention sub-block hides; the report's own section and words, from the numbers."""
    res, out = result
    rows = {(r["run"], r["arch"], r["batch"]): r for r in res["rows"]}
    for batch in (1, 2):
        variant, sibling = rows[("dense", "gqla_ladder", batch)], rows[("dense", "gqla", batch)]
        assert variant["sibling"] == "gqla" and variant["against"] == "llama" and sibling["sibling"] is None
        assert variant["vs_sibling_decode"] == pytest.approx(variant["decode_tok_s"] / sibling["decode_tok_s"])
        assert variant["vs_sibling_prefill"] == pytest.approx(sibling["prefill_ms"] / variant["prefill_ms"])
        assert variant["vs_sibling_total"] == pytest.approx(variant["speedup_total"] / sibling["speedup_total"])
        # gqla waits each all-reduce at once; its ladder variant leaves most of the link time hidden, and is faster
        assert variant["sibling_hidden_decode"] == pytest.approx(sibling["hidden_decode"]) == pytest.approx(0, abs=1e-9)
        assert variant["hidden_decode"] > 0.5 and variant["vs_sibling_decode"] > 1
        moe = rows[("moe", "moe_ladder", batch)]
        assert moe["sibling"] == "moe" and moe["moe_layers"] == rows[("moe", "moe", batch)]["moe_layers"]  # its overrides
        assert moe["a2a_hidden"] > moe["sibling_a2a_hidden"] and 0 < moe["combine_hidden"] <= 1
    text = (out / "README.md").read_text()
    assert text.count("### Ladder variants against their standard siblings") == 2
    assert "- **gqla_ladder** (tp=2, nvlink-h100): `gqla` with the ladder residual schedule" in text
    combine = " / ".join(f"{rows[('moe', 'moe_ladder', b)]['combine_hidden']:.0%}" for b in (1, 2))
    assert f"hides {combine} of the combine's link time" in text


def test_a_training_run_gives_step_rows_over_its_baseline():
    # A bench run of the training section (bench_preset=train): its predicted rows, measured ones left out.
    step = {"layout": "dp8 x tp8", "ac": "selective", "mfu": 0.2, "exposed_ms": 1.0}
    results = {"settings": {"baseline": "llama"}, "training": [
        {**step, "arch": "llama", "compute": "h100-sxm", "tokens_per_s_per_device": 100.0, "speedup_vs_baseline": 1.0},
        {**step, "arch": "llama+token_split", "compute": "h100-sxm", "tokens_per_s_per_device": 101.0,
         "speedup_vs_baseline": 1.01},
        {**step, "arch": "llama", "compute": "measured", "tokens_per_s_per_device": 5.0, "speedup_vs_baseline": 1.0},
    ]}  # fmt: skip
    rows = at_scale.train_rows("train_8b", results)
    assert [(r["arch"], r["against"], r["speedup_vs_baseline"]) for r in rows] == [
        ("llama", "llama", 1.0), ("llama+token_split", "llama", 1.01)]  # fmt: skip
    assert at_scale.train_rows("dense_8b", {"settings": {"baseline": "llama"}, "rows": []}) == []
