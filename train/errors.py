"""The failures a training run explains in its message, and the words for non-finite weights.

`TrainingError` and its kinds (`NonFiniteLossError`, `Interrupted`) end `python -m train.pretrain` with one
line and their exit status, no traceback; `nonfinite_tensors` / `describe_nonfinite` name the tensors that
hold NaN or infinite values, for the refusals of a checkpoint or an `init_from` model.
"""

from models.checkpoint import nonfinite_counts
from train.cli import ExplainedError


class TrainingError(ExplainedError):
    """A failure explained in its message: `train.pretrain` reports it in one line, without a traceback."""


class NonFiniteLossError(TrainingError):
    """The loss or the gradient of a step is NaN or infinite (`nonfinite_loss=stop`)."""


class Interrupted(TrainingError):
    """The run was stopped by SIGTERM (what schedulers send) after writing its checkpoint. Exit status 143
    (128 + SIGTERM, the shell's convention for a process ended by that signal): not a success to a scheduler,
    and a requeued job with the same run directory resumes from the checkpoint."""

    exit_code = 143


def nonfinite_tensors(state: dict, limit: int = 5) -> list[str]:
    """The floating-point tensors of `state` holding NaN or infinite values, as `name (k NaN, j inf of n)`
    (the first `limit`, then how many more)."""
    return describe_nonfinite(nonfinite_counts(state.items()), limit)


def describe_nonfinite(counts, limit: int = 5) -> list[str]:
    """`(name, NaN count, inf count, values)` tuples in words, as `nonfinite_tensors` gives them."""
    found = []
    for name, nan, inf, numel in counts:
        parts = [f"{nan} NaN" if nan else "", f"{inf} inf" if inf else ""]
        found.append(f"{name} ({', '.join(p for p in parts if p)} of {numel})")
    if len(found) > limit:
        found = [*found[:limit], f"and {len(found) - limit} more"]
    return found
