"""The bench's settings: degree points, compute (measured or a device preset), links, checks, device, hardware.

Everything here reads `conf/bench.yaml` (composed with a `bench_preset` and overrides) and nothing is timed:
which mesh degree points are measured (`bench_points`, `real_points`; `degree_points` / `degrees_key` /
`degrees_label` / `ranks` name them), how a bench shape becomes an architecture's config (`model_config`: its
registry entry's `bench_config`), which architectures fit each point (`archs_at_points`: each one's own
`check_layout`), the checks of the generation settings (`check_generation_settings`; every section adds its
own, eval.bench.app.check_settings runs them all), the device and dtype, threads and what results.json says
about the machine.
"""

import math
import os
import platform
from pathlib import Path

import torch
import transformers

import models
from eval.simulator.device import ATTENTION_PROGRAMS, DEVICES, DeviceModel
from parallel.link import LINK_PRESETS
from parallel.mesh import DIM_ORDER


def bench_points(cfg: dict) -> list[dict[str, int]]:
    """The points the single-process variants (simulated, upper bound) measure."""
    return degree_points(cfg["tp"], cfg.get("ep"), cfg.get("degrees"))


def real_points(cfg: dict) -> list[dict[str, int]]:
    """The points launched as real processes (after `resolve_real`)."""
    real = cfg["real"]
    if not real["enabled"]:
        return []
    return degree_points(real["tp"], real.get("ep"), real.get("degrees"))


# The dtype of the device model's rows: a GPU's (the meta device allocates nothing, so no CPU cost).
SIMULATED_DTYPE = torch.bfloat16


def compute_of(cfg: dict) -> str:
    """The `compute` setting: `measured`, or a device preset name (eval.simulator.device.DEVICES)."""
    return cfg.get("compute") or "measured"


def predicted(cfg: dict) -> bool:
    """Whether the simulated and upper-bound rows are a device model's prediction (not measured here)."""
    return compute_of(cfg) != "measured"


def check_compute(cfg: dict) -> None:
    compute = compute_of(cfg)
    if compute != "measured" and compute not in DEVICES:
        raise ValueError(
            f"Unknown compute={compute!r}; choose 'measured' (time rank 0's compute on this machine) or a device "
            f"preset of eval.simulator.device.DEVICES: {sorted(DEVICES)}."
        )
    if compute != "measured":
        device_model(cfg)  # constants out of range fail here, before anything runs
        attention_program(cfg)


def attention_program(cfg: dict) -> str:
    """How the device model charges attention (`attention_program`, with a device preset: flash by default;
    gqa_expand or math as the Ladder reference runs it, eval.simulator.device.ATTENTION_PROGRAMS; conf/bench.yaml)."""
    program = cfg.get("attention_program") or "flash"
    if program not in ATTENTION_PROGRAMS:
        raise ValueError(f"attention_program={program!r}; choose one of {list(ATTENTION_PROGRAMS)}.")
    return program


def device_model(cfg: dict) -> DeviceModel:
    """The `device_model` constants (conf/bench.yaml) on the `compute` preset."""
    return DeviceModel.from_config(compute_of(cfg), **cfg["device_model"])


def compute_info(cfg: dict) -> dict:
    """What results.json records about the compute: the setting and, for a device preset, the model."""
    if not predicted(cfg):
        return {"setting": "measured"}
    dm = device_model(cfg)
    return {
        "setting": compute_of(cfg),
        "device": {"name": dm.device.name, "peak_flops": dm.device.peak_flops, "hbm_Bps": dm.device.hbm_Bps,
                   "note": dm.device.note},
        "eff_flops": dm.eff_flops,
        "eff_hbm": dm.eff_hbm,
        "kernel_overhead_us": dm.kernel_overhead_s * 1e6,
        "contention": dm.contention,
        "contention_bw": dm.contention if dm.contention_bw is None else dm.contention_bw,
        "dtype": str(SIMULATED_DTYPE).removeprefix("torch."),
        "static_cache": bool(cfg.get("static_cache", True)),
        "attention_program": attention_program(cfg),
    }  # fmt: skip


def resolve_real(cfg: dict, device_type: str) -> dict:
    """`auto` real degrees: on CPU only 2-rank points ([2] for an axis the bench measures; every rank needs
    cores of its own), every point on GPUs (one needing more GPUs than the machine has is skipped later).
    With a device preset as `compute` the real variant is off: it would measure this machine."""
    real = dict(cfg["real"])
    if predicted(cfg):
        real["enabled"] = False
    for axis in ("tp", "ep"):
        if real.get(axis, "auto") == "auto":
            wanted = list(cfg.get(axis) or [])
            real[axis] = ([2] if wanted else []) if device_type == "cpu" else wanted
    if real.get("degrees", "auto") == "auto":
        real["degrees"] = [] if device_type == "cpu" else list(cfg.get("degrees") or [])
    return {**cfg, "real": real}


def model_config(cfg: dict, arch: str, degrees: dict[str, int], **extra):
    """The config of `arch` at the bench shape and `degrees`, as its own folder builds it (its registry
    entry's `bench_config`), with `config_overrides[arch]` on top (and `extra` on top of those)."""
    shape = {k: v for k, v in cfg["bench_shape"].items() if k != "name"}
    overrides = (cfg.get("config_overrides") or {}).get(arch) or {}
    return models.get(arch).bench_config(shape, degrees, **{**overrides, **extra})


def archs_at_points(cfg: dict, points: list[dict[str, int]]) -> tuple[dict[tuple, list[str]], list[str]]:
    """Which of `archs` run at each degree point ({degrees_key: [arch, ...]}) and a note for each one
    skipped: its sharding.py has no layout over a dimension of the point (llama at ep 2: parallelize would
    replicate it there, so it would communicate nothing over that dimension and there is nothing to
    compare), or its config or `check_layout` refuses the point. A point that no architecture fits is an
    error naming each one's reason."""
    archs_at, skipped = {}, []
    for degrees in points:
        label, fit, refused = degrees_label(degrees), [], []
        for arch in cfg["archs"]:
            entry = models.get(arch)
            missing = [dim for dim, n in degrees.items() if n > 1 and dim not in entry.degrees]
            if missing:
                refused.append(
                    f"{arch}: no {'/'.join(missing)} layout (its sharding.py shards over {list(entry.degrees)}), "
                    f"so at {label} it would run replicated with nothing to communicate over {'/'.join(missing)}."
                )
                continue
            try:
                entry.check_layout(model_config(cfg, arch, degrees), degrees)
            except ValueError as err:
                refused.append(f"{arch}: {err}")
            else:
                fit.append(arch)
        if not fit:
            raise ValueError(f"No architecture of archs={list(cfg['archs'])} fits the degrees {label}. " + " ".join(refused))
        archs_at[degrees_key(degrees)] = fit
        skipped += [f"{label}: {reason}" for reason in refused]
    return archs_at, skipped


def link_label(link) -> str:
    """A `simulated.links` entry as rows name it: the preset, or `ep=pcie4,tp=nvlink-h100` per dimension."""
    if isinstance(link, dict):
        return ",".join(f"{dim}={preset}" for dim, preset in sorted(link.items()))
    return link


def link_of(link, dim: str) -> str | None:
    """The preset a collective over mesh dimension `dim` runs on under this `simulated.links` entry."""
    return link.get(dim) if isinstance(link, dict) else link


def _check_degree_list(values, name: str, cfg: dict) -> None:
    """Degrees >= 2 when compute is measured (rank 0 of P >= 2 is what is timed here); with a device preset
    degree 1 too: the single-GPU baseline, the model unsharded, no collectives (a speed-up over one GPU)."""
    least = 1 if predicted(cfg) else 2
    for p in values or ():
        if isinstance(p, bool) or not isinstance(p, int) or p < least:
            if least == 1:
                raise ValueError(f"{name} degree {p!r} must be a positive integer (1: the single-GPU baseline).")
            raise ValueError(
                f"{name} degree {p!r} in the bench must be an integer >= 2 with compute=measured (degree 1 has no "
                "communication to measure here); the single-GPU baseline (degree 1) is predicted with compute=<a "
                f"device preset>, one of {sorted(DEVICES)}."
            )


def _check_points(points: list[dict[str, int]], what: str, single_ok: bool = False) -> None:
    """Each point names mesh dimensions with positive degrees; one rank in all only where `single_ok` (a device
    preset's single-GPU baseline)."""
    for d in points:
        bad = [k for k in d if k not in DIM_ORDER]
        if bad:
            raise ValueError(f"{what} point {d} names {bad}; mesh dimensions are {list(DIM_ORDER)}.")
        for k, p in d.items():
            if isinstance(p, bool) or not isinstance(p, int) or p < 1:
                raise ValueError(f"{what} point {d}: {k}={p!r} must be a positive integer.")
        if ranks(d) < 2 and not single_ok:
            raise ValueError(
                f"{what} point {d} has one rank, so no communication to measure; give a degree >= 2 (one rank, the "
                f"single-GPU baseline, is predicted with compute=<a device preset>, one of {sorted(DEVICES)})."
            )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_numbers(cfg: dict) -> None:
    """The generation section's sizes and counts, each an integer in its range: a negative prompt_len failed
    45 lines into the first model's prefill ("negative dimension -4")."""
    least = {"prompt_len": (1, "prompt tokens"), "new_tokens": (2, "the first from prefill, the rest decode steps"),
             "warmup": (0, "untimed runs"), "repeats": (1, "timed runs")}  # fmt: skip
    for key, (low, what) in least.items():
        if key not in cfg:
            continue
        value = cfg[key]
        if not _is_int(value) or value < low:
            raise ValueError(f"{key}={value!r}: must be an integer >= {low} ({what}).")
    sizes = cfg.get("batch_sizes")
    if sizes is not None:
        if not isinstance(sizes, (list, tuple)) or not sizes:
            raise ValueError(f"batch_sizes={sizes!r}: must be a non-empty list of positive integers, e.g. [1,4].")
        bad = [b for b in sizes if not _is_int(b) or b < 1]
        if bad:
            raise ValueError(f"batch_sizes={list(sizes)}: {bad} not a positive integer; e.g. batch_sizes=[1,4].")


def check_generation_settings(cfg: dict) -> dict:
    """Fail before measuring anything if a setting of the generation section is out of range or an
    architecture cannot be built at the shape (the sections' own checks: their modules). Returns `cfg` with
    its real degrees resolved (`resolve_real`)."""
    check_numbers(cfg)
    check_compute(cfg)
    _check_degree_list(cfg["tp"], "TP", cfg)
    _check_degree_list(cfg.get("ep"), "EP", cfg)
    points = bench_points(cfg)
    _check_points(points, "degrees", single_ok=predicted(cfg))
    sp_enabled = (cfg.get("sequence_parallel") or {}).get("enabled")
    if not points and not sp_enabled:
        raise ValueError(
            "No degree point to measure: give tp, ep or degrees (e.g. tp=[2] or ep=[2]), or turn on the "
            "sequence_parallel section (bench_preset=sp)."
        )
    cfg = resolve_real(cfg, resolve_device(cfg)[0].type)
    if cfg["real"]["enabled"]:  # off with a device preset (resolve_real), whose points may be degree 1
        _check_degree_list(cfg["real"]["tp"], "real TP", {**cfg, "compute": "measured"})
        _check_degree_list(cfg["real"].get("ep"), "real EP", {**cfg, "compute": "measured"})
    reals = real_points(cfg)
    _check_points(reals, "real")
    for name in cfg.get("config_overrides") or {}:
        if name not in cfg["archs"]:
            raise ValueError(f"config_overrides names {name!r}, which is not in archs={list(cfg['archs'])}.")
    for arch in cfg["archs"]:
        if models.get(arch).bench_config is None:
            raise ValueError(
                f"Architecture {arch!r} declares no bench_config (models/<name>/entry.py, passed to "
                "models.register), so the bench cannot build it at a shape; leave it out of archs."
            )
    if cfg["baseline"] not in cfg["archs"]:
        raise ValueError(f"baseline={cfg['baseline']!r} must be one of archs={list(cfg['archs'])}.")
    if cfg["new_tokens"] < 2:
        raise ValueError(f"new_tokens={cfg['new_tokens']} leaves no decode step; use at least 2.")
    if cfg["compile"] not in (False, True, "both"):
        raise ValueError(
            f"compile={cfg['compile']!r}: use false (eager steps), true (prefill and decode step compiled whole) "
            "or both (eager and compiled rows in one run)."
        )
    if cfg["compile"] and not cfg.get("static_cache", True):
        raise ValueError(
            f"compile={cfg['compile']!r} needs static_cache=true: a compiled decode step runs on a static cache "
            "(a growing one changes shape at every step)."
        )
    if cfg["repeats"] < 1:
        raise ValueError(f"repeats={cfg['repeats']} must be at least 1.")
    for link in cfg["simulated"]["links"]:
        presets = link.values() if isinstance(link, dict) else [link]
        for preset in presets:
            if preset not in LINK_PRESETS:
                raise ValueError(f"Unknown link preset {preset!r}; choose from {sorted(LINK_PRESETS)}.")
        if isinstance(link, dict) and [dim for dim in link if dim not in DIM_ORDER]:
            raise ValueError(f"simulated.links entry {link} names a dimension outside the mesh's {list(DIM_ORDER)}.")
        if isinstance(link, dict) and cfg["simulated"]["enabled"]:
            for d in points:
                missing = [dim for dim, n in d.items() if n > 1 and dim not in link]
                if missing:
                    raise ValueError(
                        f"simulated.links entry {link} names no link for {missing}, which the point {d} "
                        f"communicates over; add one (e.g. {{{missing[0]}: pcie4}}) or give one preset for all."
                    )
    return cfg


def archs_at_all_points(cfg: dict) -> tuple[dict[tuple, list[str]], list[str]]:
    """`archs_at_points` over the single-process and the real points (`cfg` with its real degrees resolved,
    as `check_generation_settings` returns it); a real point's skip notes apart."""
    reals = real_points(cfg)
    archs_at, skipped = archs_at_points(cfg, bench_points(cfg))
    if reals:
        real_at, real_skipped = archs_at_points(cfg, reals)
        archs_at.update(real_at)
        skipped += [f"real {note}" for note in real_skipped if note not in skipped]
    return archs_at, skipped


def resolve_device(cfg: dict) -> tuple[torch.device, torch.dtype]:
    name = cfg["device"]
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={cfg['device']} but CUDA is not available on this machine (torch {torch.__version__}); "
            "use device=auto or device=cpu."
        )
    dtype = cfg["dtype"]
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return device, getattr(torch, dtype)


def cpu_threads(cfg: dict) -> int | None:
    """Threads per process: `auto` = one rank's share of the cores when the largest P ranks share them
    (the most ranks of any point measured, simulated or real; `cfg` with its real degrees resolved)."""
    if cfg["threads"] != "auto":
        return int(cfg["threads"]) if cfg["threads"] else None
    # No degree point (only the sequence_parallel section, one process): all the cores.
    most = max((ranks(d) for d in [*bench_points(cfg), *real_points(cfg)]), default=1)
    return max(1, len(os.sched_getaffinity(0)) // most)


def hardware_info(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": _cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"



# degrees
# --- degrees -----------------------------------------------------------------------------------


def degrees_key(degrees: dict[str, int]) -> tuple:
    """A hashable, order-free form of a degrees dict, to index rows by."""
    return tuple(sorted(degrees.items()))


def degrees_label(degrees: dict[str, int], sep: str = "=") -> str:
    """`tp=2` (tables), `tp2` (W&B keys, with sep=""); several dimensions joined by commas / dashes."""
    return ("," if sep else "-").join(f"{dim}{sep}{n}" for dim, n in sorted(degrees.items()))


def ranks(degrees: dict[str, int]) -> int:
    """Processes a run at these degrees takes (the product of the degrees)."""
    return math.prod(degrees.values())


def degree_points(tp=(), ep=(), degrees=()) -> list[dict[str, int]]:
    """The mesh degree points of the settings: {"tp": P} per TP degree and {"ep": P} per EP degree (one
    dimension at a time, so each is compared on its own), then each point of `degrees` as given
    ({"ep": 2, "tp": 2}); a point listed twice is measured once."""
    points = [{"tp": p} for p in tp or ()] + [{"ep": p} for p in ep or ()] + [dict(d) for d in degrees or ()]
    first = {}
    for d in points:
        first.setdefault(degrees_key(d), d)
    return list(first.values())


