"""eval.costmodel: the speed simulator's validation against the Ladder paper's 70B table and its reference's logged
prefill latencies. The report's plumbing at a tiny shape (fast), and the validation itself at the 70B shape with
the committed constants: every tokens/s cell within 10%, every logged prefill latency within 15%, and every ladder
speed-up (tokens/s and prefill) within 0.05 of the published / logged ones."""

import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from eval.simulator import costmodel as cm

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def _compose(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("costmodel", overrides=list(overrides))
    return {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k not in ("paths", "hydra")}


def test_hidden_fraction_from_tokens_per_second():
    # Times 10, 8 and 6.67 ms per token: (10 - 8) / (10 - 6.67) = 0.6.
    assert cm._hidden(100.0, 125.0, 150.0) == pytest.approx(0.6)


def test_report_at_a_tiny_shape_and_the_fit_only_lowers_the_loss(tmp_path):
    # The tiny shape with 8 heads and 8 KV heads, so that TP 4 and 8 divide them: its numbers mean nothing
    # against the 70B table; the plumbing is what is checked.
    overrides = ["bench_shape=tiny", "bench_shape.num_attention_heads=8", "bench_shape.num_key_value_heads=8",
                 "bench_shape.hidden_size=128", "prompt_len=16", "new_tokens=8"]  # fmt: skip
    given = cm.run_costmodel(_compose(*overrides, "fit=false"), tmp_path / "given")
    fitted = cm.run_costmodel(_compose(*overrides), tmp_path / "fitted")
    assert given["constants"] == given["start"] and not given["fitted"] and fitted["fitted"]
    assert cm.loss(fitted["rows"]) <= cm.loss(given["rows"])
    for name, (lo, hi) in cm.FITTED.items():
        assert lo <= fitted["constants"][name] <= hi
    held = set(cm.FITTED) - set(fitted["fitted_constants"])
    assert len(fitted["fitted_constants"]) <= cm.MAX_FITTED and held
    assert all(fitted["constants"][k] == fitted["start"][k] for k in held)
    rows = fitted["rows"]
    assert [(r["batch"], r["tp"]) for r in rows] == [(1, 8), (4, 8), (16, 8), (1, 4)]
    for r in rows:
        for col in cm.COLUMNS:
            assert r[f"{col}_ratio"] == pytest.approx(r[f"{col}_predicted"] / r[f"{col}_published"])
        # the upper bound is the standard column with free communication: never slower
        assert r["upper_bound_predicted"] >= r["standard_predicted"]
        assert r["upper_bound_prefill_predicted"] <= r["standard_prefill_predicted"]
        for col in cm.COLUMNS:
            if r[f"{col}_prefill_published"] is not None:
                assert r[f"{col}_prefill_ratio"] == pytest.approx(r[f"{col}_prefill_predicted"] / r[f"{col}_prefill_published"])
    assert all(math.isfinite(v) for v in fitted["mean_abs_log_ratio"].values())
    readme = (tmp_path / "fitted" / "README.md").read_text()
    for text in ("| batch/TP | standard pub | standard pred | standard ratio |", "| constant | value | start | fitted | what |",
                 "Mean |log(predicted / published)|", "NVLink link: base",
                 "| batch/TP | standard logged ms | standard pred ms | standard ratio |"):
        assert text in readme
    saved = json.loads((tmp_path / "fitted" / "costmodel.json").read_text())
    assert saved["source"].startswith("Zhang, Mishra") and saved["constants"] == fitted["constants"]
    assert (tmp_path / "fitted" / "costmodel_ratio.png").stat().st_size > 1000


def test_the_reference_record_is_the_papers_table_and_cites_its_logs():
    ref = cm.REFERENCE
    assert ref["source"].startswith("mayank31398/ladder-residual-inference") and len(ref["commit"]) == 40
    # The paper's 70B table: the logs' tokens/s are its numbers.
    table = {(1, 8): (77.39, 101.22, 94.22, 110.59), (4, 8): (258.56, 331.45, 307.34, 355.8),
             (16, 8): (843.15, 1003.52, 973.74, 1109.65), (1, 4): (59.41, 67.51, 65.4, 69.04)}  # fmt: skip
    assert {(p["batch"], p["tp"]): tuple(p[c] for c in cm.COLUMNS) for p in cm.PUBLISHED_70B} == table
    logged = [(c["batch"], c["tp"], col) for c in ref["cells"] for col in cm.COLUMNS if c[col]["prefill_ms"] is not None]
    assert len(logged) == 15 and (16, 8, "ladder") not in logged
    for cell in ref["cells"]:
        for col in cm.COLUMNS:
            assert cell[col]["path"].startswith("final-results-512/") and cell[col]["path"].endswith(
                f"/bs_{cell['batch']}_tp_{cell['tp']}.log"
            )
    # llama 70B at TP 8: about 81 / 260 / 995 ms at batch 1 / 4 / 16, 122 ms at TP 4
    assert [round(c["standard"]["prefill_ms"]) for c in ref["cells"]] == [81, 260, 995, 122]


def test_the_70b_table_is_predicted_within_the_targets(tmp_path):
    # The committed constants (conf/costmodel.yaml: the fit of reports/costmodel), not refitted here.
    result = cm.run_costmodel(_compose("fit=false"), tmp_path)
    assert result["worst_tok_s_error"] < 0.10, result["rows"]
    assert result["worst_prefill_error"] < 0.15, result["rows"]
    assert result["worst_ladder_speedup_error"] < 0.05, result["rows"]
    assert result["worst_ladder_prefill_speedup_error"] < 0.05, result["rows"]
    # llama waits every all-reduce at once: all of its link time is exposed (the standard column's decode)
    for r in result["rows"]:
        assert r["decode_exposed_ms"]["upper_bound"] == 0
        assert r["decode_ms"]["ladder"] < r["decode_ms"]["standard"]


def test_bad_settings_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"Unknown device preset 'tpu'; choose one of"):
        cm.run_costmodel(_compose("device=tpu"), tmp_path)
    with pytest.raises(ValueError, match=r"links.nvlink: Unknown link preset 'infiniband'"):
        cm.run_costmodel(_compose("links.nvlink=infiniband"), tmp_path)
    with pytest.raises(ValueError, match=r"columns.ladder='laddr' is not a zoo architecture"):
        cm.run_costmodel(_compose("columns.ladder=laddr"), tmp_path)
    with pytest.raises(ValueError, match=r"constants.contention=2.0 is outside \(0.0, 1.0\)"):
        cm.run_costmodel(_compose("constants.contention=2"), tmp_path)
    with pytest.raises(ValueError, match=rf"fitted_constants names {len(cm.FITTED)} constants; at most 6 are fitted"):
        cm.run_costmodel(_compose(f"fitted_constants=[{','.join(cm.FITTED)}]"), tmp_path)
