"""The generation section's checks of its values: counts and sizes, degree lists and points, archs, compile, links.

Each fails with a sentence naming the setting before anything is built (eval.bench.settings.read_settings runs
them before it reads the section; every other section checks its own in its module).
"""

import models
from eval.bench.degrees import degree_points, ranks
from eval.report import standard_sibling
from parallel.devices import DEVICES
from parallel.link import LINK_PRESETS
from parallel.mesh import DIM_ORDER


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


def check_generation(cfg: dict, real: dict, predicted: bool, static_cache: bool) -> None:
    """The generation section's degrees and points (`real`: the real variant's, its `auto` degrees resolved; with
    a device preset, `predicted`, a point may be one rank: the single-GPU baseline), archs and baseline, compile
    (`static_cache`: whether caches are static) and links, in the order their errors are reported."""
    _check_degree_list(cfg["tp"], "TP", predicted)
    _check_degree_list(cfg.get("ep"), "EP", predicted)
    points = degree_points(cfg["tp"], cfg.get("ep"), cfg.get("degrees"))
    _check_points(points, "degrees", single_ok=predicted)
    if not points and not (cfg.get("sequence_parallel") or {}).get("enabled"):
        raise ValueError(
            "No degree point to measure: give tp, ep or degrees (e.g. tp=[2] or ep=[2]), or turn on the "
            "sequence_parallel section (bench_preset=sp)."
        )
    if real["enabled"]:  # off with a device preset, whose points may be degree 1
        _check_degree_list(real["tp"], "real TP", predicted=False)
        _check_degree_list(real.get("ep"), "real EP", predicted=False)
        _check_points(degree_points(real["tp"], real.get("ep"), real.get("degrees")), "real")
    archs = cfg["archs"]
    siblings = {standard_sibling(arch) for arch in archs}  # a ladder variant takes its sibling's overrides too
    for name in cfg.get("config_overrides") or {}:
        if name not in archs and name not in siblings:
            raise ValueError(f"config_overrides names {name!r}, which is not in archs={list(archs)}.")
    for arch in archs:
        if models.get(arch).bench_config is None:
            raise ValueError(
                f"Architecture {arch!r} declares no bench_config (models/<name>/entry.py, passed to "
                "models.register), so the bench cannot build it at a shape; leave it out of archs."
            )
    if cfg["baseline"] not in archs:
        raise ValueError(f"baseline={cfg['baseline']!r} must be one of archs={list(archs)}.")
    if cfg["new_tokens"] < 2:
        raise ValueError(f"new_tokens={cfg['new_tokens']} leaves no decode step; use at least 2.")
    if cfg["compile"] not in (False, True, "both"):
        raise ValueError(
            f"compile={cfg['compile']!r}: use false (eager steps), true (prefill and decode step compiled whole) "
            "or both (eager and compiled rows in one run)."
        )
    if cfg["compile"] and not static_cache:
        raise ValueError(
            f"compile={cfg['compile']!r} needs static_cache=true: a compiled decode step runs on a static cache "
            "(a growing one changes shape at every step)."
        )
    if cfg["repeats"] < 1:
        raise ValueError(f"repeats={cfg['repeats']} must be at least 1.")
    _check_links(cfg["simulated"]["links"], points, cfg["simulated"]["enabled"])


def _check_degree_list(values, name: str, predicted: bool) -> None:
    """Degrees >= 2 when compute is measured (rank 0 of P >= 2 is what is timed here); with a device preset
    degree 1 too: the single-GPU baseline, the model unsharded, no collectives (a speed-up over one GPU)."""
    least = 1 if predicted else 2
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


def _check_links(links: list, points: list[dict[str, int]], simulated: bool) -> None:
    """Each `simulated.links` entry a preset, or {mesh dimension: preset} naming every dimension that a point
    communicates over (when the simulated variant runs)."""
    for link in links:
        presets = link.values() if isinstance(link, dict) else [link]
        for preset in presets:
            if preset not in LINK_PRESETS:
                raise ValueError(f"Unknown link preset {preset!r}; choose from {sorted(LINK_PRESETS)}.")
        if isinstance(link, dict) and [dim for dim in link if dim not in DIM_ORDER]:
            raise ValueError(f"simulated.links entry {link} names a dimension outside the mesh's {list(DIM_ORDER)}.")
        if isinstance(link, dict) and simulated:
            for d in points:
                missing = [dim for dim, n in d.items() if n > 1 and dim not in link]
                if missing:
                    raise ValueError(
                        f"simulated.links entry {link} names no link for {missing}, which the point {d} "
                        f"communicates over; add one (e.g. {{{missing[0]}: pcie4}}) or give one preset for all."
                    )
