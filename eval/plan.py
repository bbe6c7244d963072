"""`python -m eval.plan [key=value ...]`: which layout should I train (or serve) this architecture with on my GPUs?

A Hydra app on conf/plan.yaml over eval/simulator/planner.py: every layout predicted by the speed simulator, ranked
by tokens/s, with memory per rank, MFU and exposed communication; the best one's `train.pretrain` command. Writes
README.md (the ranking, the refused layouts and why), plan.json and plan.png (tokens/s per device against peak
memory, the device's memory drawn) under `out_dir`; `logger=wandb` logs the same as a W&B run (offline unless
WANDB_MODE says otherwise), as the bench does.
"""

import os
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import models
from eval import report
from eval.simulator.heldout import device_model
from eval.simulator.planner import DEVICE_MEMORY_GIB, plan_generation, plan_training, pretrain_command
from parallel.devices import DEVICES

TRAIN_COLUMNS = [("label", "layout"), ("tokens_per_s_per_device", "tokens/s/GPU"), ("mfu", "MFU"),
                 ("step_s", "step s"), ("exposed_share", "exposed comm"), ("peak_gib", "peak GiB"), ("fits", "fits")]  # fmt: skip
GENERATE_COLUMNS = [("label", "layout"), ("tokens_per_s", "tokens/s"), ("decode_ms", "decode step ms"),
                    ("prefill_ms", "prefill ms"), ("peak_gib", "peak GiB"), ("fits", "fits"),
                    ("meets_latency", "meets latency")]  # fmt: skip


def run_plan(cfg: dict, out_dir: Path) -> dict:
    arch = cfg["model"]["name"]
    entry = models.get(arch)  # an unknown architecture: its one clear error, before any work
    shape = {k: v for k, v in cfg["bench_shape"].items() if k != "name"}
    overrides = dict(cfg.get("config_overrides") or {})
    check_plan_inputs(cfg)
    device = device_model(cfg["compute"])
    memory = cfg["memory_gib"] if cfg["memory_gib"] is not None else DEVICE_MEMORY_GIB.get(cfg["compute"])
    if memory is None:
        raise ValueError(
            f"memory_gib is null and compute={cfg['compute']!r} has no memory in DEVICE_MEMORY_GIB; set memory_gib."
        )
    usable = float(memory) - float(cfg["headroom_gib"])
    workers = cfg.get("workers") or os.cpu_count() or 1
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if cfg["task"] == "train":
        for key in ("gpus", "gpus_per_node", "seq_len"):
            if not isinstance(cfg[key], int) or cfg[key] < 1:
                raise ValueError(f"{key}={cfg[key]!r} must be an integer >= 1.")
        tokens = cfg["global_batch_tokens"] or cfg["gpus"] * cfg["seq_len"]
        config = entry.bench_config(shape, {"tp": 1}, **overrides)
        result = plan_training(
            arch, config, gpus=cfg["gpus"], gpus_per_node=cfg["gpus_per_node"], device=device, memory_gib=usable,
            seq_len=cfg["seq_len"], global_batch_tokens=tokens, micro_batches=tuple(cfg["micro_batches"]),
            ac_modes=tuple(cfg["ac"]), fsdp=tuple(cfg["fsdp"]), intra=cfg["links"]["intra"], inter=cfg["links"]["inter"],
            tp=cfg["tp"], ep=cfg["ep"], sp=cfg["sp"], workers=workers, prune=cfg["prune"],
        )  # fmt: skip
        result["global_batch_tokens"] = tokens
        if result["best"]:
            result["command"] = pretrain_command(
                arch, result["best"], cfg["bench_shape"], cfg["seq_len"], cfg["gpus_per_node"]
            )
    elif cfg["task"] == "generate":
        g = cfg["generate"]
        result = plan_generation(
            arch, lambda degrees: entry.bench_config(shape, degrees, **overrides), gpus_per_node=cfg["gpus_per_node"],
            device=device, memory_gib=usable, batch=g["batch"], prompt_len=g["prompt_len"], new_tokens=g["new_tokens"],
            latency_ms=g["latency_ms"], intra=cfg["links"]["intra"],
        )  # fmt: skip
    else:
        raise ValueError(f"task={cfg['task']!r} must be 'train' or 'generate'.")
    result.update({"model": arch, "shape": cfg["bench_shape"]["name"], "compute": cfg["compute"],
                   "memory_gib": memory, "usable_gib": usable, "task": cfg["task"],
                   "planned_s": time.perf_counter() - started, "workers": workers})  # fmt: skip
    report.write_json(out_dir / "plan.json", result)
    image = plot(out_dir / "plan.png", result)
    (out_dir / "README.md").write_text(markdown(result, cfg, image), encoding="utf-8")
    return result


def plot(path: Path, result: dict) -> Path:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    key = "tokens_per_s_per_device" if result["task"] == "train" else "tokens_per_s"
    for fits, colour, label in ((True, "C0", "fits"), (False, "C3", "does not fit")):
        rows = [r for r in result["rows"] if r["fits"] == fits and r[key] is not None]
        ax.scatter([r["peak_gib"] for r in rows], [r[key] for r in rows], color=colour, s=18, label=label)
    untimed = [r["peak_gib"] for r in result["rows"] if r[key] is None and r["peak_gib"] is not None]
    if untimed:  # not timed: their memory does not fit (prune=true)
        ax.scatter(untimed, [0] * len(untimed), color="C3", marker="x", s=18, label="does not fit (not timed)")
    if result["best"]:
        ax.scatter(
            [result["best"]["peak_gib"]],
            [result["best"][key]],
            marker="*",
            s=200,
            color="gold",
            edgecolor="black",
            label="best",
        )
    ax.axvline(result["usable_gib"], color="grey", ls="--", label="memory less headroom")
    ax.set_xlabel("predicted peak memory per GPU (GiB)")
    ax.set_ylabel("predicted " + ("tokens/s per GPU" if result["task"] == "train" else "tokens/s"))
    ax.set_title(f"{result['model']} at {result['shape']} on {result['compute']}: every layout")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def check_plan_inputs(cfg: dict) -> None:
    """The settings the planner reads, each in its range: one error naming the setting and what fits."""
    if cfg["compute"] not in DEVICES:
        what = "measures on this machine (the bench's setting), it has no device to predict" if cfg["compute"] == "measured" else "is no device preset"
        raise ValueError(f"compute={cfg['compute']!r} {what}; eval.plan predicts for one of {', '.join(sorted(DEVICES))}.")
    workers = cfg.get("workers")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers={workers!r} must be null (one per core) or an integer >= 1.")
    if not isinstance(cfg.get("prune", True), bool):
        raise ValueError(f"prune={cfg['prune']!r} must be true (layouts that do not fit are not timed) or false.")
    tokens = cfg.get("global_batch_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"global_batch_tokens={tokens!r} must be null or a positive multiple of seq_len={cfg['seq_len']}.")
    g = cfg.get("generate") or {}
    for key in ("batch", "prompt_len", "new_tokens"):
        if key in g and (isinstance(g[key], bool) or not isinstance(g[key], int) or g[key] < 1):
            raise ValueError(f"generate.{key}={g[key]!r} must be an integer >= 1.")
    latency = g.get("latency_ms")
    if latency is not None and (isinstance(latency, bool) or not isinstance(latency, (int, float)) or latency <= 0):
        raise ValueError(f"generate.latency_ms={latency!r} must be null (no bound) or a positive number of milliseconds.")


def no_layout(result: dict, cfg: dict) -> str:
    """Why no layout was chosen: memory, or (generation) only the decode latency bound."""
    fitting = [r for r in result["rows"] if r["fits"]]
    if result["task"] == "generate" and fitting:
        fastest = min(fitting, key=lambda r: r["decode_ms"])
        return (f"No layout meets generate.latency_ms={cfg['generate']['latency_ms']}: the fastest decode step that "
                f"fits is {fastest['decode_ms']:.2f} ms ({fastest['label']}). Raise the bound, or use a smaller batch.")
    if result["task"] == "generate":
        return "No layout fits in memory. Use a smaller batch or a shorter prompt, or GPUs with more memory."
    return "No layout fits. Use more GPUs, a shorter sequence or full activation checkpointing."


def markdown(result: dict, cfg: dict, image: Path) -> str:
    columns = TRAIN_COLUMNS if result["task"] == "train" else GENERATE_COLUMNS
    best = result["best"]
    lines = [
        f"# Layout plan: {result['model']} at the {result['shape']} shape, {result['task']}",
        "",
        f"Device `{result['compute']}` ({result['memory_gib']} GiB, {cfg['headroom_gib']} GiB kept free), links "
        f"{cfg['links']['intra']} inside a node of {cfg['gpus_per_node']}, {cfg['links']['inter']} between nodes. "
        "Every number is the speed simulator's prediction (eval/simulator/training.py, memory.py, replay.py), "
        "not a measurement.",
        "",
    ]
    if result["task"] == "train":
        lines += [f"{cfg['gpus']} GPUs, sequences of {cfg['seq_len']} tokens, {result['global_batch_tokens']} tokens "
                  "per optimizer step.", ""]  # fmt: skip
    if best is None:
        lines += [f"**{no_layout(result, cfg)}**", ""]
    else:
        lines += [f"**Best:** {best['label']}.", ""]
        if result.get("command"):
            lines += ["```", result["command"], "```", ""]
    lines += [report.write_markdown_table(result["rows"], columns), ""]
    untimed = sum(1 for r in result["rows"] if r.get("step_s", 0) is None)
    unreplayed = sum(1 for r in result["rows"] if r.get("not_replayed"))
    if untimed:
        lines += [f"{untimed} layouts do not fit in memory and were not timed (n/a), {unreplayed} of them not replayed "
                  "in memory either (a lighter layout of theirs, a smaller micro-batch or more activation "
                  "checkpointing, is over the memory already); `prune=false` replays them all.", ""]  # fmt: skip
    if result["task"] == "train":
        lines += [f"Planned in {result['planned_s']:.1f} s on {result['workers']} processes (`workers`) of the machine "
                  "that ran it.", ""]  # fmt: skip
    if result["refused"]:
        lines += ["## Refused layouts", "", *(f"- {r['degrees']}: {r['why']}" for r in result["refused"]), ""]
    lines += [f"![layouts]({image.name})", ""]
    return "\n".join(lines)


@hydra.main(config_path="../conf", config_name="plan", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from train.cli import refuse_existing_output

    out_dir = Path(cfg.out_dir) if cfg.out_dir else Path(HydraConfig.get().runtime.output_dir)
    refuse_existing_output(out_dir, bool(cfg.get("overwrite")))  # one rule: a report is not replaced unasked
    plain = OmegaConf.to_container(cfg, resolve=True)
    result = run_plan(plain, out_dir)
    columns = TRAIN_COLUMNS if result["task"] == "train" else GENERATE_COLUMNS
    print(report.write_markdown_table(result["rows"][: cfg.top], columns))
    if result.get("command"):
        print(f"\n[plan] best: {result['best']['label']}\n{result['command']}")
    elif result["best"]:
        print(f"\n[plan] best: {result['best']['label']}")
    else:
        print(f"\n[plan] {no_layout(result, cfg)}")
    if "wandb" in (plain.get("logger") or {}):
        report.log_to_wandb(out_dir, project=plain["logger"]["wandb"].get("project", "overlap-zoo"), name="plan",
                            config={k: v for k, v in plain.items() if k not in ("paths", "hydra", "logger")},
                            tables={"layouts": ([c for c, _ in columns], result["rows"])},
                            images={"plan": out_dir / "plan.png"}, tags=["plan"])  # fmt: skip
    print(f"[plan] -> {out_dir}/README.md, plan.json, plan.png", flush=True)


if __name__ == "__main__":
    # a bad input: one line and exit status 1 (HYDRA_FULL_ERROR=1: the full traceback)
    from train.cli import one_sentence_errors

    one_sentence_errors(main)()
