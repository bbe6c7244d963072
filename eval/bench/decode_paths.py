"""The decode-path section: on one device, decode tokens/s of each architecture on each of its decode paths.

Per batch size and query length (1 or 2 new tokens per step), timed for real; KV bytes per token per layer from
the model's own accounting (`kv_bytes_per_token`, e.g. a latent cache) or 2 x KV heads x head_dim; also that
accounting at a large shape, config only (`decode_paths.accounting_shape`).
"""

import statistics
from pathlib import Path

import torch
from omegaconf import OmegaConf

import models
from eval.bench.settings import DecodePathsSettings, ModelSettings
from eval.bench.timing import WallTimer
from parallel import comm


def decode_path_variants(dp: DecodePathsSettings, arch: str) -> list:
    """The decode-path variants of `arch` the section measures: `decode_paths.paths[arch]` (values of the
    config field `decode_paths.path_field`), or [None] (the architecture's only path)."""
    return list(dp.paths.get(arch) or [None])


def decode_path_config(dp: DecodePathsSettings, arch: str, path, model: ModelSettings | None = None):
    """`arch`'s one-device config at the bench shape (or `model`'s: another shape), on decode path `path` (None:
    as built)."""
    extra = {} if path is None else {dp.path_field: path}
    return (model or dp.model).config(arch, {}, **extra)


def kv_bytes_per_token(source, config, dtype: torch.dtype) -> int:
    """KV-cache bytes per token per layer. A model or config that accounts for its own cache says so
    (`kv_bytes_per_token(dtype=...)`: a latent cache is not K and V); otherwise a standard K and V cache:
    2 x KV heads x head_dim values."""
    if hasattr(source, "kv_bytes_per_token"):
        return int(source.kv_bytes_per_token(dtype=dtype))
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def check_decode_paths(dp: DecodePathsSettings) -> None:
    for name in dp.paths:
        if name not in dp.archs:
            raise ValueError(f"decode_paths.paths names {name!r}, which is not in archs={list(dp.archs)}.")
    if not dp.q_lens or any(not isinstance(q, int) or q < 1 for q in dp.q_lens):
        raise ValueError(f"decode_paths.q_lens {dp.q_lens} must be integers >= 1 (new tokens per decode step).")
    if not dp.batch_sizes or any(not isinstance(b, int) or b < 1 for b in dp.batch_sizes):
        raise ValueError(f"decode_paths.batch_sizes {dp.batch_sizes} must be integers >= 1.")
    if dp.steps < 1 or dp.repeats < 1 or dp.warmup < 0:
        raise ValueError("decode_paths needs steps >= 1, repeats >= 1 and warmup >= 0.")
    for arch in dp.archs:
        for path in decode_path_variants(dp, arch):
            decode_path_config(dp, arch, path)  # a path the config refuses fails here, before any timing


def build_one_device(seed: int, config, arch: str, device: torch.device, dtype: torch.dtype):
    """A random `arch` model on one device (no mesh), the model's own init from the bench `seed`: every
    path variant of an architecture gets the same weights."""
    torch.manual_seed(seed)
    model = models.get(arch).model_class(config).to(device=device, dtype=dtype)
    model.eval()
    return model


@torch.no_grad()
def decode_once(model, prompt: torch.Tensor, steps: torch.Tensor, device: torch.device) -> float:
    """Prefill `prompt` (not timed), then one forward per step of `steps` [batch, n_steps, q_len] with the
    cache: the wall time of the decode steps. The tokens are fixed random ones (a step of q_len > 1 tokens
    is what a draft-verify or multi-token decode feeds; greedy picks only one)."""
    cache = model(prompt, use_cache=True, logits_to_keep=1).cache
    timer = WallTimer(device)
    timer.start()
    for i in range(steps.shape[1]):
        cache = model(steps[:, i], cache=cache, use_cache=True, logits_to_keep=1).cache
    return timer.stop()


def decode_paths(dp: DecodePathsSettings, device: torch.device, dtype: torch.dtype) -> dict:
    """On this one device: decode tokens/s of every architecture of `archs` on each of its decode-path
    variants, per batch size and query length (new tokens per step), timed for real and interleaved over
    repeats; KV bytes per token per layer from the model's own accounting (or 2 x KV heads x head_dim), and
    the same accounting at `decode_paths.accounting_shape` (config only, nothing built)."""
    baseline = dp.baseline
    built, rows = {}, []
    for arch in dp.archs:
        for path in decode_path_variants(dp, arch):
            config = decode_path_config(dp, arch, path)
            model = build_one_device(dp.seed, config, arch, device, dtype)
            built[(arch, path)] = model
            rows.append({"arch": arch, "path": path, "kv_bytes_per_token": kv_bytes_per_token(model, config, dtype)})
    kv = {(r["arch"], r["path"]): r["kv_bytes_per_token"] for r in rows}
    base_kv = kv[(baseline, decode_path_variants(dp, baseline)[0])]
    vocab, timed = dp.model.shape["vocab_size"], []
    for batch in dp.batch_sizes:
        for q_len in dp.q_lens:
            gen = torch.Generator().manual_seed(dp.seed + 1000 * batch + q_len)
            prompt = torch.randint(0, vocab, (batch, dp.prompt_len), generator=gen).to(device)
            steps = torch.randint(0, vocab, (batch, dp.steps, q_len), generator=gen).to(device)
            times = {key: [] for key in built}
            with comm.use_mode("none"):
                for model in built.values():
                    for _ in range(dp.warmup):
                        decode_once(model, prompt, steps, device)
                for _ in range(dp.repeats):
                    for key, model in built.items():
                        times[key].append(decode_once(model, prompt, steps, device))
            new = batch * q_len * dp.steps
            for (arch, path), t in times.items():
                timed.append({
                    "arch": arch, "path": path, "batch": batch, "q_len": q_len, "variant": "measured",
                    "decode_ms_per_step": 1e3 * statistics.median(t) / dp.steps,
                    "decode_tok_s": new / statistics.median(t), "decode_tok_s_min": new / max(t),
                    "decode_tok_s_max": new / min(t), "kv_bytes_per_token": kv[(arch, path)],
                    "kv_fraction": kv[(arch, path)] / base_kv,
                })  # fmt: skip
    for row in timed:
        base = next(r for r in timed if r["arch"] == baseline and r["batch"] == row["batch"] and r["q_len"] == row["q_len"])
        row["speedup_decode"] = row["decode_tok_s"] / base["decode_tok_s"]
    del built
    accounting = []
    name = dp.accounting_shape
    if name:
        shape = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[2] / "conf" / "bench_shape" / f"{name}.yaml"))
        at_shape = dp.model.at_shape(shape)
        for arch in dp.archs:
            for path in decode_path_variants(dp, arch):
                config = decode_path_config(dp, arch, path, at_shape)
                accounting.append({"arch": arch, "path": path, "shape": name, "dtype": "bfloat16",
                                   "kv_bytes_per_token": kv_bytes_per_token(config, config, torch.bfloat16)})  # fmt: skip
        base_acc = next(a for a in accounting if a["arch"] == baseline)["kv_bytes_per_token"]
        for a in accounting:
            a["kv_fraction"] = a["kv_bytes_per_token"] / base_acc
    return {"kv": rows, "rows": timed, "accounting": accounting, "dtype": str(dtype).removeprefix("torch.")}


