"""The checks `train.pretrain` makes before anything is built or any process started: every config value in
its range (the optimizer, the training length, the layout against the processes, torchrun's included), so
that a mistake fails at once in one sentence rather than in the first forward, after the step-0 validation,
or once every process is up. (The run directory and the checkpoint to continue from: `train.run_directory`.)
"""

import math
import os

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

import models
from parallel.fsdp import shards_over
from train.data import CORPUS, SourceSettings, is_local_source
from train.module import NONFINITE_POLICIES
from train.parallel_config import check_degrees, engine_settings, parallel_degrees


def check_config(cfg: DictConfig) -> None:
    """Catches the mistakes that would otherwise fail late: in the first forward, after the step-0
    validation, or in processes already started. Cheap: nothing is loaded, only the model's config built."""
    max_positions = cfg.model.config.get("max_position_embeddings")
    if max_positions is not None and cfg.data.seq_len > max_positions:
        raise ValueError(
            f"data.seq_len={cfg.data.seq_len} is longer than model.config.max_position_embeddings="
            f"{max_positions}; use data.seq_len<={max_positions} or raise max_position_embeddings."
        )
    check_optimizer(cfg.optimizer)
    check_training_length(cfg)
    if cfg.get("nonfinite_loss", "stop") not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite_loss={cfg.nonfinite_loss!r}; use one of {', '.join(NONFINITE_POLICIES)}.")
    if not isinstance(cfg.get("overwrite", False), bool):
        raise ValueError(f"overwrite={cfg.overwrite!r} must be true or false.")

    # A local path that does not exist (the hub is only asked later, by the data module).
    if cfg.data.get("tokenizer") is not None:
        is_local_source(str(cfg.data.tokenizer), "data.tokenizer")
    if cfg.data.get("source", CORPUS) != CORPUS:
        is_local_source(str(cfg.data.source), "data.source")
    if cfg.data.get("sources") is None:
        # A hub-only setting on a local source, an empty file: said before anything is built.
        SourceSettings(
            str(cfg.data.get("source", CORPUS)), cfg.data.get("hf_config"), cfg.data.get("text_column", "text"),
            cfg.data.get("validation_fraction", 0.1), cfg.data.get("split_seed", 0),
        ).check()

    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    devices, num_nodes = cfg.trainer.get("devices", "auto"), cfg.trainer.get("num_nodes", 1)
    if str(devices) == "auto":
        devices = trainer_devices(cfg)
    if accelerator in ("cuda", "gpu"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"trainer.accelerator={accelerator} but CUDA is not available on this machine (torch "
                f"{torch.__version__}); use trainer.accelerator=auto or trainer=cpu."
            )
        if isinstance(devices, int) and devices > torch.cuda.device_count():
            raise ValueError(
                f"trainer.devices={devices} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                f"use trainer.devices<={torch.cuda.device_count()} (or more trainer.num_nodes)."
            )

    # Lightning starts trainer.devices processes on each of trainer.num_nodes nodes. The parallel degrees
    # say how many there must be; a mismatch would fail only once every process is up.
    degrees = parallel_degrees(cfg.get("parallel"))
    engine = engine_settings(cfg.get("parallel"))
    world = math.prod(degrees.values())
    layout = " x ".join(f"parallel.{d}={n}" for d, n in degrees.items() if n > 1) or "parallel=none"
    if engine["param_dtype"] not in (None, "float32") and not (engine["fsdp"] and shards_over(degrees)):
        why = "parallel.fsdp=false" if not engine["fsdp"] else f"{layout} has no dp, ep or sp rank to shard over"
        raise ValueError(
            f"parallel.param_dtype={engine['param_dtype']} is FSDP's mixed precision, which this run does not use "
            f"({why}): it would do nothing. Use trainer.precision=bf16-mixed (or 16-mixed) instead, or leave "
            "parallel.param_dtype=null."
        )
    strategy = cfg.trainer.get("strategy")
    if strategy is not None and world > 1:
        name = strategy.get("_target_", strategy) if isinstance(strategy, DictConfig) else strategy
        raise ValueError(
            f"{layout} runs through train.strategy.ZooParallelStrategy, which train.pretrain sets itself, but "
            f"trainer.strategy is {name}; drop it (trainer=ddp is data parallelism of an unsharded model: "
            "use parallel.dp with the other degrees instead)."
        )
    n_devices = len(devices) if OmegaConf.is_list(devices) or isinstance(devices, list) else devices
    if strategy is None and isinstance(num_nodes, int):
        if world % num_nodes:
            raise ValueError(
                f"{layout} needs {world} processes, which trainer.num_nodes={num_nodes} nodes cannot share "
                "evenly; use a number of nodes that divides it."
            )
        if isinstance(n_devices, int) and n_devices * num_nodes != world:
            data_parallel = f", or parallel.dp={n_devices * num_nodes} for data parallelism" if world == 1 else ""
            processes = f"{world} process" + ("es" if world > 1 else "")
            raise ValueError(
                f"{layout} needs {processes}, but trainer.devices={devices} x trainer.num_nodes="
                f"{num_nodes} starts {n_devices * num_nodes}; set trainer.devices={world // num_nodes} (or "
                f"leave it auto: the degrees decide){data_parallel}."
            )
    check_launcher_world(cfg, layout, world)
    sp = degrees["sp"]
    if sp > 1 and cfg.data.seq_len % sp:
        seq_len = cfg.data.seq_len
        lower, upper = seq_len - seq_len % sp, seq_len + sp - seq_len % sp
        fits = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"data.seq_len={seq_len} does not split over parallel.sp={sp} ranks (each holds seq_len / sp tokens "
            f"of every sequence); use data.seq_len={fits}."
        )
    # The architecture's own check of the degrees, before any process starts (the module checks again,
    # with the config of an init_from checkpoint too).
    if world > 1 and not cfg.model.get("init_from"):
        model_config = OmegaConf.to_container(cfg.model.config, resolve=True)
        check_degrees(cfg.model.name, models.build_config(cfg.model.name, **model_config), degrees)


OPTIMIZER_DEFAULTS = {"lr": 3.0e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "warmup_steps": 100, "min_lr_ratio": 0.1}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_optimizer(optimizer: DictConfig) -> None:
    """Every `optimizer.*` value in its range, and no key the module would ignore (`+optimizer.lrr=...`)."""
    unknown = sorted(set(optimizer) - set(OPTIMIZER_DEFAULTS))
    if unknown:
        import difflib

        near = {k: difflib.get_close_matches(k, list(OPTIMIZER_DEFAULTS), n=1) for k in unknown}
        hints = ", ".join(f"optimizer.{k}" + (f" (did you mean optimizer.{n[0]}?)" if n else "") for k, n in near.items())
        raise ValueError(f"Unknown optimizer setting {hints}; the settings are {', '.join(OPTIMIZER_DEFAULTS)}.")
    lr, warmup, ratio = optimizer.get("lr"), optimizer.get("warmup_steps"), optimizer.get("min_lr_ratio")
    decay, betas = optimizer.get("weight_decay"), optimizer.get("betas")
    if not _is_number(lr) or lr <= 0:
        raise ValueError(f"optimizer.lr={lr!r} must be a positive number (the default is 3.0e-3).")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(
            f"optimizer.warmup_steps={warmup!r} must be an integer >= 0 (optimizer steps of linear warm-up; 0: none)."
        )
    if not _is_number(ratio) or not 0 <= ratio <= 1:
        raise ValueError(
            f"optimizer.min_lr_ratio={ratio!r} must be in [0, 1] (the cosine decay ends at min_lr_ratio x optimizer.lr)."
        )
    if not _is_number(decay) or decay < 0:
        raise ValueError(f"optimizer.weight_decay={decay!r} must be a number >= 0.")
    if (
        not OmegaConf.is_list(betas)
        or len(betas) != 2
        or not all(_is_number(b) and 0 <= b < 1 for b in betas)
    ):
        shown = OmegaConf.to_container(betas) if OmegaConf.is_list(betas) else betas
        raise ValueError(f"optimizer.betas={shown!r} must be two numbers in [0, 1), e.g. [0.9, 0.95].")


def check_training_length(cfg: DictConfig) -> None:
    """`trainer.max_steps` (the schedule and the progress bar count optimizer steps) and the intervals."""
    trainer = cfg.trainer
    max_steps = trainer.get("max_steps")
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
        raise ValueError(
            f"trainer.max_steps={max_steps!r} must be an integer >= 1 (training length in optimizer steps; the "
            "lr schedule decays to it)."
        )
    accumulate = trainer.get("accumulate_grad_batches", 1)
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise ValueError(f"trainer.accumulate_grad_batches={accumulate!r} must be an integer >= 1.")
    interval = trainer.get("val_check_interval")
    if interval is not None and (
        not _is_number(interval) or (isinstance(interval, int) and interval < 1) or (isinstance(interval, float) and not 0 < interval <= 1)
    ):
        raise ValueError(
            f"trainer.val_check_interval={interval!r} must be an integer >= 1 (training batches between validations) "
            "or a fraction of an epoch in (0, 1]."
        )
    recompute = trainer.get("activation_checkpointing", "none")
    if recompute not in ("none", "full", "selective"):
        raise ValueError(
            f"trainer.activation_checkpointing={recompute!r} must be none, full (each decoder layer recomputed) or "
            "selective (matmul outputs saved, the rest recomputed)."
        )
    if not isinstance(trainer.get("compile", False), bool):
        raise ValueError(f"trainer.compile={trainer.compile!r} must be true or false.")
    peak = trainer.get("peak_tflops")
    if peak is not None and (not _is_number(peak) or peak <= 0):
        raise ValueError(f"trainer.peak_tflops={peak!r} must be a positive number (TFLOP/s per device) or null.")
    clip = trainer.get("gradient_clip_val")
    if clip is not None and (not _is_number(clip) or clip < 0):
        raise ValueError(f"trainer.gradient_clip_val={clip!r} must be a number >= 0 (0 or null: no clipping).")


def check_launcher_world(cfg: DictConfig, layout: str, world: int) -> None:
    """Under torchrun the processes are already started (Lightning's TorchElasticEnvironment starts none):
    their number must be the one the config trains with, or each would train its own copy (parallel=none)
    or the mesh would fail once every process is up. Checked before anything is built."""
    if not (dist.is_available() and dist.is_torchelastic_launched()):
        return
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    launcher = "torchrun"
    strategy = cfg.trainer.get("strategy")
    if strategy is None:
        needed = world
    else:  # trainer=ddp: Lightning's DDP over trainer.devices x trainer.num_nodes processes
        devices, num_nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes", 1)
        if not isinstance(devices, int) or not isinstance(num_nodes, int):
            return
        needed = devices * num_nodes
    if launched == needed:
        return
    if strategy is None and world == 1:
        raise ValueError(
            f"{launcher} started {launched} processes (WORLD_SIZE={launched}), but parallel=none trains in one: each "
            f"would train its own copy into the same run directory; pass parallel.dp={launched} for data "
            "parallelism over them, or start one process."
        )
    what = layout if strategy is None else f"trainer.devices={cfg.trainer.devices} x trainer.num_nodes={cfg.trainer.get('num_nodes', 1)}"
    raise ValueError(
        f"{launcher} started {launched} processes (WORLD_SIZE={launched}), but {what} needs {needed}; start "
        f"{needed} (torchrun --nproc-per-node={needed} on one node) or change the degrees."
    )


def trainer_devices(cfg: DictConfig):
    """`trainer.devices` as the run uses it: `auto` means the processes per node the parallel degrees need
    (one process without model parallelism), unless `trainer.strategy` is set (trainer=ddp): then
    Lightning's own `auto` (every device of the node)."""
    devices = cfg.trainer.get("devices", "auto")
    if str(devices) != "auto" or cfg.trainer.get("strategy") is not None:
        return devices
    return math.prod(parallel_degrees(cfg.get("parallel")).values()) // cfg.trainer.get("num_nodes", 1)
