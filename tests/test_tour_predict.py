"""The tour's "predicted at a real shape" step (eval/tour_predict.py) and the report it leads (eval/tour_report.py):
a row per architecture of `archs` (one the families do not list says so), each baseline at 1, speed-ups from the
speed simulator; the report's first table puts them beside quality; the tiny CPU benches show no hidden-fraction
plot and no speed-up-vs-degree panel of one point, and a hidden fraction outside [0, 1] is marked noise. At the tiny
shape here (seconds); `make demo` runs it at the Llama 3 8B shape."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from eval.tour_predict import predict_all
from eval.tour_report import cpu_plots, glance_rows, noise_marked, overlap_lines

CONF = str(Path(__file__).resolve().parents[1] / "conf")
TINY = ["compute=h100-sxm", "bench_shape=tiny", "prompt_len=16", "new_tokens=4", "batch_sizes=[1,16]",
        "simulated.links=[nvlink-h100]", "upper_bound.enabled=false", "logger=none"]  # fmt: skip
SP_TINY = ["bench_preset=sp", "bench_shape.num_hidden_layers=1", "sequence_parallel.lengths=[512]",
           "sequence_parallel.sp=[4]", "sequence_parallel.ranks=[last]", "sequence_parallel.links=[nvlink-h100]",
           "sequence_parallel.device_points=[]", "sequence_parallel.bytes.lengths=[512]",
           "sequence_parallel.bytes.sp=[4]", "sequence_parallel.bytes.extra_points=[]"]  # fmt: skip


def test_prediction_step_gives_a_row_per_arch(tmp_path):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("tour", ["archs=[llama,ladder,moe,linear_hybrid]"])
        # at the tiny shape; the MoE family left out, so moe is in no family
        OmegaConf.set_struct(cfg, False)
        cfg.predict.common = TINY
        cfg.predict.families.tensor_parallel.overrides = ["tp=[2]"]
        cfg.predict.families.sequence_parallel.overrides = SP_TINY
        del cfg.predict.families["expert_parallel"]
        predicted = predict_all(cfg, tmp_path)
    rows = {r["arch"]: r for r in predicted["rows"]}
    assert [r["arch"] for r in predicted["rows"]] == ["llama", "ladder", "moe", "linear_hybrid"]
    assert rows["llama"]["against"] == "llama" and rows["llama"]["speedup_b1"] == pytest.approx(1.0)
    assert rows["ladder"]["against"] == "llama" and rows["ladder"]["at"] == "tp=2, nvlink-h100"
    assert rows["ladder"]["speedup_b1"] > 0 and rows["ladder"]["speedup_b16"] > 0 and rows["ladder"]["seconds"] > 0
    assert rows["moe"]["against"] is None and "not predicted" in rows["moe"]["note"]
    hybrid = rows["linear_hybrid"]  # LLLN by LASP-2 / LASP-2H over LASP-1 / ring attention, a training step
    assert hybrid["against"] == "LASP-1 / ring attention" and hybrid["at"] == "sp=4, nvlink-h100"
    assert hybrid["speedup_b1"] > 0 and "speedup_b16" not in hybrid and "LLLN" in hybrid["what"]
    assert set(predicted["commands"]) == {"tensor_parallel", "tensor_parallel, system overlap",
                                          "sequence_parallel (linear_hybrid)"}  # fmt: skip
    # against the baseline under token_split too (no row at batch 1: nothing to split)
    assert rows["ladder"]["overlap_baseline"] == "llama+token_split" and "vs_overlap_b1" not in rows["ladder"]
    assert rows["ladder"]["vs_overlap_b16"] > 0 and rows["llama"]["vs_overlap_b16"] > 0
    (line,) = [x for x in overlap_lines(predicted) if x]
    assert line.startswith("**Against `llama+token_split`**") and "batch 16" in line
    assert f"`ladder` {rows['ladder']['vs_overlap_b16']:.2f}x" in line

    quality = [{"model": "llama", "val loss": 5.0, "val ppl": 148.4}, {"model": "ladder", "val loss": 4.9, "val ppl": 134.3}]
    glance = {r["arch"]: r for r in glance_rows(cfg, quality, predicted)}
    assert glance["ladder"]["quality against"] == "llama" and glance["ladder"]["val loss diff (nats)"] == pytest.approx(-0.1)
    assert glance["ladder"]["speed-up, batch 1"] == rows["ladder"]["speedup_b1"]
    assert glance["linear_hybrid"]["quality against"] == "llama"  # softmax attention, what it replaces
    assert "training step" in glance["linear_hybrid"]["predicted at"]


def test_tiny_cpu_benches_show_no_noise_as_results():
    one_point = {"rows": [{"batch": 1, "degrees": {"tp": 2}}, {"batch": 4, "degrees": {"tp": 2}}]}
    assert "speedup_vs_degree" not in cpu_plots(one_point) and "speedup_vs_batch" in cpu_plots(one_point)
    assert not any("hidden" in name for name in cpu_plots(one_point))
    two = {"rows": [{"batch": 1, "degrees": {"tp": 2}}, {"batch": 1, "degrees": {"tp": 4}}]}
    assert "speedup_vs_degree" in cpu_plots(two) and "speedup_vs_batch" not in cpu_plots(two)
    row = {"arch": "ladder", "hidden (decode)": -0.41, "hidden (exposed, decode)": 0.5}
    shown = noise_marked(row)
    assert shown["hidden (decode)"].endswith("(noise)") and shown["hidden (exposed, decode)"] == 0.5
    assert row["hidden (decode)"] == -0.41  # tour.json keeps the number
