"""Convert a checkpoint into a zoo architecture and measure what the conversion costs.

    python -m train.convert source=DIR ladder_layers=N [retrain.enabled=true retrain.overrides=[...]]
    python -m train.convert converter=NAME source=DIR [its options]
    python -m train.convert converter=llama_to_moe source=DIR num_local_experts=4 moe_layer_freq=2

`converter` names one of `models.CONVERTERS`, each registered by its architecture's folder (docs/checkpoints.md
tables them; `llama_to_ladder` is the default). A converter whose `calibration` is set is handed that many
training batches of the bundled corpus (`calibration_batches`): models/ reads no data of its own. A converter
whose target is not a zoo architecture (`export_stock`) writes the class's own files, without remote code or
retraining.
The converter states which checkpoints it reads, which options it takes (top-level keys of this app's
config, conf/convert.yaml: an option of another converter is refused) and what it checks; this app checks
that the source is a saved checkpoint of one of those kinds, converts (seeded by `seed`: fresh weights
such as a router are the same on every run), saves the result with the tokenizer, and reports validation
loss on the bundled corpus before conversion, right after it, and after optional retraining with the
pretraining app (the recipe of the Ladder paper and of sparse upcycling: expect a jump, or none where the
conversion keeps the function, then recovery).
"""

import json
import shutil
import time
from pathlib import Path

import hydra
import torch
from hydra import compose
from omegaconf import DictConfig, OmegaConf
from transformers import AutoModelForCausalLM

import models
from models.checkpoint import apply_special_tokens, drop_loading_options, save_checkpoint, share_files
from models.registry import Converter
from train.cli import refuse_existing_output
from train.data import LMDataModule, load_tokenizer
from train.metrics import evaluate_loss


def has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def source_data(source: str | Path, stage: str) -> LMDataModule:
    """The bundled corpus set up for `stage` ("fit", "validate"), tokenized with the source checkpoint's
    tokenizer if it has one (else the bundled one)."""
    source = Path(source)
    data = LMDataModule(tokenizer=str(source) if has_tokenizer(source) else None, seed=0)
    data.prepare_data()
    data.setup(stage)
    return data


def calibration_batches(source: str | Path, num_batches: int) -> list[torch.Tensor]:
    """The first `num_batches` training batches (token ids) of `source_data`: what a calibrated conversion
    reads."""
    data = source_data(source, "fit")
    out = []
    for batch in data.train_dataloader():
        out.append(batch["input_ids"])
        if len(out) >= num_batches:
            break
    return out


def converter_options(cfg: DictConfig, converter: Converter) -> dict:
    """The converter's options from the app's config, as plain Python values (a list stays a list); an
    unset option (null) is left out, so the converter's own default applies.

    Every converter's options are keys of conf/convert.yaml (so that `num_local_experts=4` needs no `+`);
    one set for a converter that does not take it is refused rather than silently ignored."""
    takes = ", ".join(converter.options) or "none"
    others = {name for c in models.CONVERTERS.values() for name in c.options} - set(converter.options)
    stray = sorted(n for n in others if n in cfg and cfg[n] is not None)  # `in` is False for ??? too
    if stray:
        given = ", ".join(f"{n}={cfg[n]}" for n in stray)
        owners = sorted(c.name for c in models.CONVERTERS.values() if set(stray) & set(c.options))
        raise ValueError(
            f"{given}: not an option of converter={converter.name}, which takes: {takes}; drop it, or choose a "
            f"converter that takes it ({', '.join(owners)})."
        )
    options = {}
    for name in converter.options:
        if name not in cfg.keys():  # (`in cfg` is False for a missing value too)
            raise ValueError(f"conf/convert.yaml has no key {name!r}, an option of converter={converter.name}; add it there.")
        if OmegaConf.is_missing(cfg, name):
            raise ValueError(f"converter={converter.name} needs {name}=...; its options: {takes}.")
        value = cfg[name]
        if value is None:
            continue
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
        fitting = sorted(c.name for c in models.CONVERTERS.values() if model_type in c.source_types)
        instead = (
            f"; for a {model_type!r} checkpoint pass converter={' or converter='.join(fitting)}"
            if fitting else f"; no converter reads {model_type!r} checkpoints"
        )  # fmt: skip
        raise ValueError(
            f"source={source} has model_type={model_type!r}, not a {what}; train.convert converts "
            f"{converter.source_title} checkpoints to {converter.target_title} "
            f"(converter={converter.name}){instead}."
        )
    if not any(source.glob("*.safetensors")) and not any(source.glob("pytorch_model*.bin")):
        raise FileNotFoundError(f"source={source} has a config.json but no weights (*.safetensors); {hint}.")
    if converter.check is not None:
        converter.check(source, **options)


def source_vocab_size(source: Path) -> int | None:
    """The source checkpoint's vocabulary size (config.json's `vocab_size`, or its text config's)."""
    config = json.loads((source / "config.json").read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) else None


def check_vocabulary(source: Path, tokenizer, tokenizer_source: str | None) -> None:
    """The tokenizer saved with the converted model and used to evaluate it (the source's own, else
    `data.tokenizer`, by default the bundled one) must not produce ids past the model's embedding: checked
    before anything is converted or written (it failed as `IndexError: index out of range` after writing)."""
    vocab = source_vocab_size(source)
    needed = len(tokenizer)
    if vocab is None or needed <= vocab:
        return
    which = "the bundled tokenizer" if tokenizer_source is None else f"the tokenizer {tokenizer_source}"
    raise ValueError(
        f"source={source} has a vocabulary of {vocab:,} tokens but {which} (data.tokenizer={tokenizer_source}) has "
        f"{needed:,}, so its ids would index past the model's embedding; the source has no tokenizer of its own: "
        f"put the checkpoint's tokenizer (tokenizer.json) in {source}, or pass data.tokenizer=<a tokenizer of at "
        f"most {vocab:,} tokens>."
    )


def convert(cfg: DictConfig) -> dict:
    converter = models.get_converter(cfg.converter)
    source = Path(cfg.source)
    run_dir = Path(cfg.paths.output_dir).resolve()
    out = run_dir / converter.target
    options = converter_options(cfg, converter)
    check_source(source, converter, options)
    if cfg.retrain.enabled and converter.target not in models.ZOO:
        raise ValueError(
            f"retrain.enabled=true: converter={converter.name} writes a {converter.target_title} checkpoint, which the "
            "zoo's trainer does not train; set retrain.enabled=false (or retrain the zoo model before exporting)."
        )
    # the one rule for every command that writes a model: an earlier conversion is not replaced unasked
    if refuse_existing_output(out, bool(cfg.get("overwrite")), other="hydra.run.dir=<dir>"):
        shutil.rmtree(out) if out.is_dir() else out.unlink()  # overwrite=true: no file of the old one stays
    tokenizer_source = str(source) if has_tokenizer(source) else cfg.data.tokenizer
    tokenizer = load_tokenizer(tokenizer_source)
    check_vocabulary(source, tokenizer, tokenizer_source)

    # Fresh weights (an upcycled model's routers) depend on the seed only.
    torch.manual_seed(cfg.seed)
    if converter.calibration:
        batches = calibration_batches(source, options.get("calibration_batches") or converter.calibration)
        converted = converter.convert(source, batches, **options)
    else:
        converted = converter.convert(source, **options)
    if converter.target in models.ZOO:
        save_checkpoint(converted, tokenizer, out)
    else:  # a stock transformers class: its own files, no remote code
        apply_special_tokens(converted, tokenizer)
        started = time.time()
        converted.save_pretrained(out)
        tokenizer.save_pretrained(out)
        share_files(out, since=started)  # as save_checkpoint: readable under the umask, no local loading options
        drop_loading_options(out)
    details = converter.summary(converted)
    result = {
        "converter": converter.name,
        "target": converter.target,
        "title": f"{converter.source_title} -> {converter.target_title}",
        "source": str(source),
        **details,
        "details": details,  # the converter's settings of the result, also spread above for direct access
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
            *(["overwrite=true"] if cfg.get("overwrite") else []),  # replaces the earlier retraining too
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
    # a bad input: one line and exit status 1 (HYDRA_FULL_ERROR=1: the full traceback)
    from train.cli import one_sentence_errors

    one_sentence_errors(main)()
