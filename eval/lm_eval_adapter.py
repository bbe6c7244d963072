"""lm-eval model "zoo": any zoo causal LM (checkpoint folder or model object) under lm-eval's `HFLM`.

`ZooLM` is `HFLM` with the zoo's defaults:

- `import models` first, so `AutoConfig` / `AutoModelForCausalLM` resolve the zoo's model types;
- the causal backend, set explicitly (transformers' static list of causal-LM types, which HFLM consults
  to guess the backend, does not know the zoo's types);
- the tokenizer of the checkpoint folder when it has one, else the bundled tokenizer;
- `device="auto"` (CUDA when available, else CPU), fp32 by default, a fixed batch size;
- no Hub lookup of the model's revision hash when reporting model info (zoo checkpoints are local,
  and the lookup would wait on the network);
- weights with NaN or infinite values refused, naming the tensors (their log-likelihoods would be NaN).

In Python:

    lm = ZooLM(model, tokenizer=tokenizer, batch_size=8)          # a model object
    lm = ZooLM("outputs/pretrain/<time>/hf", batch_size=8)        # a saved checkpoint
    lm_eval.simple_evaluate(lm, tasks=[...], task_manager=...)

From the shell, `python -m eval.lm_eval_adapter` is lm-eval's own command line with "zoo" registered
(`--tasks shakespeare` is the tag of all bundled tasks; batch size and device go in their own flags):

    python -m eval.lm_eval_adapter run --model zoo --model_args pretrained=outputs/pretrain/<time>/hf \\
        --include_path eval/tasks --tasks shakespeare --batch_size 8 --device cpu

`--include_path eval/tasks` is needed with either command line (and with plain `lm_eval --model hf`): lm-eval
0.4 finds tasks only in its own folder and in --include_path; it has no entry point through which an
installed package could add tasks, so "Tasks not found" is what it says without the flag.
"""

from pathlib import Path

import torch
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils_hf import get_dtype

import models  # noqa: F401  (registers the zoo's architectures with the Auto classes)
from models.checkpoint import check_finite_weights
from train.data import load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device} but CUDA is not available on this machine (torch {torch.__version__}); "
            "use device=auto or device=cpu."
        )
    return str(device)


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def resolve_tokenizer(
    tokenizer: str | transformers.PreTrainedTokenizerBase | None, checkpoint: str | Path | None = None
) -> transformers.PreTrainedTokenizerBase:
    """A tokenizer object: as given, else the checkpoint folder's own, else the bundled one."""
    if isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
        return tokenizer
    if tokenizer is None and checkpoint is not None and has_tokenizer(checkpoint):
        tokenizer = str(checkpoint)
    return load_tokenizer(tokenizer)  # None: the bundled tokenizer; also guarantees eos and pad tokens


@register_model("zoo")
class ZooLM(HFLM):
    """HFLM over a zoo model: `pretrained` is a `save_pretrained` folder or a `PreTrainedModel`."""

    def __init__(
        self,
        pretrained: str | transformers.PreTrainedModel,
        tokenizer: str | transformers.PreTrainedTokenizerBase | None = None,
        device: str | None = "auto",
        batch_size: int | str = 8,
        dtype: str | torch.dtype = "float32",
        max_length: int | None = None,
        **kwargs,
    ) -> None:
        device = resolve_device(device)
        checkpoint = str(pretrained) if isinstance(pretrained, (str, Path)) else None
        if checkpoint is None:
            # HFLM evaluates a model object where it is, in its dtype: move and cast it here instead.
            pretrained = pretrained.to(device)
            if dtype != "auto":
                pretrained = pretrained.to(get_dtype(dtype))
        super().__init__(
            pretrained=checkpoint or pretrained,
            backend="causal",
            tokenizer=resolve_tokenizer(tokenizer, checkpoint),
            device=device,
            dtype=dtype,
            # from lm-eval's command line every value arrives as a string
            batch_size=int(batch_size) if str(batch_size).isdigit() else batch_size,
            max_length=int(max_length) if max_length is not None else None,
            **kwargs,
        )
        check_finite_weights(self.model, f"pretrained={checkpoint}" if checkpoint else "The model")

    def get_model_info(self) -> dict:
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "model_type": getattr(self.config, "model_type", None),
            "model_path": self.pretrained if isinstance(self.pretrained, str) else None,
        }


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
