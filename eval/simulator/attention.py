"""How the speed simulator charges attention: `F.scaled_dot_product_attention` as the kernels a GPU runs for it.

The program is an explicit choice of the recording (`DeviceClock(attention_program=...)`,
`record_generation(attention_program=...)`), never fitted; each kernel is charged its FLOPs and the HBM bytes it moves
(eval.simulator.device turns them into seconds).

The programs (ATTENTION_PROGRAMS), not the math decomposition the meta device happens to run:
- `flash` (the default): one fused kernel (reads Q, K, V once, writes the output; FLOPs 4 B H Tq Tk d, half of the
  Tq x Tk square when causal; with grouped KV heads each KV head is read once, `enable_gqa`);
- `gqa_expand`: K and V repeated to every query head first, one more kernel writing the copy that attention reads;
- `math`: gpt-fast's static-cache program as written: two repeat_interleave copies, Q K^T writing the scores
  [B, H, Tq, max_len] to HBM, the mask and softmax over them, P V reading the repeated V (`math_attention_charges`:
  each kernel's bytes; the full square, nothing skipped);
- `inductor`: what torch.compile makes of `math` with coordinate-descent tuning (gpt-fast's setting, and the
  committed Ladder fit's): a prefill as `math`, a decode step as fused reductions that read each KV head once per
  query head and write no copy (`decode_reduction_charges`).
"""

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# How `F.scaled_dot_product_attention` is charged: the program a GPU runs for it, an explicit choice of the
# recording (`DeviceClock(attention_program=...)`, `record_generation(attention_program=...)`), never fitted.
ATTENTION_PROGRAMS = {
    "flash": "flash attention: one fused kernel reading each KV head once (enable_gqa), scores never in HBM",
    "gqa_expand": "K and V repeated to every query head by one kernel, then the fused kernel over the copy",
    "math": "the math decomposition over a repeated K / V under a mask (gpt-fast's static-cache program as "
            "written): two repeat_interleave copies, Q K^T writing the scores [B, H, Tq, Tk] to HBM, the mask "
            "and softmax over them, P V",
    "inductor": "what torch.compile (Inductor) generates from the math program with coordinate-descent tuning on "
                "(gpt-fast's setting): a prefill as `math`; a decode step (one query) as fused reductions, each "
                "query head reading its KV head's rows from the cache, nothing repeated or written to HBM",
}  # fmt: skip


def attention_program_of(gqa_expand: bool = False, program: str | None = None) -> str:
    """The attention program a recording charges: `program` if given, else `gqa_expand` or `flash` (the old flag,
    kept for the committed Ladder fit, conf/costmodel.yaml)."""
    if program is None:
        return "gqa_expand" if gqa_expand else "flash"
    if program not in ATTENTION_PROGRAMS:
        raise ValueError(f"attention_program={program!r}; choose one of {list(ATTENTION_PROGRAMS)}.")
    if gqa_expand and program != "gqa_expand":
        raise ValueError(f"gqa_expand=True and attention_program={program!r} disagree; give one of them.")
    return program


def attention_charges(
    q, k, v, kwargs: dict, gqa_expand: bool = False, *, program: str | None = None, fuse_pointwise: bool = True
) -> list[tuple[str, float, float]]:
    """`F.scaled_dot_product_attention(q, k, v, **kwargs)` as the kernels a GPU runs (module docstring), each
    (name, FLOPs, HBM bytes), under `program` (ATTENTION_PROGRAMS; None: `gqa_expand` or `flash`)."""
    program = attention_program_of(gqa_expand, program)
    if program == "inductor" and q.shape[-2] == 1:
        return decode_reduction_charges(q, k, v, kwargs)
    if program in ("math", "inductor"):
        return math_attention_charges(q, k, v, kwargs, fuse_pointwise)
    b, h, tq, d = q.shape
    tk = k.shape[-2]
    flops = 4 * b * h * tq * tk * d
    if kwargs.get("is_causal") and tq > 1:
        flops //= 2  # the blocks above the diagonal are skipped
    mask = kwargs.get("attn_mask")
    kv_bytes = tensor_bytes(k) + tensor_bytes(v)
    out = []
    if program == "gqa_expand" and k.shape[-3] < h:
        expanded = kv_bytes * h // k.shape[-3]  # K and V repeated to every query head
        out.append(("repeat_kv", 0, kv_bytes + expanded))
        kv_bytes = expanded
    nbytes = tensor_bytes(q) + kv_bytes + tensor_bytes(q) * v.shape[-1] // d
    if isinstance(mask, torch.Tensor):
        nbytes += tensor_bytes(mask)
    out.append(("scaled_dot_product_attention", flops, nbytes))
    return out


def math_attention_charges(q, k, v, kwargs: dict, fuse_pointwise: bool = True) -> list[tuple[str, float, float]]:
    """The math program's kernels (ATTENTION_PROGRAMS["math"]), from the bytes each one moves, in the input dtype:

    1. `repeat_interleave` of K, then of V, to every query head (with grouped KV heads): read once, written
       H / H_kv times;
    2. Q K^T: 2 B H Tq Tk d FLOPs, reading Q and the repeated K, writing the scores [B, H, Tq, Tk];
    3. the mask added to the scores and the softmax: elementwise into the softmax's one pass when pointwise ops
       are fused (a compiled program: reads the scores and the mask, writes the probabilities), else the add is
       a kernel of its own (scores and mask read, scores written); a causal call without a mask reads a
       [Tq, Tk] boolean one (the math decomposition builds it); the scale (Q and K times sqrt(scale)) is
       elementwise too, fused, or a pass over Q and K unfused;
    4. P V: 2 B H Tq Tk d_v FLOPs, reading the probabilities and the repeated V, writing the output.

    Nothing above the causal diagonal is skipped: the scores are materialised in full."""
    b, h, tq, d = q.shape
    hkv, tk, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    e = q.element_size()
    k_bytes, v_bytes = tensor_bytes(k), tensor_bytes(v)
    out = []
    if hkv < h:
        out.append(("attention_math:repeat_interleave_k", 0, k_bytes + k_bytes * h // hkv))
        out.append(("attention_math:repeat_interleave_v", 0, v_bytes + v_bytes * h // hkv))
        k_bytes, v_bytes = k_bytes * h // hkv, v_bytes * h // hkv
    if not fuse_pointwise:
        out.append(("attention_math:scale", 0, 2 * (tensor_bytes(q) + k_bytes)))
    scores = b * h * tq * tk * e
    out.append(("attention_math:qk", 2 * b * h * tq * tk * d, tensor_bytes(q) + k_bytes + scores))
    mask = kwargs.get("attn_mask")
    if isinstance(mask, torch.Tensor):
        mask_bytes = tensor_bytes(mask)
    else:
        mask_bytes = tq * tk if kwargs.get("is_causal") and tq > 1 else 0
    if mask_bytes and not fuse_pointwise:
        out.append(("attention_math:mask_add", 0, 2 * scores + mask_bytes))
        mask_bytes = 0
    out.append(("attention_math:softmax", 0, 2 * scores + mask_bytes))
    out.append(("attention_math:pv", 2 * b * h * tq * tk * dv, scores + v_bytes + b * h * tq * dv * e))
    return out


def decode_reduction_charges(q, k, v, kwargs: dict) -> list[tuple[str, float, float]]:
    """One query per sequence (a decode step) under Inductor with `coordinate_descent_tuning` (ATTENTION_PROGRAMS
    ["inductor"]). Inductor's decomposition of `bmm` (torch/_inductor/decomposition.py) turns a batched matmul
    with one row (Q K^T and P V at Tq = 1) into an elementwise product and a sum, which it fuses with what feeds
    it: the `repeat_interleave` of K and V becomes an index into the cache, the mask and softmax join the
    reductions. So no repeated copy reaches HBM; each query head's reduction reads its own KV head's rows, so
    every KV head is read H / H_kv times (no reuse through L2 assumed: one layer's cache outgrows the L2 from batch
    8 at 8B, TP 1). Three kernels, as Inductor cannot fuse reductions over different dimensions: Q K^T (a sum over
    d, writing the scores [B, H, 1, Tk], small beside the cache), the masked softmax over Tk, and P V (a sum over
    Tk, writing the output); 2 B H Tk d FLOPs in each product."""
    b, h, _, d = q.shape
    hkv, tk, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    e = q.element_size()
    scores = b * h * tk * e
    mask = kwargs.get("attn_mask")
    mask_bytes = tensor_bytes(mask) if isinstance(mask, torch.Tensor) else 0
    return [
        ("attention_decode:qk", 2 * b * h * tk * d, tensor_bytes(q) + tensor_bytes(k) * h // hkv + scores),
        ("attention_decode:softmax", 0, 2 * scores + mask_bytes),
        ("attention_decode:pv", 2 * b * h * tk * dv, scores + tensor_bytes(v) * h // hkv + b * h * dv * e),
    ]


def sdpa_keywords(args: tuple, kwargs: dict) -> tuple:
    """(q, k, v, kwargs) of a call to F.scaled_dot_product_attention, its positional options as keywords."""
    q, k, v, rest = *args[:3], args[3:]
    if rest:
        kwargs = {**dict(zip(("attn_mask", "dropout_p", "is_causal"), rest, strict=False)), **kwargs}
    return q, k, v, kwargs
