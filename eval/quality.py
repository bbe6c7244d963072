"""Quality evaluation of a zoo model: `python -m eval.quality [checkpoint=<hf dir>] [key=value ...]`.

A Hydra app over `conf/quality.yaml`:

0. checks `tasks.bundled` against the tasks under eval/tasks before anything is loaded (a misspelt name
   is refused naming the bundled tasks);
1. loads the model: a `save_pretrained` folder (`checkpoint=outputs/pretrain/<time>/hf`) or, with
   `checkpoint=null`, a randomly initialised `model.name` with `model.config` (the sanity baseline:
   chance accuracy, perplexity about the vocabulary size); weights that hold NaN or infinite values are
   refused, naming the tensors (`models.checkpoint.check_finite_weights`): their perplexity would be
   nan and every generated token eos;
2. measures the validation perplexity on the bundled corpus: `train.metrics.evaluate_loss` (the loss the
   trainer validates with) over `LMDataModule(...).val_dataloader()`, token-weighted over packed windows
   of `perplexity.seq_len`;
3. runs lm-eval's `simple_evaluate` through `eval.lm_eval_adapter.ZooLM` on the bundled offline tasks
   (`eval/tasks`) and on `tasks.hub` tasks by name; a hub task is recorded as "skipped: offline" when
   the Hugging Face Hub cannot be reached, and as "error: ..." when it fails to load for another
   reason, so one missing dataset never costs the rest of the report;
4. writes `quality.json` (valid JSON: a NaN metric is null) and `quality.md` to the run directory (or
   `out_dir`) and logs the same to W&B (offline unless WANDB_MODE says otherwise; `logger=none` for
   files only).

`run(cfg)` does all of this without Hydra's decorator (tests call it with a composed config).
"""

import math
import os
import socket
import time
from pathlib import Path

import hydra
import lm_eval
import torch
from lm_eval.models.utils_hf import get_dtype
from lm_eval.tasks import TaskManager
from omegaconf import DictConfig, OmegaConf
from transformers import AutoModelForCausalLM

import models
from eval import report
from eval.lm_eval_adapter import ZooLM, has_tokenizer, resolve_device
from eval.tasks import TASKS_DIR
from models.checkpoint import check_finite_weights
from train.data import LMDataModule, load_tokenizer
from train.metrics import evaluate_loss

HUB_HOST = "huggingface.co"
TABLE_COLUMNS = [
    ("task", "task"),
    ("source", "source"),
    ("metric", "metric"),
    ("value", "value"),
    ("stderr", "± stderr"),
    ("better", "better"),
    ("n", "n"),
]


# ------------------------------------------------------------------------------------------- model


def tokenizer_source(cfg: DictConfig) -> str | None:
    """What to load the tokenizer from: as configured, else the checkpoint's own, else None (bundled)."""
    if cfg.tokenizer:
        return str(cfg.tokenizer)
    if cfg.checkpoint and has_tokenizer(cfg.checkpoint):
        return str(cfg.checkpoint)
    return None


def load_model(cfg: DictConfig, vocab_size: int) -> tuple[torch.nn.Module, dict]:
    """The model to evaluate, in eval mode on its device, and a description of where it came from."""
    device = resolve_device(cfg.device)
    if cfg.checkpoint:
        path = Path(str(cfg.checkpoint))
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"checkpoint={cfg.checkpoint!r} is not a save_pretrained folder (no config.json); "
                "pass e.g. outputs/pretrain/<time>/hf."
            )
        model = AutoModelForCausalLM.from_pretrained(path, dtype=get_dtype(cfg.dtype))
        check_finite_weights(model, f"checkpoint={cfg.checkpoint}")
        info = {"source": "checkpoint", "checkpoint": str(path.resolve())}
    else:
        torch.manual_seed(cfg.seed)  # the same random model on every run
        config = OmegaConf.to_container(cfg.model.config, resolve=True)
        model = models.build_model(cfg.model.name, **{**config, "vocab_size": vocab_size})
        if cfg.dtype != "auto":
            model = model.to(get_dtype(cfg.dtype))
        info = {"source": "random weights", "name": cfg.model.name}
    model = model.to(device).eval()
    info |= {
        "model_type": model.config.model_type,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.config.vocab_size,
        "max_position_embeddings": getattr(model.config, "max_position_embeddings", None),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": str(device),
    }
    if model.config.vocab_size < vocab_size:
        raise ValueError(
            f"The model's vocab_size={model.config.vocab_size} is smaller than the tokenizer's {vocab_size} "
            "tokens; evaluate it with the tokenizer it was trained with (tokenizer=...)."
        )
    return model, info


# -------------------------------------------------------------------------------------- perplexity


def validation_perplexity(model: torch.nn.Module, cfg: DictConfig, tokenizer: str | None) -> dict:
    p = cfg.perplexity
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions is not None and p.seq_len > max_positions:
        raise ValueError(
            f"perplexity.seq_len={p.seq_len} is longer than the model's max_position_embeddings="
            f"{max_positions}; set perplexity.seq_len<={max_positions}."
        )
    datamodule = LMDataModule(
        source=p.source,
        tokenizer=tokenizer,
        seq_len=p.seq_len,
        batch_size=p.batch_size,
        validation_fraction=p.validation_fraction,
        split_seed=p.split_seed,
        max_val_batches=p.max_batches,
    )
    datamodule.setup("validate")
    measured = evaluate_loss(model, datamodule.val_dataloader(), p.max_batches)
    if not math.isfinite(measured["loss"]):
        # finite weights (checked on loading) and yet a NaN / infinite loss: the activations overflow
        fix = "evaluate it in dtype=float32" if cfg.dtype != "float32" else "its activations overflow even there"
        raise ValueError(
            f"The validation loss is {measured['loss']} although the weights are finite (dtype={cfg.dtype}): "
            f"the model's outputs are not finite; {fix}."
        )
    return {"source": p.source, "split": "validation", "seq_len": p.seq_len, **measured}


# ----------------------------------------------------------------------------------------- lm-eval


def hub_reachable(host: str = HUB_HOST, timeout_s: float = 3.0) -> bool:
    """False in offline mode or when `host` cannot be reached: hub tasks would fail to download."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return False
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def metrics_of(results: dict) -> dict[str, dict]:
    """lm-eval's {"acc,none": x, "acc_stderr,none": s, ...} -> {"acc": {"value": x, "stderr": s}}."""
    metrics: dict[str, dict] = {}
    for key, value in results.items():
        if "," not in key:  # "alias", "name", "sample_len"
            continue
        metric, filter_name = key.split(",", 1)
        is_stderr = metric.endswith("_stderr")
        name = metric.removesuffix("_stderr") if is_stderr else metric
        if filter_name != "none":
            name = f"{name},{filter_name}"
        number = None if value in (None, "N/A") else float(value)
        metrics.setdefault(name, {"value": None, "stderr": None})["stderr" if is_stderr else "value"] = number
    return metrics


def evaluate_tasks(
    lm: ZooLM,
    task_manager: TaskManager,
    names: list[str],
    cfg: DictConfig,
    source: str,
    tolerate_errors: bool,
) -> dict[str, dict]:
    """{task: {"source", "status", "n", "metrics"}} of one `simple_evaluate` over the tasks that load."""
    entries: dict[str, dict] = {}
    loaded = []
    for name in names:
        try:
            loaded += task_manager.load([name])["tasks"].values()
        except Exception as err:  # a hub task whose dataset cannot be fetched, a misspelt name, ...
            if not tolerate_errors:
                raise
            entries[name] = {"source": source, "status": f"error: {type(err).__name__}: {err}"}
    if not loaded:
        return entries
    # A process pool per bootstrapped metric costs more than the resampling itself at these sizes.
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=loaded,
        task_manager=task_manager,  # without one, lm-eval indexes all of its ~15k task configs
        limit=cfg.tasks.limit,
        bootstrap_iters=cfg.tasks.bootstrap_iters,
        log_samples=False,
        random_seed=cfg.seed,
        numpy_random_seed=cfg.seed,
        torch_random_seed=cfg.seed,
        fewshot_random_seed=cfg.seed,
    )
    for task, results in out["results"].items():
        higher = out.get("higher_is_better", {}).get(task, {})
        entries[task] = {
            "source": source,
            "status": "ok",
            "n": out["n-samples"][task]["effective"],
            "metrics": {
                name: {**m, "higher_is_better": higher.get(name.split(",")[0])}
                for name, m in metrics_of(results).items()
            },
        }
    return entries


def bundled_task_manager() -> TaskManager:
    """lm-eval's index of the tasks under eval/tasks only (lm-eval's own ~15k are not indexed)."""
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def check_bundled_tasks(names, task_manager: TaskManager) -> None:
    """Refuse a name in `tasks.bundled` that eval/tasks does not define, naming those it does."""
    names = list(names or [])
    known = task_manager.all_tasks  # tasks and tags ("shakespeare": all of them)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"tasks.bundled={names} names {unknown}, which eval/tasks does not define; the bundled tasks are "
            f"{task_manager.all_subtasks} (tags: {task_manager.all_tags}). lm-eval's own tasks go in "
            "tasks.hub."
        )


def run_lm_eval(lm: ZooLM, cfg: DictConfig, bundled: TaskManager | None = None) -> dict[str, dict]:
    bundled = bundled or bundled_task_manager()
    entries = evaluate_tasks(lm, bundled, list(cfg.tasks.bundled), cfg, "bundled", tolerate_errors=False)
    hub_names = list(cfg.tasks.hub or [])
    if hub_names:
        if hub_reachable():
            entries |= evaluate_tasks(lm, TaskManager(), hub_names, cfg, "hub", tolerate_errors=True)
        else:
            entries |= {name: {"source": "hub", "status": "skipped: offline"} for name in hub_names}
    return entries


# ------------------------------------------------------------------------------------------ report


def table_rows(result: dict) -> list[dict]:
    ppl = result["perplexity"]
    rows = [
        {
            "task": f"{ppl['source']} ({ppl['split']} split)",
            "source": "corpus",
            "metric": "perplexity",
            "value": ppl["ppl"],
            "better": "lower",
            "n": f"{ppl['tokens']:,} tokens",
        }
    ]
    for task, entry in result["tasks"].items():
        if entry["status"] != "ok":
            rows.append({"task": task, "source": entry["source"], "metric": "-", "value": entry["status"]})
            continue
        for name, m in entry["metrics"].items():
            better = {True: "higher", False: "lower"}.get(m.get("higher_is_better"))
            rows.append(
                {
                    "task": task,
                    "source": entry["source"],
                    "metric": name,
                    "value": m["value"],
                    "stderr": m["stderr"],
                    "better": better,
                    "n": entry["n"],
                }
            )
    return rows


def markdown(result: dict) -> str:
    model = result["model"]
    what = model.get("checkpoint") or f"{model['name']} with random weights"
    lines = [
        f"# Quality: {what}",
        "",
        f"{model['model_type']}, {model['num_parameters']:,} parameters, vocabulary {model['vocab_size']:,}, "
        f"{model['dtype']} on {model['device']}; tokenizer: {result['tokenizer']}.",
        "",
        # blank cells, not "n/a", where a row has no such value (a skipped task has no stderr)
        report.write_markdown_table(
            table_rows(result), TABLE_COLUMNS, fmt=lambda v: "" if v is None else report.format_value(v)
        ),
        "Settings: "
        + ", ".join(f"{k}={v}" for k, v in result["settings"].items())
        + f"; {result['elapsed_s']:.0f} s.",
        "",
    ]
    return "\n".join(lines)


def summary_metrics(result: dict) -> dict[str, float]:
    """Flat {name: number} of the report, for the W&B run summary."""
    summary = {
        "quality/val_loss": result["perplexity"]["loss"],
        "quality/val_ppl": result["perplexity"]["ppl"],
    }
    for task, entry in result["tasks"].items():
        for name, m in entry.get("metrics", {}).items():
            if m["value"] is not None:
                summary[f"quality/{task}/{name}"] = m["value"]
    return summary


def output_dir(cfg: DictConfig) -> Path:
    """`out_dir`, or the Hydra run directory."""
    if cfg.get("out_dir"):
        return Path(str(cfg.out_dir))
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def run(cfg: DictConfig) -> dict:
    """Evaluates one model; writes quality.json and quality.md; returns the result."""
    started = time.perf_counter()
    out_dir = output_dir(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))

    bundled = bundled_task_manager()
    check_bundled_tasks(cfg.tasks.bundled, bundled)  # before the model and the perplexity pass
    tokenizer_from = tokenizer_source(cfg)
    tokenizer = load_tokenizer(tokenizer_from)
    model, model_info = load_model(cfg, len(tokenizer))
    perplexity = validation_perplexity(model, cfg, tokenizer_from)
    # dtype "auto": keep the dtype load_model gave the model
    lm = ZooLM(
        model, tokenizer=tokenizer, device=model_info["device"], dtype="auto", batch_size=cfg.tasks.batch_size
    )
    tasks = run_lm_eval(lm, cfg, bundled)

    result = {
        "model": model_info,
        "tokenizer": tokenizer_from or "bundled (train/tokenizer)",
        "perplexity": perplexity,
        "tasks": tasks,
        "settings": {
            "limit": cfg.tasks.limit,
            "batch_size": cfg.tasks.batch_size,
            "bootstrap_iters": cfg.tasks.bootstrap_iters,
            "seed": cfg.seed,
            "threads": torch.get_num_threads(),
            "lm_eval": lm_eval.__version__,
        },
        "elapsed_s": time.perf_counter() - started,
    }
    report.write_json(out_dir / "quality.json", result)
    text = markdown(result)
    (out_dir / "quality.md").write_text(text, encoding="utf-8")
    print(text, flush=True)

    if cfg.get("logger") and "wandb" in cfg.logger:
        text_rows = [{k: report.format_value(v) for k, v in row.items()} for row in table_rows(result)]
        report.log_to_wandb(
            out_dir,
            project=cfg.logger.wandb.get("project", "overlap-zoo"),
            name=cfg.task_name,
            tags=list(cfg.get("tags") or []),
            config=OmegaConf.to_container(cfg, resolve=True),
            summary=summary_metrics(result),
            # as text: a W&B table column must hold one type, and "value" also holds statuses
            tables={"quality/results": ([c for c, _ in TABLE_COLUMNS], text_rows)},
        )
    return result


@hydra.main(config_path="../conf", config_name="quality", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from train.cli import refuse_existing_output

    refuse_existing_output(output_dir(cfg), bool(cfg.get("overwrite")))  # one rule: a report is not replaced unasked
    run(cfg)


if __name__ == "__main__":
    # a bad input: one line and exit status 1 (HYDRA_FULL_ERROR=1: the full traceback)
    from train.cli import one_sentence_errors

    one_sentence_errors(main)()
