"""The `parallel` config group (conf/parallel) read and checked: the degrees `dp`, `ep`, `sp`, `tp`, the
data-parallel engine's settings, and the architecture's own check of the degrees.
"""

import models
from parallel.layout import PARALLEL_NAMES
from parallel.mesh import DIM_ORDER


def parallel_degrees(parallel: dict | None) -> dict[str, int]:
    """The degrees of a `parallel` config (conf/parallel): {"dp": .., "ep": .., "sp": .., "tp": ..}, each
    a positive integer (1 when not given); one clear error for a value or a key that is not one."""
    parallel = dict(parallel or {})
    unknown = sorted(set(parallel) - {*DIM_ORDER, "timeout_s", "overlap", *ENGINE_SETTINGS})
    if unknown:
        raise ValueError(
            f"Unknown parallel setting(s) {unknown}; conf/parallel has the degrees {list(DIM_ORDER)}, timeout_s, "
            f"overlap and {', '.join(ENGINE_SETTINGS)}."
        )
    degrees = {dim: parallel.get(dim, 1) for dim in DIM_ORDER}
    for dim, degree in degrees.items():
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(
                f"parallel.{dim}={degree!r} must be a positive integer (the {PARALLEL_NAMES[dim]}-parallel degree)."
            )
    return degrees


# The data-parallel engine's settings in conf/parallel, with their defaults (train.strategy reads them).
ENGINE_SETTINGS = {"fsdp": True, "reshard_after_forward": True, "param_dtype": None}
PARAM_DTYPES = ("bfloat16", "float16", "float32")


def engine_settings(parallel: dict | None) -> dict:
    """`parallel.fsdp` (FSDP2 over the data ranks, sharded checkpoints; false: the replicated trainer),
    `parallel.reshard_after_forward` and `parallel.param_dtype` (FSDP's mixed precision: parameters cast to
    it for compute, gradients reduced in fp32; null: as the trainer's precision), checked."""
    parallel = dict(parallel or {})
    settings = {k: parallel.get(k, v) for k, v in ENGINE_SETTINGS.items()}
    for key in ("fsdp", "reshard_after_forward"):
        if not isinstance(settings[key], bool):
            raise ValueError(f"parallel.{key}={settings[key]!r} must be true or false.")
    if settings["param_dtype"] is not None and settings["param_dtype"] not in PARAM_DTYPES:
        raise ValueError(
            f"parallel.param_dtype={settings['param_dtype']!r} must be null or one of {', '.join(PARAM_DTYPES)}."
        )
    return settings


def check_degrees(model_name: str, config, degrees: dict[str, int]) -> None:
    """One clear error if architecture `model_name` with `config` cannot run at `degrees`: its sharding.py's
    `check_layout` (which also refuses a degree above 1 over a dimension it has no layout for)."""
    models.get(model_name).check_layout(config, degrees)
