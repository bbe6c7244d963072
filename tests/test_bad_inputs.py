"""Bad inputs on every path fail early with ONE clear message naming the bad value and what would fit.

Each case is a call that used to misbehave (accepted a bad value, warned and went on with random weights,
failed a minute later or deep inside a library) and the message it must now raise. Paths covered:
config keyword overrides through `from_pretrained`/`AutoConfig`, the model's forward, loading one
architecture's checkpoint into another's class, truncated weights, the pretraining config
(`train.pretrain.check_config`), tokenizer and dataset sources (local paths, offline mode, an unreachable
hub), `train.convert`, and the eval entry points' `device`. Nothing here trains; tiny models only.
"""

import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

import models
from train import data
from train.convert import convert
from train.pretrain import check_config
from train.pretrain import train as run_pretraining

REPO = Path(__file__).resolve().parents[1]
TINY_IDS = torch.tensor([[1, 2, 3]])
HF_TOKENIZER = "HuggingFaceTB/SmolLM2-135M"  # conf/data/hf.yaml's tokenizer
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def tiny_model(name: str, **overrides):
    torch.manual_seed(0)
    return models.ZOO[name].model_class(models.ZOO[name].tiny(**overrides)).eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Saved tiny checkpoints by name: the zoo's architectures, an HF Llama, a truncated and a partial one."""
    root = tmp_path_factory.mktemp("ckpt")
    for name in ("llama", "ladder", "kraken", "parallel"):
        tiny_model(name).save_pretrained(root / name)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**models.TINY_LLAMA)).save_pretrained(root / "hf_llama")

    tiny_model("llama").save_pretrained(root / "truncated")
    weights = root / "truncated" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)

    from safetensors.torch import load_file, save_file

    tiny_model("llama").save_pretrained(root / "partial")
    state = load_file(root / "partial" / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, root / "partial" / "model.safetensors", metadata={"format": "pt"})

    (root / "empty").mkdir()
    return lambda name: str(root / name)


def compose_conf(config_name: str, overrides: list[str], output_dir: Path):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name, overrides=[*overrides, f"paths.output_dir={output_dir}"])


@pytest.fixture
def ctx(ckpt, tmp_path, monkeypatch):
    return SimpleNamespace(
        ckpt=ckpt,
        tmp=tmp_path,
        monkeypatch=monkeypatch,
        pretrain=lambda *overrides: compose_conf("pretrain", list(overrides), tmp_path / "run"),
        convert=lambda *overrides: compose_conf(
            "convert", ["evaluate.enabled=false", *overrides], tmp_path / "run"
        ),
    )


def hub_unreachable(ctx):
    """Not in offline mode, and the hub is a closed local port: the probe fails at once."""
    for var in OFFLINE_VARIABLES:
        ctx.monkeypatch.delenv(var, raising=False)
    ctx.monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    ctx.monkeypatch.setattr(data.hub, "_hub_reachable_cache", {})


def no_cuda(ctx):
    ctx.monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def assign_then_build(name: str, **fields):
    config = models.ZOO[name].tiny()
    for key, value in fields.items():
        setattr(config, key, value)
    return models.ZOO[name].model_class(config)


def decode_step_with_short_mask():
    model = tiny_model("llama")
    cache = model(TINY_IDS, use_cache=True).cache
    return model(torch.tensor([[4]]), cache=cache, attention_mask=torch.ones(1, 1))


def cuda_bench(ctx):
    no_cuda(ctx)
    from eval.bench.settings import resolve_device

    return resolve_device({"device": "cuda", "dtype": "auto"})


def cuda_quality(ctx):
    no_cuda(ctx)
    from eval.lm_eval_adapter import resolve_device

    return resolve_device("cuda")


LADDER = models.ZooLadderForCausalLM
OUT_OF_RANGE = r"ladder_layers={} is out of range; use 0\.\.4 \(the number of last layers to ladder\)"

CASES = [
    # --- config fields set through from_pretrained / AutoConfig / assignment (transformers sets them after
    # the config's own checks ran)
    pytest.param(
        lambda c: LADDER.from_pretrained(c.ckpt("ladder"), ladder_layers=7),
        ValueError,
        OUT_OF_RANGE.format(7),
        id="from_pretrained-ladder_layers-7",
    ),
    pytest.param(
        lambda c: LADDER.from_pretrained(c.ckpt("ladder"), ladder_layers=-2),
        ValueError,
        OUT_OF_RANGE.format(-2),
        id="from_pretrained-ladder_layers-negative",
    ),
    pytest.param(
        lambda c: LADDER.from_pretrained(c.ckpt("ladder"), ladder_layers=[1, 1]),
        ValueError,
        r"ladder_layers=\[1, 1\] must list distinct layer indices in 0\.\.3",
        id="from_pretrained-ladder_layers-duplicates",
    ),
    pytest.param(
        lambda c: LADDER.from_pretrained(c.ckpt("hf_llama"), ladder_layers=5),
        ValueError,
        OUT_OF_RANGE.format(5),
        id="hf-llama-to-ladder-ladder_layers-5",
    ),
    pytest.param(
        lambda c: models.ZooLadderConfig.from_pretrained(c.ckpt("ladder"), ladder_layers=7),
        ValueError,
        OUT_OF_RANGE.format(7),
        id="ZooLadderConfig.from_pretrained",
    ),
    pytest.param(
        lambda c: AutoConfig.from_pretrained(c.ckpt("ladder"), ladder_layers=7),
        ValueError,
        OUT_OF_RANGE.format(7),
        id="AutoConfig-ladder_layers",
    ),
    pytest.param(
        lambda c: models.ZooKrakenForCausalLM.from_pretrained(c.ckpt("kraken"), kraken_degree=0),
        ValueError,
        r"kraken_degree=0 must be a positive integer: the number of streams",
        id="from_pretrained-kraken_degree-0",
    ),
    pytest.param(
        lambda c: AutoConfig.from_pretrained(c.ckpt("llama"), num_key_value_heads=3),
        ValueError,
        r"num_attention_heads=4 is not divisible by num_key_value_heads=3; .*\[1, 2, 4\]",
        id="AutoConfig-kv-heads",
    ),
    pytest.param(
        lambda c: assign_then_build("ladder", ladder_layers=9),
        ValueError,
        OUT_OF_RANGE.format(9),
        id="assigned-ladder_layers-then-built",
    ),
    # --- the model's forward
    pytest.param(
        lambda c: tiny_model("llama")(torch.zeros(0, 5, dtype=torch.long)),
        ValueError,
        r"input_ids has shape \(0, 5\), an empty batch .* at least one sequence of at least one token",
        id="forward-empty-batch",
    ),
    pytest.param(
        lambda c: tiny_model("ladder")(torch.zeros(2, 0, dtype=torch.long)),
        ValueError,
        r"input_ids has shape \(2, 0\), an empty batch or sequence; pass at least one",
        id="forward-empty-sequence",
    ),
    pytest.param(
        lambda c: tiny_model("kraken")(torch.tensor([[1, 300, 2]])),
        ValueError,
        r"token id 300, but vocab_size=256 allows ids 0\.\.255; .*vocab_size >= 301",
        id="forward-id-too-large",
    ),
    pytest.param(
        lambda c: tiny_model("parallel")(torch.tensor([[1, -100, 2]])),
        ValueError,
        r"token id -100, but ids must be in 0\.\.255 \(vocab_size=256\); .*pad token",
        id="forward-negative-id",
    ),
    pytest.param(
        lambda c: tiny_model("llama")(torch.tensor([1, 2, 3])),
        ValueError,
        r"input_ids has shape \(3,\); it must be \[batch, seq_len\]",
        id="forward-1d-ids",
    ),
    pytest.param(
        lambda c: tiny_model("llama")(TINY_IDS, attention_mask=torch.ones(1, 5)),
        ValueError,
        r"attention_mask has shape \(1, 5\), but this input needs \(1, 3\)",
        id="forward-mask-too-long",
    ),
    pytest.param(
        lambda c: tiny_model("llama")(TINY_IDS, attention_mask=torch.ones(2, 3)),
        ValueError,
        r"attention_mask has shape \(2, 3\), but this input needs \(1, 3\)",
        id="forward-mask-batch",
    ),
    pytest.param(
        lambda c: decode_step_with_short_mask(),
        ValueError,
        r"attention_mask has shape \(1, 1\), but this input needs \(1, 4\): .*\[1, 3 \+ 1\]",
        id="forward-decode-mask-without-past",
    ),
    # --- one architecture's checkpoint into another's class; broken checkpoints
    pytest.param(
        lambda c: LADDER.from_pretrained(c.ckpt("kraken")),
        ValueError,
        r"model_type='zoo_kraken' .* ZooLadderForCausalLM .* Load it with ZooKrakenForCausalLM",
        id="kraken-into-ladder",
    ),
    pytest.param(
        lambda c: models.ZooLlamaForCausalLM.from_pretrained(c.ckpt("kraken")),
        ValueError,
        r"model_type='zoo_kraken' .* ZooLlamaForCausalLM .* Load it with ZooKrakenForCausalLM",
        id="kraken-into-llama",
    ),
    pytest.param(
        lambda c: models.ZooKrakenForCausalLM.from_pretrained(c.ckpt("hf_llama")),
        ValueError,
        r"model_type='llama' .* ZooKrakenForCausalLM .* Load it with ZooLlamaForCausalLM",
        id="hf-llama-into-kraken",
    ),
    pytest.param(
        lambda c: models.ZooLlamaForCausalLM.from_pretrained(c.ckpt("parallel")),
        ValueError,
        r"model_type='zoo_parallel' .* ZooLlamaForCausalLM .* Load it with ZooParallelForCausalLM",
        id="parallel-into-llama",
    ),
    pytest.param(
        lambda c: models.ZooLlamaForCausalLM.from_pretrained(c.ckpt("partial")),
        ValueError,
        r"1 of the model's weights are not in it and would stay random \(model\.norm\.weight.*save_pretrained",
        id="checkpoint-missing-a-weight",
    ),
    pytest.param(
        lambda c: models.ZooLlamaForCausalLM.from_pretrained(c.ckpt("truncated")),
        OSError,
        r"Cannot read .*truncated/model\.safetensors .*truncated or corrupt.*save or download",
        id="truncated-safetensors",
    ),
    # --- the pretraining config, before anything is built
    pytest.param(
        lambda c: check_config(c.pretrain("optimizer.lr=0")),
        ValueError,
        r"optimizer\.lr=0 must be a positive number",
        id="lr-zero",
    ),
    pytest.param(
        lambda c: check_config(c.pretrain("optimizer.lr=-1e-3")),
        ValueError,
        r"optimizer\.lr=-0\.001 must be a positive number",
        id="lr-negative",
    ),
    pytest.param(
        lambda c: (no_cuda(c), check_config(c.pretrain("trainer.accelerator=cuda"))),
        ValueError,
        r"trainer\.accelerator=cuda but CUDA is not available .*trainer=cpu",
        id="accelerator-cuda",
    ),
    pytest.param(
        lambda c: (no_cuda(c), check_config(c.pretrain("trainer.accelerator=gpu"))),
        ValueError,
        r"trainer\.accelerator=gpu but CUDA is not available .*accelerator=auto",
        id="accelerator-gpu",
    ),
    pytest.param(
        lambda c: check_config(c.pretrain("parallel=tp2", "trainer.devices=1")),
        ValueError,
        r"parallel\.tp=2 needs 2 processes, but trainer\.devices=1 x trainer\.num_nodes=1 starts 1; "
        r"set trainer\.devices=2",
        id="tp2-on-one-device",
    ),
    pytest.param(
        lambda c: check_config(c.pretrain("parallel=tp2", "trainer.devices=2", "trainer.num_nodes=2")),
        ValueError,
        r"parallel\.tp=2 needs 2 processes, but trainer\.devices=2 x trainer\.num_nodes=2 starts 4",
        id="tp2-on-two-nodes",
    ),
    pytest.param(
        lambda c: check_config(c.pretrain("parallel=tp2", "trainer=ddp")),
        ValueError,
        r"parallel\.tp=2 runs through train\.strategy\.ZooParallelStrategy, .* but trainer\.strategy is "
        r"lightning\.pytorch\.strategies\.DDPStrategy; drop it",
        id="tp-with-another-strategy",
    ),
    pytest.param(
        lambda c: check_config(c.pretrain("data.tokenizer=/no/such/tokenizer")),
        FileNotFoundError,
        r"data\.tokenizer='/no/such/tokenizer' does not exist; give an existing local path",
        id="tokenizer-path-missing",
    ),
    pytest.param(
        lambda c: check_config(c.pretrain("data.source=./no/such/corpus")),
        FileNotFoundError,
        r"data\.source='\./no/such/corpus' does not exist",
        id="data-source-path-missing",
    ),
    # --- tokenizer and dataset sources: offline mode and an unreachable hub fail at once
    pytest.param(
        lambda c: data.load_tokenizer("~/no/such/tokenizer"),
        FileNotFoundError,
        r"tokenizer='~/no/such/tokenizer' does not exist; give an existing local path",
        id="load_tokenizer-path-missing",
    ),
    # Hydra wraps the data module's error: "Error in call to target 'train.data.LMDataModule': OSError(...)".
    pytest.param(
        lambda c: (c.monkeypatch.setenv("HF_HUB_OFFLINE", "1"), run_pretraining(c.pretrain("data=hf"))),
        InstantiationException,
        r"tokenizer='HuggingFaceTB/SmolLM2-135M' is a hub name.*HF_HUB_OFFLINE=1 is set \(offline mode\)",
        id="data=hf-offline",
    ),
    pytest.param(
        lambda c: (
            c.monkeypatch.setenv("HF_HUB_OFFLINE", "1"),
            data.load_text_dataset("HuggingFaceFW/fineweb-edu", hf_config="sample-10BT"),
        ),
        ConnectionError,
        r"data\.source='HuggingFaceFW/fineweb-edu' is a hub dataset.*HF_HUB_OFFLINE=1 is set",
        id="hub-dataset-offline",
    ),
    pytest.param(
        lambda c: (hub_unreachable(c), data.load_tokenizer(HF_TOKENIZER)),
        OSError,
        r"tokenizer='HuggingFaceTB/SmolLM2-135M' .*127\.0\.0\.1:9 cannot be reached.*HF_HUB_OFFLINE=1",
        id="hub-unreachable-tokenizer",
    ),
    pytest.param(
        lambda c: (hub_unreachable(c), data.load_text_dataset("HuggingFaceFW/fineweb-edu")),
        ConnectionError,
        r"data\.source='HuggingFaceFW/fineweb-edu' .*cannot be reached.*set HF_HUB_OFFLINE=1 "
        r"HF_DATASETS_OFFLINE=1",
        id="hub-unreachable-dataset",
    ),
    # --- train.convert: checked before anything is loaded or written
    pytest.param(
        lambda c: convert(c.convert(f"source={c.tmp / 'nowhere'}", "ladder_layers=1")),
        FileNotFoundError,
        r"source=.*nowhere does not exist; pass the directory of a saved Llama checkpoint",
        id="convert-source-missing",
    ),
    pytest.param(
        lambda c: convert(c.convert(f"source={c.ckpt('empty')}", "ladder_layers=1")),
        FileNotFoundError,
        r"source=.*empty has no config\.json.*pass the directory of a saved Llama",
        id="convert-source-not-a-checkpoint",
    ),
    pytest.param(
        lambda c: convert(c.convert(f"source={c.ckpt('kraken')}", "ladder_layers=1")),
        ValueError,
        r"model_type='zoo_kraken', not a Llama; train\.convert converts Llama checkpoints to Ladder",
        id="convert-source-kraken",
    ),
    pytest.param(
        lambda c: convert(c.convert(f"source={c.ckpt('hf_llama')}", "ladder_layers=99")),
        ValueError,
        OUT_OF_RANGE.format(99),
        id="convert-ladder_layers-99",
    ),
    pytest.param(
        lambda c: convert(c.convert(f"source={c.ckpt('llama')}", "ladder_layers=[0,4]")),
        ValueError,
        r"ladder_layers=\[0, 4\] must list distinct layer indices in 0\.\.3",
        id="convert-ladder_layers-list",
    ),
    # --- eval entry points: device=cuda without CUDA
    pytest.param(
        cuda_bench,
        ValueError,
        r"device=cuda but CUDA is not available .*device=auto or device=cpu",
        id="bench-device-cuda",
    ),
    pytest.param(
        cuda_quality,
        ValueError,
        r"device=cuda but CUDA is not available .*device=auto or device=cpu",
        id="quality-device-cuda",
    ),
]


@pytest.mark.parametrize("call, error, message", CASES)
def test_bad_input_is_one_clear_error(ctx, call, error, message):
    start = time.monotonic()
    with pytest.raises(error, match=message):
        call(ctx)
    # "Early": nothing here may wait on the network (transformers and datasets retry for ~a minute).
    assert time.monotonic() - start < 20
    # Nothing was written by a run that failed its checks (train.convert, pretraining).
    assert not (ctx.tmp / "run" / "ladder").exists()


def test_long_input_warns_once_per_model():
    model = tiny_model("llama")
    limit = model.config.max_position_embeddings
    ids = torch.randint(0, model.config.vocab_size, (1, limit + 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(ids)
        model(ids)
        model(ids[:, :limit])  # within the limit: no warning either way
    long = [w for w in caught if "max_position_embeddings" in str(w.message)]
    assert len(long) == 1
    assert f"position {limit + 4}" in str(long[0].message) and f"max_position_embeddings={limit}" in str(
        long[0].message
    )


def test_decode_steps_and_valid_masks_still_work():
    model = tiny_model("llama")
    out = model(TINY_IDS, attention_mask=torch.ones(1, 3), use_cache=True)
    step = model(torch.tensor([[4]]), cache=out.cache, attention_mask=torch.ones(1, 4))
    assert step.logits.shape == (1, 1, model.config.vocab_size)
    generated = model.generate(
        TINY_IDS, attention_mask=torch.ones_like(TINY_IDS), max_new_tokens=3, do_sample=False
    )
    assert generated.shape == (1, 6)


def test_llama_checkpoints_still_convert(ckpt):
    """The conversion paths the type table keeps open: HF / zoo Llama -> Ladder, Llama -> parallel, Ladder -> Llama."""
    assert (
        models.ZooLadderForCausalLM.from_pretrained(ckpt("hf_llama"), ladder_layers=2).config.ladder_layers
        == 2
    )
    assert type(models.ZooLlamaForCausalLM.from_pretrained(ckpt("hf_llama"))) is models.ZooLlamaForCausalLM
    assert type(models.ZooParallelForCausalLM.from_pretrained(ckpt("llama"))) is models.ZooParallelForCausalLM
    assert type(models.ZooLlamaForCausalLM.from_pretrained(ckpt("ladder"))) is models.ZooLlamaForCausalLM
    assert type(models.ZooLlamaModel.from_pretrained(ckpt("llama"))) is models.ZooLlamaModel  # trunk only
    tied = ckpt("llama") + "_tied"
    tiny_model("llama", tie_word_embeddings=True).save_pretrained(tied)
    assert models.ZooLlamaForCausalLM.from_pretrained(tied).config.tie_word_embeddings


def test_convert_ladder_layers_out_of_range_writes_nothing(ckpt, tmp_path):
    cfg = compose_conf(
        "convert", [f"source={ckpt('llama')}", "ladder_layers=99", "evaluate.enabled=false"], tmp_path
    )
    with pytest.raises(ValueError, match=OUT_OF_RANGE.format(99)):
        convert(cfg)
    assert list(tmp_path.iterdir()) == []


def test_default_config_passes_check_config(tmp_path):
    check_config(compose_conf("pretrain", [], tmp_path))
    check_config(compose_conf("pretrain", ["parallel=tp2"], tmp_path))
    check_config(compose_conf("pretrain", ["data.tokenizer=train/tokenizer"], tmp_path))
