"""The run directory and what a run continues from: the checks `train.pretrain` makes before it builds anything.

- `find_resume_checkpoint` / `readable_checkpoint`: the checkpoint `resume=auto|never|<path>` names, and the
  newest one that loads when `last.ckpt` cannot (a file cut short, a sharded checkpoint's directory without
  its `.metadata`);
- `check_checkpoint_fits` / `check_checkpoint_contents`: the same model, not past `trainer.max_steps`, finite
  weights (a sharded checkpoint counted its non-finite weights when saved: nothing large is read here);
- `describe_run` / `check_run_directory`: another run in the directory is not overwritten unless
  `overwrite=true`, which removes its checkpoint (file, or link and directory) and `hf/` first;
- `checkpoint_on_disk`: what a rerun would resume from, in words, for a run that ended with an error.

Checkpoints are either one file or a torch.distributed.checkpoint directory behind a link
(`train.sharded_checkpoint`); every check here reads only their small part.
"""

import logging
import os
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from train import sharded_checkpoint
from train.module import CausalLMModule, TrainingError, describe_nonfinite, nonfinite_tensors

log = logging.getLogger("train.pretrain")  # the pretraining app's lines, wherever they are written from


@rank_zero_only
def log_info(message: str) -> None:
    log.info(message)


@rank_zero_only
def log_warning(message: str) -> None:
    log.warning(message)


def find_resume_checkpoint(resume: str | None, output_dir: Path) -> str | None:
    """The checkpoint `trainer.fit` continues from: `auto`, `never` or an explicit path."""
    if resume is None or str(resume) == "never":
        return None
    if str(resume) == "auto":
        last = output_dir / "checkpoints" / "last.ckpt"
        # a link whose directory is gone is still named: readable_checkpoint falls back from it, and says so
        return str(last) if last.exists() or last.is_symlink() else None
    path = Path(str(resume))
    if not path.exists():
        raise FileNotFoundError(
            f"resume={resume!r} is not a checkpoint; use auto, never or a .ckpt path (a file, or a sharded "
            "checkpoint's directory)."
        )
    return str(path)


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` cannot be loaded (a file cut short by a crash, another format), or None if it can."""
    return sharded_checkpoint.problem(path)


def readable_checkpoint(ckpt_path: str, fall_back: bool) -> str:
    """`ckpt_path` if it loads. Otherwise, with `fall_back` (resume=auto), the newest other checkpoint of
    its directory that loads, with a warning; else a `TrainingError` naming the file. A model that is not a
    training checkpoint (an HF `hf/` folder or its weights file) is refused, pointing at `+model.init_from`."""
    path = Path(ckpt_path)
    problem = checkpoint_problem(path)
    if problem is None:
        return ckpt_path
    if problem.startswith(sharded_checkpoint.NOT_A_TRAINING_CHECKPOINT) and not fall_back:
        raise ValueError(
            f"resume={ckpt_path} is {problem}: resume continues a run's checkpoint (<run>/checkpoints/last.ckpt, "
            "a file or a sharded checkpoint's folder); to start a new run from a model's weights pass "
            "+model.init_from=<its hf/ folder> with resume=never."
        )
    others = sharded_checkpoint.loadable_siblings(path)
    if fall_back and others:
        log_warning(f"{path} cannot be loaded ({problem}); resuming from {others[0]}, the newest one that can.")
        return str(others[0])
    older = f" ({others[0]} is the newest other one that can)" if others else ""
    raise TrainingError(
        f"Cannot resume: {path} cannot be loaded ({problem}). Move it away, point resume=<path> at another "
        f"checkpoint{older}, or start over with resume=never overwrite=true."
    )


def check_checkpoint_fits(ckpt_path: str, module: CausalLMModule) -> None:
    """A checkpoint of another model (architecture, shape, vocabulary) fails here, in one sentence."""
    # mmap: only the small hyper-parameter dict is actually read from disk
    saved = sharded_checkpoint.read_meta(ckpt_path).get("hyper_parameters", {})
    then = {"model.name": saved.get("model_name"), "vocab_size": saved.get("vocab_size")}
    now = {"model.name": module.hparams.model_name, "vocab_size": module.hparams.vocab_size}
    for field in {*saved.get("model_config", {}), *module.hparams.model_config}:
        then[f"model.config.{field}"] = saved.get("model_config", {}).get(field)
        now[f"model.config.{field}"] = module.hparams.model_config.get(field)
    differ = sorted(key for key in now if then[key] != now[key])
    if saved and differ:
        changes = ", ".join(f"{key}={then[key]!r} there but {now[key]!r} here" for key in differ)
        raise ValueError(
            f"Cannot resume from {ckpt_path}: {changes}; use the checkpoint's settings, another run "
            "directory (hydra.run.dir=...) or resume=never overwrite=true to replace that run."
        )


def check_checkpoint_contents(ckpt_path: str, max_steps: int) -> int:
    """The checkpoint's step, if training can continue from it: not already past `max_steps`, and weights
    without NaN or infinite values (from which every loss is NaN, whatever the optimizer settings)."""
    checkpoint = sharded_checkpoint.read_meta(ckpt_path)
    step = int(checkpoint.get("global_step", 0))
    if step > max_steps:
        raise TrainingError(
            f"Cannot resume: {ckpt_path} is at step {step}, already past trainer.max_steps={max_steps}; pass "
            f"trainer.max_steps>={step} to continue it, or another hydra.run.dir for a new run."
        )
    # A sharded checkpoint counted its non-finite weights when it was saved (its tensors are not read here).
    bad = (
        describe_nonfinite(checkpoint.get("nonfinite", []))
        if sharded_checkpoint.is_sharded(ckpt_path)
        else nonfinite_tensors(checkpoint.get("state_dict", {}))
    )
    if bad:
        raise TrainingError(
            f"Cannot train from {ckpt_path} (step {step}): its weights hold non-finite values ({'; '.join(bad)}); "
            "every loss from them is NaN whatever optimizer.lr is. Resume from a checkpoint saved before "
            "(resume=<path>), or start over with resume=never overwrite=true."
        )
    return step


def describe_run(output_dir: Path) -> str | None:
    """What of an earlier run `output_dir` holds that a new run would overwrite, in words; None if nothing."""
    held = []
    last = output_dir / "checkpoints" / "last.ckpt"
    if last.is_symlink() and not last.exists():
        held.append(f"checkpoints/last.ckpt (a link to {os.readlink(last)}, which is gone)")
    elif last.exists():
        try:
            saved = sharded_checkpoint.read_meta(last)
            name = saved.get("hyper_parameters", {}).get("model_name", "?")
            held.append(f"checkpoints/last.ckpt of {name} at step {saved.get('global_step', '?')}")
        except Exception:  # unreadable: still something a new run would replace
            held.append("checkpoints/last.ckpt (unreadable)")
    hf_config = output_dir / "hf" / "config.json"
    if hf_config.is_file():
        import json

        try:
            model_type = json.loads(hf_config.read_text()).get("model_type", "?")
        except ValueError:
            model_type = "?"
        held.append(f"hf/ ({model_type})")
    return " and ".join(held) or None


def check_run_directory(cfg: DictConfig, output_dir: Path) -> None:
    """Refuses a run that would overwrite another run's `checkpoints/last.ckpt` or `hf/` without continuing it
    (resume=never, resume=<a checkpoint elsewhere>, or resume=auto over an hf/ without a checkpoint), unless
    `overwrite=true`: then those are removed first, so that a rerun of this directory can only resume this
    run."""
    held = describe_run(output_dir)
    if held is None:
        return
    resume = str(cfg.get("resume", "auto"))
    last = output_dir / "checkpoints" / "last.ckpt"
    own = resume not in ("auto", "never") and Path(resume).resolve().parent == last.parent.resolve()
    if cfg.get("overwrite", False) and own:
        raise ValueError(
            f"overwrite=true removes the run in {output_dir} while resume={resume} continues from one of its "
            "checkpoints; pass one of them: overwrite=true resume=never (start over) or the resume alone."
        )
    if not cfg.get("overwrite", False) and (own or (resume == "auto" and (last.exists() or last.is_symlink()))):
        return  # a continuation of this run (check_checkpoint_fits refuses one of another model)
    if cfg.get("overwrite", False):
        if int(os.environ.get("RANK", "0")) == 0:
            sharded_checkpoint.remove(last)
            import shutil

            shutil.rmtree(output_dir / "hf", ignore_errors=True)
            log_info(f"overwrite=true: removed the earlier run's {held} from {output_dir}")
        return
    why = {
        "never": "resume=never starts a new run",
        "auto": "resume=auto finds no checkpoint of it to continue",
    }.get(resume, f"resume={resume} continues a checkpoint from elsewhere")
    raise ValueError(
        f"The run directory {output_dir} already holds another run ({held}), which this one would overwrite "
        f"({why}); pass overwrite=true to replace it on purpose, or choose another hydra.run.dir."
    )


def checkpoint_on_disk(output_dir: Path) -> str:
    """What a rerun of this run directory would resume from, in words (for a run that ended with an error)."""
    last = output_dir / "checkpoints" / "last.ckpt"
    if not last.exists() and not last.is_symlink():
        return (
            f"No checkpoint was written yet ({last} does not exist): the same command with "
            f"hydra.run.dir={output_dir} starts over."
        )
    problem = checkpoint_problem(last)
    if problem is not None:
        return f"The last checkpoint, {last}, cannot be loaded ({problem})."
    step = sharded_checkpoint.read_meta(last).get("global_step", "?")
    return f"The last checkpoint, {last} (step {step}), is intact: the same command with hydra.run.dir={output_dir} resumes from it."
