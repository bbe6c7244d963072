"""The bench's settings, read once from its composed config into typed settings, a frozen dataclass per section.

`read_settings` reads `conf/bench.yaml` (composed with a `bench_preset` and overrides) once, checking the generation
section's values first (eval.bench.checks): the device and dtype (eval.bench.machine), the compute (measured,
or a device preset's device model), how a bench shape becomes an architecture's config (`ModelSettings`: its
registry entry's `bench_config`), the degree points (`GenerationSettings.points`, the real variant's
`RealSettings.points`: eval.bench.degrees names them), threads, and each other section's settings (None when the
section is off; each section checks its own in its module, eval.bench.app.checked_settings runs them all). The
sections receive these settings, never the config itself; nothing here is timed.
"""

from dataclasses import dataclass, replace

import torch

import models
from eval.bench.checks import check_generation, check_numbers
from eval.bench.degrees import degree_points, degrees_key, degrees_label, link_label, ranks
from eval.bench.machine import cpu_cores, resolve_device
from eval.report import standard_sibling
from eval.simulator.attention import ATTENTION_PROGRAMS
from eval.simulator.device import DEVICES, DeviceModel
from models.registry import SCHEDULE_SEP

# The degree names and the device are read from here too (eval.tour, eval.at_scale, eval.gpu_check, the tests).
__all__ = [
    "SIMULATED_DTYPE", "BenchSettings", "ComputeSettings", "DecodePathsSettings", "ExpertThroughputSettings",
    "GenerationSettings", "ModelSettings", "RealSettings", "SPSettings", "TrainingSettings", "degree_points",
    "degrees_key", "degrees_label", "link_label", "model_config", "ranks", "read_settings", "resolve_device",
    "resolve_real",
]  # fmt: skip

# The dtype of the device model's rows: a GPU's (the meta device allocates nothing, so no CPU cost).
SIMULATED_DTYPE = torch.bfloat16


def _shape(bench_shape: dict) -> dict:
    return {k: v for k, v in bench_shape.items() if k != "name"}


@dataclass(frozen=True)
class ModelSettings:
    """How an architecture's config is built: `bench_shape` (less its name) through the architecture's own
    `bench_config` (its registry entry), with `config_overrides[arch]` on top. A ladder variant (`moe_ladder`)
    takes its standard sibling's overrides first (bench_preset=moe's moe_layer_freq for moe), then its own: the
    same model but for the residual schedule; an architecture under an overlap schedule (`moe+token_split`) takes
    its architecture's."""

    shape: dict
    overrides: dict  # {arch: {config field: value}}

    @classmethod
    def read(cls, cfg: dict) -> "ModelSettings":
        return cls(_shape(cfg["bench_shape"]), dict(cfg.get("config_overrides") or {}))

    def config(self, arch: str, degrees: dict[str, int], **extra):
        """The config of `arch` at the shape and `degrees`, `config_overrides[arch]` on top (a ladder variant's
        sibling's under its own) and `extra` on top of those."""
        model = arch.split(SCHEDULE_SEP, 1)[0]  # `moe+token_split` is moe's model under a schedule: moe's overrides
        overrides = {**(self.overrides.get(standard_sibling(model)) or {}), **(self.overrides.get(model) or {}),
                     **(self.overrides.get(arch) or {})}  # fmt: skip
        return models.get(arch).bench_config(dict(self.shape), degrees, **{**overrides, **extra})

    def at_shape(self, bench_shape: dict) -> "ModelSettings":
        """The same overrides at another bench shape (a conf/bench_shape/ file)."""
        return replace(self, shape=_shape(bench_shape))


def model_config(cfg: dict, arch: str, degrees: dict[str, int], **extra):
    """`ModelSettings.config` from a plain settings dict (`bench_shape`, `config_overrides`), as eval.gpu_check
    and the tests hold them."""
    return ModelSettings.read(cfg).config(arch, degrees, **extra)


@dataclass(frozen=True)
class ComputeSettings:
    """The `compute` setting: `measured` (rank 0's compute timed here) or a device preset, whose device model (the
    `device_model` constants on it) predicts the rows, charging attention as `attention_program`."""

    setting: str
    constants: dict  # `device_model`, as given
    attention_program: str
    static_cache: bool
    device_model: DeviceModel | None  # with a device preset

    @property
    def predicted(self) -> bool:
        """Whether the simulated and upper-bound rows are a device model's prediction (not measured here)."""
        return self.setting != "measured"

    def info(self) -> dict:
        """What results.json records about the compute: the setting and, for a device preset, the model."""
        if not self.predicted:
            return {"setting": "measured"}
        dm = self.device_model
        return {
            "setting": self.setting,
            "device": {"name": dm.device.name, "peak_flops": dm.device.peak_flops, "hbm_Bps": dm.device.hbm_Bps,
                       "note": dm.device.note},
            "eff_flops": dm.eff_flops,
            "eff_hbm": dm.eff_hbm,
            "kernel_overhead_us": dm.kernel_overhead_s * 1e6,
            "contention": dm.contention,
            "contention_bw": dm.contention if dm.contention_bw is None else dm.contention_bw,
            "collective_launch_us": dm.collective_launch_s * 1e6,
            "dtype": str(SIMULATED_DTYPE).removeprefix("torch."),
            "static_cache": self.static_cache,
            "attention_program": self.attention_program,
        }  # fmt: skip


def _read_compute(cfg: dict) -> ComputeSettings:
    """The compute settings; an unknown preset, device model constants out of range or (with a preset) an unknown
    attention program fail here, before anything runs."""
    setting = cfg.get("compute") or "measured"
    if setting != "measured" and setting not in DEVICES:
        raise ValueError(
            f"Unknown compute={setting!r}; choose 'measured' (time rank 0's compute on this machine) or a device "
            f"preset of eval.simulator.device.DEVICES: {sorted(DEVICES)}."
        )
    program = cfg.get("attention_program") or "flash"
    dm = None
    if setting != "measured":
        dm = DeviceModel.from_config(setting, **cfg["device_model"])
        if program not in ATTENTION_PROGRAMS:
            raise ValueError(f"attention_program={program!r}; choose one of {list(ATTENTION_PROGRAMS)}.")
    return ComputeSettings(setting, dict(cfg.get("device_model") or {}), program, bool(cfg.get("static_cache", True)), dm)


def resolve_real(cfg: dict, device_type: str) -> dict:
    """`auto` real degrees: on CPU only 2-rank points ([2] for an axis the bench measures; every rank needs
    cores of its own), every point on GPUs (one needing more GPUs than the machine has is skipped later).
    With a device preset as `compute` the real variant is off: it would measure this machine."""
    real = dict(cfg["real"])
    if (cfg.get("compute") or "measured") != "measured":
        real["enabled"] = False
    for axis in ("tp", "ep"):
        if real.get(axis, "auto") == "auto":
            wanted = list(cfg.get(axis) or [])
            real[axis] = ([2] if wanted else []) if device_type == "cpu" else wanted
    if real.get("degrees", "auto") == "auto":
        real["degrees"] = [] if device_type == "cpu" else list(cfg.get("degrees") or [])
    return {**cfg, "real": real}


@dataclass(frozen=True)
class RealSettings:
    """The `real` variant (P processes, real collectives), its `auto` degrees resolved (`resolve_real`)."""

    enabled: bool
    tp: list
    ep: list
    points: list[dict[str, int]]  # none when off
    backend: str
    timeout_s: float


@dataclass(frozen=True)
class GenerationSettings:
    """The generation section: every architecture of `archs` at each degree point, simulated / upper bound
    (measured or predicted by `compute`) and real."""

    archs: list[str]
    baseline: str
    points: list[dict[str, int]]  # the single-process variants' (`tp`, `ep`, `degrees`)
    real: RealSettings
    simulated: bool
    links: list  # `simulated.links`: a preset, or {mesh dimension: preset}, each
    upper_bound: bool
    batch_sizes: list[int]
    prompt_len: int
    new_tokens: int
    warmup: int
    repeats: int
    seed: int
    compile: bool | str  # false, true or "both"
    compile_backend: str
    moe_dispatch: str | None
    min_comm_fraction: float
    a2a_anchors: dict  # `anchors.a2a_hidden_share`: {arch: {link preset: share}}
    model: ModelSettings
    compute: ComputeSettings

    @property
    def programs(self) -> list[str]:
        """The programs timed (`compile`): eager, compiled (eval.bench.steps, whole steps), or both in one run."""
        return {False: ["eager"], True: ["compiled"], "both": ["eager", "compiled"]}[self.compile]

    @property
    def timing(self) -> dict:
        """The settings eval.bench.timing.measure_interleaved reads, under their config keys."""
        return {"seed": self.seed, "bench_shape": {"vocab_size": self.model.shape["vocab_size"]},
                "prompt_len": self.prompt_len, "new_tokens": self.new_tokens, "warmup": self.warmup,
                "repeats": self.repeats, "static_cache": self.compute.static_cache,
                "compile_backend": self.compile_backend}  # fmt: skip


def _read_generation(cfg: dict, model: ModelSettings, compute: ComputeSettings) -> GenerationSettings:
    """The generation section's settings (`cfg` with its real degrees resolved), checked
    (eval.bench.checks.check_generation)."""
    real = cfg["real"]
    check_generation(cfg, real, compute.predicted, compute.static_cache)
    reals = degree_points(real["tp"], real.get("ep"), real.get("degrees")) if real["enabled"] else []
    return GenerationSettings(
        archs=list(cfg["archs"]), baseline=cfg["baseline"], points=degree_points(cfg["tp"], cfg.get("ep"), cfg.get("degrees")),
        real=RealSettings(bool(real["enabled"]), real["tp"], real.get("ep"), reals, real.get("backend", "auto"),
                          real.get("timeout_s")),
        simulated=bool(cfg["simulated"]["enabled"]), links=list(cfg["simulated"]["links"]),
        upper_bound=bool(cfg["upper_bound"]["enabled"]), batch_sizes=list(cfg["batch_sizes"]),
        prompt_len=cfg["prompt_len"], new_tokens=cfg["new_tokens"], warmup=cfg["warmup"], repeats=cfg["repeats"],
        seed=cfg["seed"], compile=cfg["compile"], compile_backend=cfg.get("compile_backend", "inductor"),
        moe_dispatch=cfg.get("moe_dispatch"), min_comm_fraction=cfg["min_comm_fraction"],
        a2a_anchors=dict((cfg.get("anchors") or {}).get("a2a_hidden_share") or {}), model=model, compute=compute,
    )  # fmt: skip


@dataclass(frozen=True)
class ExpertThroughputSettings:
    """The `expert_throughput` section: one MoE layer's forward timed per entry of `layers` ({arch, overrides,
    anchor}; the first the baseline)."""

    layers: list[dict]
    tokens: int
    warmup: int
    repeats: int
    seed: int
    model: ModelSettings


@dataclass(frozen=True)
class SPSettings:
    """The `sequence_parallel` section: the linear model's sequence parallelism, timed at (N, P) of `lengths` x
    `sp` (and `device_points` with a device preset) and its bytes counted at `bytes_*`."""

    methods: list[str]
    lengths: list[int]
    sp: list[int]
    device_points: list[dict]  # [{n, sp}]
    max_chunk: int
    max_attended: int
    device_kernels: str
    ranks: list[str]  # `first` and / or `last`
    batch: int
    links: list[str]
    warmup: int
    repeats: int
    bytes_lengths: list[int]
    bytes_sp: list[int]
    bytes_extra_points: list[dict]  # [{n, sp}]
    overrides: dict  # config fields of every method's model
    shape: dict  # the bench shape (`config_overrides` do not apply: the section sets its own, `overrides`)
    seed: int
    anchor: dict  # `anchors.sp_speedup`
    compute: ComputeSettings


@dataclass(frozen=True)
class DecodePathsSettings:
    """The `decode_paths` section: on one device, decode tokens/s of every architecture of `archs` on each of its
    decode paths (`paths[arch]`: values of the config field `path_field`)."""

    paths: dict
    path_field: str
    batch_sizes: list[int]
    q_lens: list[int]
    steps: int
    warmup: int
    repeats: int
    accounting_shape: str | None
    archs: list[str]
    baseline: str
    prompt_len: int
    seed: int
    model: ModelSettings


@dataclass(frozen=True)
class TrainingSettings:
    """The `training` section: one optimizer step per architecture of `archs`, layout and AC mode."""

    layouts: list[dict]
    ac: list[str]
    fsdp: bool
    micro_batch: int
    seq_len: int
    grad_accum: int
    device_preset: str  # `training.device`: the predicted rows' device when compute is measured
    link: str
    warmup: int
    repeats: int
    archs: list[str]
    baseline: str
    model: ModelSettings
    compute: ComputeSettings


@dataclass(frozen=True)
class BenchSettings:
    """Every setting of a bench run, read once (`read_settings`); a section's is None when it is off."""

    device: torch.device
    dtype: torch.dtype
    threads: int | None  # per process (`threads`); None: torch's default
    model: ModelSettings
    compute: ComputeSettings
    generation: GenerationSettings
    expert_throughput: ExpertThroughputSettings | None
    sequence_parallel: SPSettings | None
    decode_paths: DecodePathsSettings | None
    training: TrainingSettings | None
    recorded: dict  # the settings as results.json records them: the config, its real degrees resolved


def _threads(cfg: dict, generation: GenerationSettings) -> int | None:
    """Threads per process: `auto` = one rank's share of the cores when the largest P ranks share them
    (the most ranks of any point measured, simulated or real)."""
    if cfg["threads"] != "auto":
        return int(cfg["threads"]) if cfg["threads"] else None
    # No degree point (only the sequence_parallel section, one process): all the cores.
    most = max((ranks(d) for d in [*generation.points, *generation.real.points]), default=1)
    return max(1, cpu_cores() // most)


def _section(cfg: dict, name: str) -> dict | None:
    """A section of the config when it is on."""
    section = cfg.get(name) or {}
    return section if section.get("enabled") else None


def read_settings(cfg: dict) -> BenchSettings:
    """The bench's settings from its config (conf/bench.yaml composed, less the logger, paths and Hydra's keys),
    the device's and the generation section's checked: fails before anything is built if one is out of range."""
    device, dtype = resolve_device(cfg)
    check_numbers(cfg)
    compute = _read_compute(cfg)
    cfg = resolve_real(cfg, device.type)
    model = ModelSettings.read(cfg)
    generation = _read_generation(cfg, model, compute)
    # each other section's settings, None when it is off (its module checks them: eval.bench.app.checked_settings)
    et, sp, dp, t = (_section(cfg, name) for name in ("expert_throughput", "sequence_parallel", "decode_paths", "training"))
    anchors = cfg.get("anchors") or {}
    gen = generation
    return BenchSettings(
        device=device, dtype=dtype, threads=_threads(cfg, gen), model=model, compute=compute, generation=gen,
        expert_throughput=et and ExpertThroughputSettings(
            layers=et.get("layers"), tokens=et.get("tokens"), warmup=et.get("warmup"), repeats=et.get("repeats"),
            seed=gen.seed, model=model),
        sequence_parallel=sp and SPSettings(
            methods=sp["methods"], lengths=sp["lengths"], sp=sp["sp"], device_points=list(sp.get("device_points") or []),
            max_chunk=sp.get("max_chunk"), max_attended=sp.get("max_attended"),
            device_kernels=sp.get("device_kernels", "gpu"), ranks=sp["ranks"], batch=sp.get("batch"), links=sp["links"],
            warmup=sp.get("warmup"), repeats=sp.get("repeats"), bytes_lengths=sp["bytes"]["lengths"],
            bytes_sp=sp["bytes"]["sp"], bytes_extra_points=list(sp["bytes"].get("extra_points") or []),
            overrides=dict(sp.get("overrides") or {}), shape=model.shape, seed=gen.seed,
            anchor=dict(anchors.get("sp_speedup") or {}), compute=compute),
        decode_paths=dp and DecodePathsSettings(
            paths=dict(dp.get("paths") or {}), path_field=dp.get("path_field"), batch_sizes=dp["batch_sizes"],
            q_lens=dp["q_lens"], steps=dp.get("steps"), warmup=dp.get("warmup"), repeats=dp.get("repeats"),
            accounting_shape=dp.get("accounting_shape"), archs=gen.archs, baseline=gen.baseline,
            prompt_len=gen.prompt_len, seed=gen.seed, model=model),
        training=t and TrainingSettings(
            layouts=t["layouts"], ac=t["ac"], fsdp=bool(t.get("fsdp")), micro_batch=t.get("micro_batch"),
            seq_len=t.get("seq_len"), grad_accum=t.get("grad_accum"), device_preset=t.get("device"), link=t.get("link"),
            warmup=t.get("warmup"), repeats=t.get("repeats"), archs=gen.archs, baseline=gen.baseline, model=model,
            compute=compute),
        recorded=cfg,
    )  # fmt: skip
