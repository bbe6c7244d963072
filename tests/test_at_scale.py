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
                    "bench_shape=tiny", "archs=[llama,ladder,parallel]", "baseline=llama", "tp=[2]",
                    "simulated.links=[nvlink-h100]"]},
                "moe": {"title": "tiny moe", "overrides": [
                    "bench_preset=moe", "bench_shape=tiny", "archs=[moe,scmoe]", "baseline=moe", "ep=[2]",
                    "simulated.links=[pcie4]", "expert_throughput.enabled=false"]},
                "ttft": {"title": "tiny ttft", "prompt_lens": [8, 16], "overrides": [
                    "bench_shape=tiny", "archs=[llama,kraken]", "baseline=llama", "tp=[2]", "batch_sizes=[1]",
                    "new_tokens=2", "simulated.links=[nvlink-a100]"]},
            }  # fmt: skip
        return at_scale.run_all(cfg, out), out


def test_every_architecture_gets_its_speed_ups_over_its_baseline(result):
    res, out = result
    rows = {(r["run"], r["arch"], r["batch"]): r for r in res["rows"]}
    assert set(rows) == {(run, arch, b) for run, archs in (("dense", ("llama", "ladder", "parallel")), ("moe", ("moe", "scmoe")))
                         for arch in archs for b in (1, 2)} | {(f"ttft@{n}", a, 1) for n in (8, 16) for a in ("llama", "kraken")}  # fmt: skip
    for (run, _arch, batch), r in rows.items():
        base = rows[(run, r["against"], batch)]
        assert r["speedup_total"] == pytest.approx(r["tok_s"] / base["tok_s"])
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
