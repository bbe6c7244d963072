"""The linear-attention kernel check: fla's chunk kernel (`models.linear.ops.linear_attention_fla`, fla-core's
`chunk_simple_gla`) against the zoo's chunked kernel (`linear_attention_chunked`) on the same bf16 inputs,
forward only: the time of each (eval.bench.timing's `WallTimer`) and the largest absolute difference of their
outputs. fla runs only where it is installed and a CUDA GPU is there; the result says why not otherwise.
"""

import importlib.util
import statistics

import torch

from eval.gpu_check.environment import package_version
from eval.gpu_check.settings import Settings


def kernel_check(s: Settings, device: torch.device) -> dict:
    """fla's chunk kernel and the zoo's chunked kernel, forward only, on the same bf16 inputs."""
    from eval.bench.timing import WallTimer
    from models.linear.ops import linear_attention_chunked

    b, h, t, d = (s.kernel[k] for k in "BHTD")
    dtype = torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=gen).to(device, dtype) for _ in range(3))
    q = q * d**-0.5
    log_decay = torch.log1p(-(2.0 ** (-5.0 - torch.arange(h, dtype=torch.float32) * 5.0 / h))).to(device)
    out = {"shape": dict(B=b, H=h, T=t, D=d), "dtype": "bfloat16", "layout": "[B, H, T, D]", "decay": "per head",
           "kernels": {}}  # fmt: skip

    timer = WallTimer(device)

    def timed(fn, reps):
        timer.start()
        result = fn()
        first = timer.stop()
        runs = []
        for _ in range(reps):
            timer.start()
            fn()
            runs.append(timer.stop() * 1e3)
        return result, {"first_call_s": first, "forward_ms": statistics.median(runs), "forward_ms_runs": runs}

    reps = 10 if device.type == "cuda" else 2
    with torch.no_grad():
        (zoo_o, zoo_state), zoo = timed(lambda: linear_attention_chunked(q, k, v, log_decay), reps)
        out["kernels"]["zoo linear_attention_chunked (chunk 64)"] = zoo
        if importlib.util.find_spec("fla") is None:
            out["fla"] = "fla not installed"
        elif device.type != "cuda":
            out["fla"] = "not run: fla's Triton kernels need a CUDA GPU"
        else:
            from models.linear.ops import linear_attention_fla

            try:
                (fla_o, fla_state), fla = timed(lambda: linear_attention_fla(q, k, v, log_decay), reps)
            except Exception as err:  # noqa: BLE001 - reported
                out["fla"] = f"fla failed: {type(err).__name__}: {str(err)[:300]}"
            else:
                diff = (fla_o.float() - zoo_o.float()).abs().max().item()
                scale = zoo_o.float().abs().max().item()
                fla["max_abs_diff_vs_zoo"] = diff
                fla["max_abs_zoo_output"] = scale
                fla["state_max_abs_diff_vs_zoo"] = (fla_state.float() - zoo_state.float()).abs().max().item()
                fla["speedup_over_zoo"] = zoo["forward_ms"] / fla["forward_ms"]
                out["kernels"]["fla chunk_simple_gla (linear_attention_fla)"] = fla
                out["fla"] = f"fla {package_version('fla-core') or package_version('flash-linear-attention') or '?'}"
    return out
