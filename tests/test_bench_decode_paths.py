"""eval.bench, the decode-path section (bench_preset=gqla): off by default, on in the preset; settings fail fast;
rows per path, batch and query length; KV bytes per token from the models' own accounting; its report."""


import pytest
import torch

import models
from eval.bench import check_settings
from eval.bench.settings import model_config
from tests.benchkit import bench_settings, run_here

# --- decode paths (bench_preset=gqla): one device, per path / batch / query length ------------------------


def test_decode_paths_section_is_off_by_default_and_on_in_the_gqla_preset():
    assert not bench_settings()["decode_paths"]["enabled"]
    cfg = bench_settings("bench_preset=gqla")
    assert cfg["decode_paths"]["enabled"] and cfg["archs"] == ["llama", "gqla"]
    assert cfg["decode_paths"]["paths"] == {"gqla": ["absorb", "gqa"]} and cfg["decode_paths"]["q_lens"] == [1, 2]
    # The TP rows stay on the gqa path (the absorb path does not shard).
    assert model_config(cfg, "gqla", {"tp": 2}).attn_path == "gqa"


def test_decode_paths_settings_fail_fast():
    with pytest.raises(ValueError, match="q_lens"):
        check_settings(bench_settings("bench_preset=gqla", "decode_paths.q_lens=[0]"))
    with pytest.raises(ValueError, match="not in archs"):
        check_settings(bench_settings("bench_preset=gqla", "archs=[llama]"))
    with pytest.raises(ValueError, match="decode path"):
        check_settings(bench_settings("bench_preset=gqla", "decode_paths.paths={gqla: [nope]}"))


@pytest.fixture(scope="module")
def gqla_run(tmp_path_factory):
    """The gqla preset at the tiny shape: the decode-path section at batch 1 and 2, and the TP 2 rows on one link."""
    out = tmp_path_factory.mktemp("bench_gqla")
    results = run_here(
        out, "bench_preset=gqla", "bench_shape=tiny",
        "tp=[2]", "batch_sizes=[1]", "prompt_len=8", "new_tokens=3", "warmup=0", "repeats=1",
        "simulated.links=[nvlink-h100]", "real.enabled=false", "decode_paths.batch_sizes=[1,2]",
        "decode_paths.steps=2", "decode_paths.warmup=0", "decode_paths.repeats=1",
    )  # fmt: skip
    return out, results


def test_decode_path_rows_exist_per_path_batch_and_query_length(gqla_run):
    _, results = gqla_run
    rows = results["decode_paths"]["rows"]
    keys = {(r["arch"], r["path"], r["batch"], r["q_len"]) for r in rows}
    variants = [("llama", None), ("gqla", "absorb"), ("gqla", "gqa")]
    assert keys == {(a, p, b, q) for a, p in variants for b in (1, 2) for q in (1, 2)}
    assert len(rows) == len(keys)
    for r in rows:
        assert r["variant"] == "measured" and r["decode_tok_s"] > 0 and r["decode_ms_per_step"] > 0
        assert r["decode_tok_s_min"] <= r["decode_tok_s"] <= r["decode_tok_s_max"]
    # The baseline's own rows: speed-up and KV fraction 1.
    assert all(r["speedup_decode"] == 1.0 and r["kv_fraction"] == 1.0 for r in rows if r["arch"] == "llama")
    # The TP rows of the preset are still measured: gqla (gqa path) beside llama at TP 2.
    tp_rows = [r for r in results["rows"] if r["degrees"] == {"tp": 2}]
    assert {r["arch"] for r in tp_rows} == {"llama", "gqla"}
    assert {r["variant"] for r in tp_rows} == {"simulated", "upper_bound"}


def test_decode_path_kv_bytes_match_the_models_own_accounting(gqla_run):
    _, results = gqla_run
    cfg, dp = results["settings"], results["decode_paths"]
    dtype = getattr(torch, dp["dtype"])
    size = torch.empty((), dtype=dtype).element_size()
    measured = {(r["arch"], r["path"]): r["kv_bytes_per_token"] for r in dp["rows"]}
    for path in ("absorb", "gqa"):
        config = model_config(cfg, "gqla", {}, attn_path=path)
        model = models.get("gqla").model_class(config).to(dtype)
        assert measured[("gqla", path)] == model.kv_bytes_per_token() == config.kv_bytes_per_token(path, dtype)
    llama = model_config(cfg, "llama", {})
    assert measured[("llama", None)] == 2 * llama.num_key_value_heads * llama.head_dim * size
    # The gqa path caches what Llama does at this shape; absorb caches d_c + d_r values.
    assert measured[("gqla", "gqa")] == measured[("llama", None)]
    # At the Llama-3-8B shape (config accounting only): 512 + 64 over 2 x 8 x 128 = 28.125%.
    acc = {(a["arch"], a["path"]): a for a in dp["accounting"]}
    assert acc[("gqla", "absorb")]["kv_fraction"] == pytest.approx(0.28125)
    assert acc[("gqla", "gqa")]["kv_fraction"] == 1.0 and acc[("llama", None)]["kv_bytes_per_token"] == 4096


def test_decode_path_report_has_its_section_and_plot(gqla_run):
    out, _ = gqla_run
    readme = (out / "README.md").read_text()
    assert "## Decode paths (one device, measured)" in readme and "gqla (absorb)" in readme
    assert "28.12" in readme and "llama3-8b" in readme
    assert (out / "decode_paths.png").stat().st_size > 0


