"""The generation section: every architecture at each mesh degree point, in the bench's variants.

- `simulated`: this process plays rank 0 of a P-way fake process group, holds only its shards and computes;
  collectives go on the virtual link of `parallel.link` (one row per preset) and the time is that virtual
  clock. Its compute is measured here, or (`compute` a device preset) predicted by the speed simulator
  (`run_device_model`: eval.simulator, each architecture's own forward() on the meta device);
- `upper_bound`: the same rank-0 compute with every collective skipped (comm mode `none`);
- `real`: P spawned processes with real collectives (gloo on CPU, nccl on GPU, 127.0.0.1); the same
  processes also time `upper_bound_real` (all ranks running, no collectives), its own upper bound.

Each row goes through `timing.summarize`, and MoE rows get their all-to-all columns (eval.bench.moe).
"""

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import models
import parallel
from eval.bench.degrees import degrees_key, degrees_label, link_label, ranks
from eval.bench.moe import all_to_all_columns
from eval.bench.settings import SIMULATED_DTYPE, GenerationSettings, model_config
from eval.bench.timing import ClockTimer, WallTimer, measure_interleaved, summarize
from eval.simulator.device import DeviceModel
from eval.simulator.replay import NO_COMM, build_meta, record_generation, release
from parallel import comm
from parallel.overlap import MIN_BATCH


def build_sharded(arch: str, cfg: dict, degrees: dict[str, int], mesh, device: torch.device, dtype: torch.dtype):
    """`sharded_model` from a plain settings dict (`bench_shape`, `config_overrides`, `seed`, `moe_dispatch`), as
    eval.gpu_check holds them."""
    config = model_config(cfg, arch, degrees)
    return sharded_model(arch, config, mesh, device, dtype, cfg["seed"], cfg.get("moe_dispatch"))


def sharded_model(arch: str, config, mesh, device: torch.device, dtype: torch.dtype, seed: int, moe_dispatch=None):
    """A random `arch` model of `config` holding only this rank's shards, materialised on `device`.

    Built on the meta device and sharded there, so a rank never allocates the full model (a 70B shape
    at TP 8 fits one GPU's share); weights are then initialised with the model's own init.
    """
    with torch.device("meta"):
        model = models.get(arch).model_class(config)
    parallel.parallelize(model, mesh)
    parallel.set_overlap(model, models.schedule_of(arch))  # `llama+token_split`: llama under that schedule
    model.to(dtype)
    model.to_empty(device=device)
    # Same seed on every rank: replicated weights (embedding, norms, LM head) agree across ranks,
    # so real ranks pick the same greedy tokens.
    torch.manual_seed(seed)
    with torch.no_grad():
        model.apply(model._init_weights)
    model.eval()
    if hasattr(model, "set_moe_dispatch") and moe_dispatch:
        model.set_moe_dispatch(moe_dispatch)
    return model


def archs_at_points(gen: GenerationSettings, points: list[dict[str, int]]) -> tuple[dict[tuple, dict], list[str]]:
    """Which of `archs` run at each degree point, each with its config there ({degrees_key: {arch: config}}: built
    once, the point's models and their rows' MoE columns read it), and a note for each one skipped: its
    sharding.py has no layout over a dimension of the point (llama at ep 2: parallelize would replicate it
    there, so it would communicate nothing over that dimension and there is nothing to compare), or its config
    or `check_layout` refuses the point. A point that no architecture fits is an
    error naming each one's reason."""
    archs_at, skipped = {}, []
    for degrees in points:
        label, fit, refused = degrees_label(degrees), {}, []
        for arch in gen.archs:
            entry = models.get(arch)
            missing = [dim for dim, n in degrees.items() if n > 1 and dim not in entry.degrees]
            if missing:
                refused.append(
                    f"{arch}: no {'/'.join(missing)} layout (its sharding.py shards over {list(entry.degrees)}), "
                    f"so at {label} it would run replicated with nothing to communicate over {'/'.join(missing)}."
                )
                continue
            try:
                config = gen.model.config(arch, degrees)
                entry.check_layout(config, degrees)
            except ValueError as err:
                refused.append(f"{arch}: {err}")
            else:
                fit[arch] = config
        if not fit:
            raise ValueError(f"No architecture of archs={list(gen.archs)} fits the degrees {label}. " + " ".join(refused))
        archs_at[degrees_key(degrees)] = fit
        skipped += [f"{label}: {reason}" for reason in refused]
    for arch in gen.archs:
        too_small = [b for b in gen.batch_sizes if not runs_at(arch, b)]
        if too_small:
            schedule = models.schedule_of(arch)
            skipped.append(f"{arch}: no row at batch {', '.join(map(str, too_small))}: {schedule} needs a batch of "
                           f"{MIN_BATCH[schedule]} sequences or more to split (parallel/overlap.py)")  # fmt: skip
    return archs_at, skipped


def runs_at(arch: str, batch: int) -> bool:
    """Whether `arch` (maybe `<name>+<schedule>`) has a row at `batch`: its schedule's fewest sequences or more."""
    return batch >= MIN_BATCH[models.schedule_of(arch)]


def at_batch(built: dict, batch: int) -> dict:
    """The built models of `built` ({arch: model}) that run at `batch` (`runs_at`)."""
    return {arch: model for arch, model in built.items() if runs_at(arch, batch)}


def archs_at_all_points(gen: GenerationSettings) -> tuple[dict[tuple, dict], list[str]]:
    """`archs_at_points` over the single-process and the real points; a real point's skip notes apart."""
    archs_at, skipped = archs_at_points(gen, gen.points)
    if gen.real.points:
        real_at, real_skipped = archs_at_points(gen, gen.real.points)
        archs_at.update(real_at)
        skipped += [f"real {note}" for note in real_skipped if note not in skipped]
    return archs_at, skipped


def run_single_process(
    gen: GenerationSettings, degrees: dict[str, int], configs: dict, device, dtype, skipped: list[str] | None = None
) -> list[dict]:
    """Simulated-link and upper-bound rows of the architectures of `configs` ({arch: its config}) at `degrees`, one process playing rank 0: its compute
    measured on `device`, or predicted by the device model (`compute` a device preset: `run_device_model`,
    which appends to `skipped` an architecture whose forward cannot run on the meta device)."""
    if gen.compute.predicted:
        return run_device_model(gen, degrees, configs, skipped)
    rows = []
    p = ranks(degrees)
    mesh = parallel.init_mesh(**degrees, fake=True)
    try:
        built = {
            arch: sharded_model(arch, config, mesh, device, dtype, gen.seed, gen.moe_dispatch)
            for arch, config in configs.items()
        }
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        for batch in gen.batch_sizes:
            if gen.simulated:
                for link in gen.links:
                    # A dict gives each mesh dimension its own link (parallel.comm times each collective on
                    # its group's); a preset name is the link of every dimension. Eager only: the virtual
                    # clock runs Python at every collective, which no graph holds.
                    with comm.use_mode("simulated", link=link, world_size=p, sync=sync) as clock:
                        runs = measure_interleaved(at_batch(built, batch), gen.timing, batch, lambda c=clock: ClockTimer(c), device)
                    rows += _rows(runs, gen, configs, degrees, batch, "simulated", link, dtype)
            if gen.upper_bound:
                for program in gen.programs:
                    with comm.use_mode("none"):
                        runs = measure_interleaved(at_batch(built, batch), gen.timing, batch, lambda: WallTimer(device), device, program)
                    rows += _rows(runs, gen, configs, degrees, batch, "upper_bound", None, dtype, program)
        del built
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return rows


def run_device_model(
    gen: GenerationSettings, degrees: dict[str, int], configs: dict, skipped: list[str] | None = None
) -> list[dict]:
    """Simulated-link and upper-bound rows of the architectures of `configs` at `degrees` predicted by the device model: each
    architecture built on the meta device (bfloat16) and sharded on a fake mesh (`eval.simulator.replay.build_meta`,
    which brings the mesh up; `release` takes it down), its generation recorded once per batch size (attention
    charged as `attention_program`) and replayed on every link preset (`upper_bound`: free communication). At a
    point of one rank (tp=1) the model is unsharded and sends nothing: the single-GPU baseline. The rows go through the same
    `summarize` / `_rows` as measured ones, one run each (min = max = median). An architecture whose forward
    needs values the meta device does not have (a data-dependent op such as boolean-mask indexing) is not
    predicted: a note for it goes to `skipped` (any other error is raised)."""
    compute, dtype = gen.compute, SIMULATED_DTYPE
    dm = compute.device_model
    recordings = {batch: {} for batch in gen.batch_sizes}
    for arch, config in configs.items():
        try:
            model = build_meta(arch, config, degrees, dtype)
            recorded = {
                batch: record_generation(
                    model, batch, gen.prompt_len, gen.new_tokens, compute.static_cache,
                    attention_program=compute.attention_program,
                )
                for batch in gen.batch_sizes
                if runs_at(arch, batch)
            }
        except (NotImplementedError, RuntimeError) as err:
            if "meta" not in str(err):
                raise
            note = (
                f"{degrees_label(degrees)}: {arch}: its forward does not run on the meta device, so "
                f"compute={compute.setting} cannot predict it ({type(err).__name__}: {str(err).split('. ')[0]})"
            )
            print(f"[bench] skipped {note}", flush=True)
            if skipped is not None:
                skipped.append(note)
            continue
        finally:
            release()
            model = None
        for batch, recording in recorded.items():
            recordings[batch][arch] = recording
    rows = []
    for batch, recs in recordings.items():
        if gen.simulated:
            for link in gen.links:
                runs = {arch: [predicted_run(rec, dm, link)] for arch, rec in recs.items()}
                rows += _rows(runs, gen, configs, degrees, batch, "simulated", link, dtype, "compiled")
        if gen.upper_bound:
            runs = {arch: [predicted_run(rec, dm, NO_COMM, upper_bound=True)] for arch, rec in recs.items()}
            rows += _rows(runs, gen, configs, degrees, batch, "upper_bound", None, dtype, "compiled")
    return rows


def predicted_run(recording, dm: DeviceModel, link, upper_bound: bool = False) -> dict:
    """One recording's prediction as one run of `generate_once`: prefill, and the decode loop as the one
    recorded step times the new_tokens - 1 steps (its counts too), which `summarize` divides back. The upper
    bound reads as a measured one does: no exposure, nothing sent (comm mode `none` counts nothing)."""
    out = recording.predict(dm, link)
    steps = recording.new_tokens - 1
    run = {}
    for phase, per in (("prefill", 1), ("decode", steps)):
        p, counts = out[phase], recording.phases[phase].counts
        run[phase] = {"time": p["time"] * per}
        if upper_bound:
            run[phase].update(exposed=None, comm_busy=None, exposed_by=None, busy_by=None, counts={})
        else:
            run[phase].update(
                exposed=p["exposed"] * per,
                comm_busy=p["busy"] * per,
                exposed_by={k: v * per for k, v in p["exposed_by"].items()},
                busy_by={k: v * per for k, v in p["busy_by"].items()},
                counts={kind: {n: v * per for n, v in c.items()} for kind, c in counts.items()},
            )
    return run


def _rows(runs, gen, configs, degrees, batch, variant, link, dtype, program: str = "eager") -> list[dict]:
    """Rows of `runs` (`configs`: {arch: its config at `degrees`}); `program`: the program timed (eval.bench.timing.PROGRAMS), or predicted: the device
    model's rows are "compiled" (it charges the fused kernels of a compiled step on a static cache)."""
    out = []
    for arch, arch_runs in runs.items():
        row = {"arch": arch, "degrees": dict(degrees), "variant": variant, "link": None, "batch": batch}
        row["program"] = program
        if link is not None:
            row["link"] = link_label(link)
            row["links"] = link  # the setting itself: one preset, or {dimension: preset}
        row.update(summarize(arch_runs, batch, gen.new_tokens))
        row.update(all_to_all_columns(row, arch, configs[arch], degrees, dtype, gen.prompt_len, gen.a2a_anchors))
        out.append(row)
    return out


# --- real processes ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The Ladder reference's launch environment on CUDA (gpt-fast's TP benchmark): NCCL's intra-node
# all-reduce kernels and NVLink SHARP. Set for the ranks only if the user has not set them.
CUDA_COMM_ENV = {"ENABLE_INTRA_NODE_COMM": "1", "NCCL_NVLS_ENABLE": "1"}


def _real_rank(
    rank: int, degrees: dict[str, int], configs: dict, port: int, gen: GenerationSettings, device: torch.device,
    dtype: torch.dtype, threads: int | None, out_path: str,
) -> None:
    """One rank of the real launch: real collectives, then no collectives, in the same processes."""
    world_size = ranks(degrees)
    if torch.cuda.is_available():
        for name, value in CUDA_COMM_ENV.items():
            os.environ.setdefault(name, value)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    if device.type == "cuda":
        device = torch.device("cuda", rank)
    if threads:
        torch.set_num_threads(threads)
    backend = gen.real.backend
    try:
        mesh = parallel.init_mesh(**degrees, backend=None if backend == "auto" else backend)
        built = {
            arch: sharded_model(arch, config, mesh, device, dtype, gen.seed, gen.moe_dispatch)
            for arch, config in configs.items()
        }
        rows = []
        for batch in gen.batch_sizes:
            for program in gen.programs:
                timer = lambda: WallTimer(device, barrier=True)  # noqa: E731
                with comm.use_mode("real"):
                    runs = measure_interleaved(at_batch(built, batch), gen.timing, batch, timer, device, program)
                rows += _rows(runs, gen, configs, degrees, batch, "real", None, dtype, program)
                with comm.use_mode("none"):
                    runs = measure_interleaved(at_batch(built, batch), gen.timing, batch, timer, device, program)
                rows += _rows(runs, gen, configs, degrees, batch, "upper_bound_real", None, dtype, program)
        for row in rows:
            row["threads_per_rank"] = torch.get_num_threads()
            row["backend"] = dist.get_backend()
        if rank == 0:
            Path(out_path).write_text(json.dumps(rows))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_real(
    gen: GenerationSettings, degrees: dict[str, int], configs: dict, device: torch.device, dtype: torch.dtype,
    threads: int | None,
) -> list[dict]:
    """Spawn one process per rank on 127.0.0.1 to run the architectures of `configs` (each on `device`, cuda: its own GPU, with `threads` threads);
    rank 0's rows come back through a file. A rank's error is raised here; ranks still running after
    real.timeout_s (e.g. a hung collective) are terminated and that is an error."""
    p = ranks(degrees)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.json")
        args = (degrees, configs, _free_port(), gen, device, dtype, threads, out_path)
        ctx = mp.start_processes(_real_rank, args=args, nprocs=p, join=False, start_method="spawn")
        deadline = time.monotonic() + gen.real.timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.terminate()
                raise TimeoutError(
                    f"The real {degrees_label(degrees)} ranks ran past "
                    f"real.timeout_s={gen.real.timeout_s} s."
                )
        return json.loads(Path(out_path).read_text())
