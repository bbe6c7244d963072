"""What one run of the GPU check measures, and how: the command line's flags read into `Settings`.

`parse_args` reads the flags (argparse), fills in the defaults of a full run or of `--quick`, refuses unknown
architectures and bench shapes before anything is measured, and picks the device. `load_shape` and
`device_model_constants` read the bench shapes and the device model's constants from conf/.
"""

import argparse
import difflib
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ARCHS = ("llama", "ladder", "kraken", "moe", "scmoe", "gqla")
PREDICT_DEVICE = "h200"  # eval.simulator.device.DEVICES; h100-sxm where a checkout lacks it
# The --help line.
DESCRIPTION = (
    "The prepared GPU check: one script, one GPU, about six minutes, a Markdown + JSON report."
)


@dataclass
class Settings:
    """One run's settings: what parse_args made of the flags (and --quick's or a full run's defaults)."""

    device: str
    dtype: torch.dtype
    shapes: list
    archs: list
    degree: int
    batches: list
    compiled_batches: list
    prompt_len: int
    eager_steps: int
    compiled_steps: int
    warmup: int
    compile_calls: int
    repeats: int
    backend: str
    mode: str | None
    budget_s: float
    mem_frac: float
    workers: int
    kernel: dict
    compile_prior: tuple  # (a, b): a compile of an L-layer step takes a + b L seconds, before any is measured

    @property
    def capacity(self) -> int:
        """Tokens of every static cache: prompt + the most steps one sequence takes, rounded up to 8 (as
        record_generation rounds prompt + new_tokens)."""
        steps = max(self.warmup + self.eager_steps, self.warmup + self.compiled_steps, self.compile_calls)
        return -(-(self.prompt_len + steps) // 8) * 8

    @property
    def new_tokens(self) -> int:
        """record_generation's new_tokens whose cache is `capacity` long (the decode step's cost on a static
        cache depends on its length, not on its fill level)."""
        return self.capacity - self.prompt_len


def load_shape(name: str) -> dict:
    shape = yaml.safe_load((ROOT / "conf" / "bench_shape" / f"{name}.yaml").read_text())
    shape.pop("name", None)
    return shape


def device_model_constants() -> dict:
    return dict(yaml.safe_load((ROOT / "conf" / "bench.yaml").read_text())["device_model"])


def check_names(archs: list[str], shapes: list[str]) -> None:
    """Unknown architectures or bench shapes are refused before anything is measured (exit status 1)."""
    import models

    names = [*models.ZOO, *models.variants()]  # the architectures and their ladder variants (gqla_ladder)
    unknown = [a for a in archs if a not in names]
    if unknown:
        near = {a: difflib.get_close_matches(a, names, n=1) for a in unknown}
        hint = "".join(f" ({a}: did you mean {near[a][0]}?)" for a in unknown if near[a])
        raise SystemExit(
            f"Error: --archs names unknown architecture{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}{hint}; the zoo has {', '.join(sorted(models.ZOO))} and the ladder "
            f"variants {', '.join(models.variants())}."
        )
    known = sorted(p.stem for p in (ROOT / "conf" / "bench_shape").glob("*.yaml"))
    unknown = [sh for sh in shapes if sh not in known]
    if unknown:
        raise SystemExit(
            f"Error: --shapes names unknown bench shape{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; the shapes are {', '.join(known)} (conf/bench_shape/)."
        )


def predict_device() -> str:
    from parallel.devices import DEVICES

    return PREDICT_DEVICE if PREDICT_DEVICE in DEVICES else "h100-sxm"


def parse_args(argv=None) -> tuple[argparse.Namespace, Settings]:
    p = argparse.ArgumentParser(prog="python -m eval.gpu_check", description=DESCRIPTION)
    p.add_argument("--out", default="reports/gpu-check-h200", help="report folder (README.md, results.json)")
    p.add_argument(
        "--overwrite", action="store_true",
        help="replace a report already in --out (without it, a folder that holds one is refused)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny shape, llama and moe, few steps: a smoke run")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    p.add_argument("--budget", type=float, default=420.0, help="seconds; what would run past it is skipped")
    p.add_argument(
        "--archs", default=None, help="comma-separated (default: llama,ladder,kraken,moe,scmoe,gqla)"
    )
    p.add_argument("--shapes", default=None, help="bench shapes (default: llama3-8b,llama3-70b; quick: tiny)")
    p.add_argument(
        "--degree", type=int, default=None, help="TP (EP for the MoE family) degree rank 0 plays (8)"
    )
    p.add_argument("--batches", default=None, help="eager batch sizes (default 1,8; quick: 1)")
    p.add_argument("--compiled-batches", default=None, help="compiled batch sizes, in order (default 1,8)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (128; quick: 16)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats, median reported (3; quick: 2)")
    p.add_argument(
        "--backend", default="inductor", help="compile backend (inductor; aot_eager for fast tests)"
    )
    p.add_argument(
        "--mem-frac", type=float, default=0.6, help="largest share of GPU memory one model's weights take"
    )
    p.add_argument(
        "--workers", type=int, default=None, help="CPU processes recording predictions (GPU: 3; CPU: 0)"
    )
    args = p.parse_args(argv)

    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"Error: --device {args.device}: CUDA is not available (torch {torch.__version__}); use --device cpu."
        )
    cuda = name.startswith("cuda")
    quick = args.quick

    def ints(text, default):
        try:
            values = [int(x) for x in text.split(",")] if text else list(default)
        except ValueError:
            raise SystemExit(f"Error: {text!r} is not a comma-separated list of integers (e.g. 1,8).") from None
        if any(v < 1 for v in values):
            raise SystemExit(f"Error: batch sizes {text!r}: each must be a positive integer (e.g. 1,8).")
        return values

    shapes = args.shapes.split(",") if args.shapes else (["tiny"] if quick else ["llama3-8b", "llama3-70b"])
    archs = args.archs.split(",") if args.archs else (["llama", "moe"] if quick else list(DEFAULT_ARCHS))
    check_names(archs, shapes)
    batches = ints(args.batches, [1] if quick else [1, 8])
    settings = Settings(
        device=name,
        dtype=torch.bfloat16 if cuda else torch.float32,  # bf16 matmuls are slow on most CPUs
        shapes=shapes,
        archs=archs,
        degree=args.degree or (2 if quick else 8),
        batches=batches,
        compiled_batches=ints(args.compiled_batches, [1] if quick else [1, 8]),
        prompt_len=args.prompt or (16 if quick else 128),
        eager_steps=4 if quick else 10,
        compiled_steps=4 if quick else 50,
        warmup=1 if quick else 2,
        compile_calls=2 if quick else 3,  # CUDA graphs: 1 compiles (and warms up), 2 records, 3 replays
        repeats=args.repeats or (2 if quick else 3),
        backend=args.backend,
        mode="reduce-overhead" if cuda else None,  # no CUDA graphs on a CPU
        budget_s=args.budget,
        mem_frac=args.mem_frac,
        workers=args.workers if args.workers is not None else (3 if cuda else 0),
        kernel=dict(B=1, H=2, T=256, D=32) if quick or not cuda else dict(B=1, H=16, T=8192, D=128),
        compile_prior=(15.0, 2.0) if cuda else (5.0, 10.0),
    )
    return args, settings
