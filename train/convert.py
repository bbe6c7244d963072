"""Convert a Llama checkpoint to Ladder Residual and measure what the conversion costs.

    python -m train.convert source=DIR ladder_layers=N [retrain.enabled=true retrain.overrides=[...]]

Loads an HF `LlamaForCausalLM` (or zoo `llama`) checkpoint, ladders its last N layers (same weights,
rewired residual stream), saves the Ladder checkpoint with the tokenizer, and reports validation loss
on the bundled corpus before conversion, right after it, and after optional retraining with the
pretraining app (the paper's recipe: expect a jump, then recovery close to the original).
"""

import json
from pathlib import Path

import hydra
from hydra import compose
from omegaconf import DictConfig, OmegaConf
from transformers import AutoModelForCausalLM

import models  # noqa: F401  (registers the zoo with the Auto classes)
from eval.perplexity import evaluate_loss
from models.checkpoint import save_checkpoint
from models.ladder.configuration import ZooLadderConfig
from models.ladder.convert import CONVERTIBLE, llama_to_ladder
from train.data import load_tokenizer


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def check_source(source: Path, ladder_layers: int | list[int]) -> None:
    """What would make the conversion fail, or write a checkpoint that does not load: checked before
    anything is loaded or written."""
    hint = (
        "pass the directory of a saved Llama checkpoint (config.json + model.safetensors), "
        "e.g. outputs/pretrain/<time>/hf"
    )
    if not source.is_dir():
        what = "is a file, not a directory" if source.exists() else "does not exist"
        raise FileNotFoundError(f"source={source} {what}; {hint}.")
    config_file = source / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"source={source} has no config.json, so it is not a saved checkpoint; {hint}.")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (ValueError, AttributeError) as error:
        raise ValueError(f"{config_file} is not a JSON object ({error}); {hint}.") from error
    if model_type not in CONVERTIBLE:
        raise ValueError(
            f"source={source} has model_type={model_type!r}, not a Llama; train.convert converts "
            f"{', '.join(map(repr, CONVERTIBLE))} checkpoints to Ladder."
        )
    if not any(source.glob("*.safetensors")) and not any(source.glob("pytorch_model*.bin")):
        raise FileNotFoundError(f"source={source} has a config.json but no weights (*.safetensors); {hint}.")
    # The Ladder config's own checks (ladder_layers in range for this checkpoint's layers).
    ZooLadderConfig.from_pretrained(source, ladder_layers=ladder_layers)


def convert(cfg: DictConfig) -> dict:
    source = Path(cfg.source)
    run_dir = Path(cfg.paths.output_dir).resolve()
    out = run_dir / "ladder"
    ladder_layers = cfg.ladder_layers
    if OmegaConf.is_config(ladder_layers):  # a list of layer indices
        ladder_layers = OmegaConf.to_object(ladder_layers)
    check_source(source, ladder_layers)
    tokenizer_source = str(source) if _has_tokenizer(source) else cfg.data.tokenizer
    tokenizer = load_tokenizer(tokenizer_source)

    ladder = llama_to_ladder(source, ladder_layers)
    save_checkpoint(ladder, tokenizer, out)
    result = {
        "source": str(source),
        "ladder_layers": ladder.config.ladder_layers,
        "num_hidden_layers": ladder.config.num_hidden_layers,
        "ladder_dir": str(out),
        "val": {},
    }

    if cfg.evaluate.enabled:
        datamodule = hydra.utils.instantiate(cfg.data, tokenizer=tokenizer_source, _convert_="all")
        datamodule.prepare_data()
        datamodule.setup("validate")

        def val(model) -> dict:
            return evaluate_loss(model, datamodule.val_dataloader(), cfg.evaluate.max_batches)

        result["val"]["llama (source)"] = val(AutoModelForCausalLM.from_pretrained(source))
        result["val"]["ladder, no retraining"] = val(ladder)

    if cfg.retrain.enabled:
        from train.pretrain import train

        overrides = [
            "model=ladder",
            f"+model.init_from={out}",
            f"paths.output_dir={run_dir / 'retrain'}",
            f"data.tokenizer={tokenizer_source}" if tokenizer_source else "data.tokenizer=null",
            *cfg.retrain.overrides,
        ]
        pretrain_cfg = compose(config_name="pretrain", overrides=overrides)
        pretrain_cfg.model.config = {}  # the architecture's config comes from the converted checkpoint
        retrained = train(pretrain_cfg)
        result["retrain"] = {
            "overrides": overrides,
            "global_step": retrained["global_step"],
            "hf_dir": retrained["hf_dir"],
        }
        if cfg.evaluate.enabled:
            result["val"]["ladder, retrained"] = val(AutoModelForCausalLM.from_pretrained(retrained["hf_dir"]))

    write_report(result, run_dir)
    return result


def write_report(result: dict, run_dir: Path) -> None:
    (run_dir / "conversion.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Llama -> Ladder conversion ({result['ladder_layers']} of {result['num_hidden_layers']} layers laddered)",
        "",
        f"source: `{result['source']}`",
        "",
        "| model | val loss | val ppl |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {v['loss']:.4f} | {v['ppl']:.2f} |" for name, v in result["val"].items()]
    (run_dir / "conversion.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


@hydra.main(config_path="../conf", config_name="convert", version_base="1.3")
def main(cfg: DictConfig) -> None:
    convert(cfg)


if __name__ == "__main__":
    main()
