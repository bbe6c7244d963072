"""The console side of the zoo's Hydra entry points: an error the user can fix is one sentence, not a traceback.

`one_sentence_errors` decorates a Hydra entry point (train.pretrain's; eval's entry points can use it the
same way), and `one_sentence()` covers the task's body:

    @one_sentence_errors        # Hydra's own errors: an override or group that does not exist, the log file
    @hydra.main(config_path="../conf", config_name="...", version_base="1.3")
    def main(cfg):
        with one_sentence():    # the task's errors (Hydra would print "Error executing job ..." first)
            ...

(A decorator under `@hydra.main` would not do for the second: Hydra names the job, and so the log file,
after the file that defines the function it is given.)

A config error (a Hydra override or group that does not exist, a value a check refused, a file that
cannot be read or written, an `ExplainedError` such as train's `TrainingError`) is then printed as one
line, `Error: <what and what to do>`, and the command exits with status 1 (or the error's `exit_code`).
Hydra itself prints such errors inside a 15-30 line traceback whose last line alone says it. With
`HYDRA_FULL_ERROR=1` set by the user, everything propagates unchanged and Hydra's full traceback is
printed, as Hydra documents. Any other exception (a bug, not a bad input) keeps its full traceback.

How: Hydra re-raises instead of printing when HYDRA_FULL_ERROR is set, so the wrapper sets it for the call
(with a marker variable, so that processes started by the run, such as Lightning's other ranks, still know
the user did not ask for it) and turns the exception it catches into the sentence.
"""

import contextlib
import difflib
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from hydra.errors import (
    ConfigCompositionException,
    HydraException,
    InstantiationException,
    MissingConfigException,
)
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

FULL_ERROR = "HYDRA_FULL_ERROR"
# Set together with HYDRA_FULL_ERROR by the wrapper: "HYDRA_FULL_ERROR is ours, not the user's".
_SET_BY_US = "OVERLAP_ZOO_ONE_SENTENCE_ERRORS"


def same_on_every_rank(error: BaseException) -> BaseException:
    """Marks `error` as one that every process of a node raises alike (a config check before anything
    started): `one_sentence` then has it said by local rank 0 only."""
    error.same_on_every_rank = True
    return error


class ExplainedError(RuntimeError):
    """A failure whose message says what happened and what to do: printed as one line, no traceback.

    `exit_code` is the command's exit status (1 unless a subclass says otherwise)."""

    exit_code = 1


def full_traceback_requested() -> bool:
    """Whether the user set HYDRA_FULL_ERROR (to anything but 0 or empty), as opposed to this wrapper."""
    value = os.environ.get(FULL_ERROR, "")
    return value not in ("", "0") and not os.environ.get(_SET_BY_US)


def _not_in_struct(error) -> str | None:
    """`trainer.max_step=4` (a key the config does not have): the key and its nearest known names."""
    cause = error.__cause__
    if not isinstance(cause, (ConfigAttributeError, ConfigKeyError)) or "not in struct" not in str(cause):
        return None
    full_key = str(cause.full_key or cause.key)
    parent = cause.parent_node
    known = [str(k) for k in parent.keys()] if parent is not None and hasattr(parent, "keys") else []
    prefix = full_key.rpartition(".")[0]
    where = f"{prefix}." if prefix else ""
    near = difflib.get_close_matches(str(cause.key), known, n=3, cutoff=0.6)
    if near:
        hint = "did you mean " + " or ".join(f"{where}{k}" for k in near) + "?"
    else:
        hint = f"the settings there are {', '.join(known)}." if known else "check its spelling."
    # An optional key the config does not define (e.g. `model.init_from`) is added with Hydra's `+`; a key close
    # to a known one is a typo, and the hint would only mislead.
    added = "" if near else f" To add {full_key} as a new key, write +{full_key}=<value>."
    return f"{full_key} is not a setting of this config; {hint}{added}"


def _validator_error(error: BaseException) -> str | None:
    """A config class's validator (huggingface_hub's strict dataclasses, which transformers' configs use):
    `model.config.hidden_size=30` with 4 heads. The validator's own message names the values."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: no strict dataclasses
        return None
    if not isinstance(error, StrictDataclassError):
        return None
    cause = error.__cause__
    what = _first_lines(cause) if cause is not None else _first_lines(error)
    validator = getattr(error, "validator", None) or getattr(error, "field", None)
    where = f" ({validator})" if isinstance(validator, str) else ""
    return f"The model config is invalid{where}: {what} Change model.config.* (or the checkpoint's config.json) to fit."


def _missing_config(error) -> str:
    """`trainer=gpux`: Hydra's several lines as one: what is missing and the options there are."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    options: list[str] = []
    group = None
    for i, line in enumerate(lines):
        if line.startswith("Available options in"):
            group = line.removeprefix("Available options in").strip(" :")
            for option in lines[i + 1 :]:
                if option.startswith("Config search path"):
                    break
                options.append(option)
            break
    if not options:
        return lines[0] if lines else type(error).__name__
    return f"{lines[0]}; the options in {group} are {', '.join(options)}."


def explain(error: BaseException) -> str | None:
    """The one sentence for an error the user can fix by changing the command; None for anything else."""
    # instantiate wraps what the target raised ("Error in call to target '...': ValueError(...)")
    if isinstance(error, InstantiationException) and error.__cause__ is not None:
        return explain(error.__cause__) or _first_lines(error)
    # Hydra's job logging cannot open <run dir>/<job>.log: a read-only or unwritable run directory
    if isinstance(error, ValueError) and str(error).startswith("Unable to configure handler"):
        cause = error.__cause__
        if isinstance(cause, OSError):
            path = cause.filename or "its log file"
            directory = os.path.dirname(str(cause.filename)) if cause.filename else "the run directory"
            return (
                f"Cannot write the run directory {directory} ({cause.strerror or cause}: {path}); "
                "pass a writable one with hydra.run.dir=<dir> (or paths.log_dir=<dir> for the parent of run directories)."
            )
    if isinstance(error, MissingConfigException):  # (a ConfigCompositionException too)
        return _missing_config(error)
    if isinstance(error, ConfigCompositionException):
        return _not_in_struct(error) or _first_lines(error)
    validator = _validator_error(error)
    if validator is not None:
        return validator
    if isinstance(error, OSError) and error.filename and error.strerror:
        # raised by the OS (open, mkdir): "[Errno 13] Permission denied: '/x'"
        return f"{error.strerror}: {error.filename}."
    if isinstance(error, (ValueError, OSError, ExplainedError, HydraException, OmegaConfBaseException)):
        return _first_lines(error)
    return None


def _first_lines(error: BaseException, limit: int = 3) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return " ".join(line.strip() for line in lines[:limit]) or type(error).__name__


def _write_to_log_files(sentence: str) -> None:
    """Also into the run's log file when Hydra's job logging has opened one (`<run dir>/pretrain.log`)."""
    record = logging.LogRecord("overlap_zoo", logging.ERROR, __file__, 0, f"Error: {sentence}", None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


@contextlib.contextmanager
def one_sentence():
    """Inside it, a fixable error is printed as one line and ends the command (exit status 1, or the error's
    `exit_code`), unless the user set HYDRA_FULL_ERROR=1; anything else propagates."""
    if full_traceback_requested():
        yield
        return
    try:
        yield
    except Exception as error:
        sentence = explain(error)
        if sentence is None:
            raise
        if getattr(error, "same_on_every_rank", False) and os.environ.get("LOCAL_RANK", "0") != "0":
            # a config check of a multi-process launch (torchrun) fails alike on every rank of a node: said
            # once, by local rank 0; any other error may be this rank's own and is said by each
            raise SystemExit(getattr(error, "exit_code", 1)) from None
        _write_to_log_files(sentence)
        sys.stdout.flush()
        hint = "" if isinstance(error, ExplainedError) else "\n(Set HYDRA_FULL_ERROR=1 for the full traceback.)"
        sys.stderr.write(f"Error: {sentence}{hint}\n")
        raise SystemExit(getattr(error, "exit_code", 1)) from None


class _WithoutHydraJobLine:
    """sys.stderr less Hydra's "Error executing job with overrides: [...]" line, which Hydra writes before
    re-raising what the task function raised (hydra.core.utils.JobReturn.return_value): the one sentence
    follows instead. Everything else is passed through unchanged."""

    PREFIX = "Error executing job with overrides:"

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        if isinstance(text, str) and text.startswith(self.PREFIX):
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def one_sentence_errors(main: Callable[..., Any]) -> Callable[..., Any]:
    """`main` (a `@hydra.main` function) with a fixable error printed as one line, exit status 1: Hydra's
    own errors and the task's alike (the task's body needs no `one_sentence()` of its own)."""

    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> Any:
        if full_traceback_requested():
            return main(*args, **kwargs)
        # Hydra re-raises instead of printing its traceback; the marker says the setting is ours
        os.environ[FULL_ERROR] = "1"
        os.environ[_SET_BY_US] = "1"
        stderr = sys.stderr
        sys.stderr = _WithoutHydraJobLine(stderr)
        try:
            with one_sentence():
                return main(*args, **kwargs)
        finally:
            if isinstance(sys.stderr, _WithoutHydraJobLine):
                sys.stderr = stderr

    return run


class OutputExistsError(ExplainedError):
    """An output directory that already holds results, refused unless the user asked to replace them."""


# Written by Hydra into a fresh run directory before the task starts: not results.
_HYDRA_OWN = (".hydra",)


def results_in(directory: str | os.PathLike, keep: tuple[str, ...] = ()) -> list[str]:
    """The names in `directory` that are results (anything but Hydra's `.hydra/`, log files and `keep`);
    [] for a directory that does not exist."""
    path = os.fspath(directory)
    if not os.path.isdir(path):
        return [os.path.basename(path)] if os.path.exists(path) else []
    return sorted(
        name for name in os.listdir(path)
        if name not in _HYDRA_OWN and name not in keep and not name.endswith(".log")
    )  # fmt: skip


def _this_run(path: str) -> bool:
    """Whether `path` is the Hydra run directory of this very command (created by Hydra before the task, e.g.
    hydra.run.dir=<out_dir>/hydra): not an earlier result."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return False
        return os.path.realpath(HydraConfig.get().runtime.output_dir) == os.path.realpath(path)
    except Exception:  # noqa: BLE001 - no Hydra run: nothing of it to leave out
        return False


def exit_if_output_exists(directory: str | os.PathLike, overwrite: bool, *, flag: str, other: str) -> None:
    """`refuse_existing_output` for an argparse command (no Hydra to print the error): exits with its one `Error:`
    line."""
    try:
        refuse_existing_output(directory, overwrite, flag=flag, other=other)
    except OutputExistsError as error:
        raise SystemExit(f"Error: {error}") from None


def refuse_existing_output(
    directory: str | os.PathLike,
    overwrite: bool,
    *,
    flag: str = "overwrite=true",
    other: str = "out_dir=<dir>",
    keep: tuple[str, ...] = (),
) -> bool:
    """The one rule for every command that writes a report or a model: an output directory that already
    holds results (anything but what Hydra writes into a fresh run directory, `.hydra/` and log files, or
    `keep`) is refused in one line naming it, unless `overwrite` (the user's `flag`). Returns whether
    something is there (and `overwrite` allows replacing it)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        # Not something an overwrite replaces: a file where the output folder should be.
        raise same_on_every_rank(
            OutputExistsError(f"The output directory {os.fspath(directory)} exists and is not a directory; "
                              f"choose another {other}.")
        )
    found = [name for name in results_in(directory, keep) if not _this_run(os.path.join(directory, name))]
    if not found:
        return False
    if overwrite:
        return True
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    raise same_on_every_rank(
        OutputExistsError(
            f"The output directory {os.fspath(directory)} already holds results ({shown}); pass {flag} to replace them, "
            f"or choose another {other}."
        )
    )
