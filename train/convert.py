"""Convert a checkpoint into a zoo architecture and measure what the conversion costs.

    python -m train.convert source=DIR ladder_layers=N [retrain.enabled=true retrain.overrides=[...]]
    python -m train.convert converter=NAME source=DIR [its options]

`converter` names one of `models.CONVERTERS` (default `llama_to_ladder`: an HF `LlamaForCausalLM` or
zoo `llama` checkpoint with its last N layers laddered, same weights, rewired residual stream). The
converter states which checkpoints it reads, which options it takes (read from this app's config) and
what it checks; this app checks that the source is a saved checkpoint of one of those kinds, converts,
saves the result with the tokenizer, and reports validation loss on the bundled corpus before
conversion, right after it, and after optional retraining with the pretraining app (the paper's
recipe: expect a jump, then recovery close to the original).
"""

import json
from pathlib import Path

import hydra
from hydra import compose
from omegaconf import DictConfig, OmegaConf
from transformers import AutoModelForCausalLM

import models
from models.checkpoint import save_checkpoint
from models.registry import Converter
from train.data import load_tokenizer
from train.metrics import evaluate_loss


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def converter_options(cfg: DictConfig, converter: Converter) -> dict:
    """The converter's options from the app's config, as plain Python values (a list stays a list)."""
    options = {}
    for name in converter.options:
        value = cfg[name]
        options[name] = OmegaConf.to_object(value) if OmegaConf.is_config(value) else value
    return options


def check_source(source: Path, converter: Converter, options: dict) -> None:
    """What would make the conversion fail, or write a checkpoint that does not load: checked before
    anything is loaded or written."""
    what = converter.source_title
    hint = (
        f"pass the directory of a saved {what} checkpoint (config.json + model.safetensors), "
        "e.g. outputs/pretrain/<time>/hf"
    )
    if not source.is_dir():
        state = "is a file, not a directory" if source.exists() else "does not exist"
        raise FileNotFoundError(f"source={source} {state}; {hint}.")
    config_file = source / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"source={source} has no config.json, so it is not a saved checkpoint; {hint}.")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (ValueError, AttributeError) as error:
        raise ValueError(f"{config_file} is not a JSON object ({error}); {hint}.") from error
    if model_type not in converter.source_types:
        raise ValueError(
            f"source={source} has model_type={model_type!r}, not a {what}; train.convert converts "
            f"{', '.join(map(repr, converter.source_types))} checkpoints to {converter.target_title} "
            f"(converter={converter.name})."
        )
    if not any(source.glob("*.safetensors")) and not any(source.glob("pytorch_model*.bin")):
        raise FileNotFoundError(f"source={source} has a config.json but no weights (*.safetensors); {hint}.")
    if converter.check is not None:
        converter.check(source, **options)


def convert(cfg: DictConfig) -> dict:
    converter = models.get_converter(cfg.converter)
    source = Path(cfg.source)
    run_dir = Path(cfg.paths.output_dir).resolve()
    out = run_dir / converter.target
    options = converter_options(cfg, converter)
    check_source(source, converter, options)
    tokenizer_source = str(source) if _has_tokenizer(source) else cfg.data.tokenizer
    tokenizer = load_tokenizer(tokenizer_source)

    converted = converter.convert(source, **options)
    save_checkpoint(converted, tokenizer, out)
    details = converter.summary(converted)
    result = {
        "converter": converter.name,
        "title": f"{converter.source_title} -> {converter.target_title}",
        "source": str(source),
        **details,
        f"{converter.target}_dir": str(out),
        "val": {},
    }

    if cfg.evaluate.enabled:
        datamodule = hydra.utils.instantiate(cfg.data, tokenizer=tokenizer_source, _convert_="all")
        datamodule.prepare_data()
        datamodule.setup("validate")

        def val(model) -> dict:
            return evaluate_loss(model, datamodule.val_dataloader(), cfg.evaluate.max_batches)

        result["val"][f"{converter.source} (source)"] = val(AutoModelForCausalLM.from_pretrained(source))
        result["val"][f"{converter.target}, no retraining"] = val(converted)

    if cfg.retrain.enabled:
        from train.pretrain import train

        overrides = [
            f"model={converter.target}",
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
            result["val"][f"{converter.target}, retrained"] = val(
                AutoModelForCausalLM.from_pretrained(retrained["hf_dir"])
            )

    write_report(result, run_dir, details)
    return result


def write_report(result: dict, run_dir: Path, details: dict) -> None:
    (run_dir / "conversion.json").write_text(json.dumps(result, indent=2))
    settings = ", ".join(f"{k}={v}" for k, v in details.items())
    lines = [
        f"# {result['title']} conversion" + (f" ({settings})" if settings else ""),
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
