"""The tour's quality section: MoE++ pretrained at the paper's expert ratio, and the one-seed note
quoting eval.replicate's measured spread (or, without that report, naming the command that measures it); the
MoE++ expert mix the text quotes is read from the trained configs, not written by hand."""

import json
from pathlib import Path

from hydra import compose, initialize_config_dir

import models
from eval.tour_report import seed_noise_line, zero_computation_mix

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def test_tour_pretrains_moepp_at_the_papers_ratio():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        tour = compose("tour")
        model = tour.model_configs.get("moepp", "moepp")
        c = compose("pretrain", [f"model={model}"]).model.config
    zero = c.num_zero_experts + c.num_copy_experts + c.num_constant_experts
    assert (c.num_local_experts, zero) == (8, 4)  # the 0.6B configuration's 8 FFN + 1/1/2
    assert zero / (zero + c.num_local_experts) <= 1 / 3  # every configuration of the paper: a third or fewer
    assert "moepp" in tour.archs


def test_seed_noise_line_quotes_the_replication(tmp_path):
    assert "python -m eval.replicate" in seed_noise_line(str(tmp_path / "absent.json"))
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"settings": {"seeds": [42, 43, 44], "max_steps": 400}, "rows": [
        {"arch": "llama", "val_loss": {"std": 0.021}},
        {"arch": "ladder", "val_loss": {"std": 0.034}, "diff_loss": {"std": 0.012}},
        {"arch": "kraken", "val_loss": {"std": None}, "diff_loss": {"std": None}},  # one seed: no spread
    ]}))  # fmt: skip
    line = seed_noise_line(str(results))
    assert "3 seeds, 400 steps" in line and "0.021-0.034 nats" in line and "0.012-0.012 nats" in line


def test_zero_computation_mix_is_read_from_the_saved_configs(tmp_path):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        paper = dict(compose("pretrain", ["model=moepp_paper"]).model.config)
    pretrained = {}
    for arch, name, fields in [("llama", "llama", {}), ("moepp", "moepp", paper)]:
        models.ZOO[name].config_class(**{**models.ZOO[name].tiny_config, **fields}).save_pretrained(tmp_path / arch)
        pretrained[arch] = {"hf_dir": str(tmp_path / arch)}
    line = zero_computation_mix(pretrained)
    # 8 FFN + 1 zero / 1 copy / 2 constant, top-2, tau 0.75: k_eff = 2 * 0.75 * 8 / (0.75 * 8 + 4) = 1.2
    assert line.startswith("moepp: top-2 of 8 FFN experts") and "1 zero, 1 copy and 2 constant" in line
    assert "33% of all" in line and "k_eff 1.20 at tau 0.75" in line and "llama" not in line
    assert zero_computation_mix({"llama": pretrained["llama"]}) == "no MoE++ model in this tour"
