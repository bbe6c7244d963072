"""Config hygiene (models/llama/configuration.py `check_fields`, inherited by every zoo config): an unknown
field is refused with one error naming it and the nearest known field, on every path a config takes:

- the config class / `models.build_config` / `models.build_model` keywords;
- `from_pretrained` / `AutoConfig` / `AutoModelForCausalLM` of a config.json that carries it, and a config's
  `from_pretrained(dir, field=value)` override;
- Hydra overrides of the pretraining app (`+model.config.num_local_expert=4`).

And what must keep loading does: transformers' standard fields (dtype / torch_dtype, architectures, auto_map,
token ids, tie_word_embeddings, transformers_version, legacy rope_theta / rope_scaling, generation settings),
an HF Llama config.json as transformers 4 wrote it, every conf/model/*.yaml, and every zoo config through
to_dict / from_dict and save_pretrained / from_pretrained.
"""

import json
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import models
from models.llama import ZooLlamaConfig
from models.llama.configuration import known_fields

REPO = Path(__file__).resolve().parents[1]
# (architecture, a typo, the field it should name)
TYPOS = {
    "llama": ("num_key_value_head", "num_key_value_heads"),
    "moe": ("num_local_expert", "num_local_experts"),
    "gqla": ("kv_lora_rnk", "kv_lora_rank"),
    "ladder": ("ladder_layer", "ladder_layers"),
    "scmoe": ("shortcut_positon", "shortcut_position"),
    "moepp": ("num_local_expert", "num_local_experts"),
    "kraken": ("kraken_degre", "kraken_degree"),
    "linear": ("hidden_sise", "hidden_size"),
    "parallel": ("rms_norm_esp", "rms_norm_eps"),
}
# What a transformers-4 Llama-3 config.json carries (field names as on the hub), shrunk.
LLAMA3_JSON = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 300,
}


def test_every_architecture_is_covered():
    assert {entry.config_class for entry in models.ZOO.values()} == {
        models.ZOO[name].config_class for name in TYPOS
    }


@pytest.mark.parametrize("name", sorted(TYPOS))
def test_unknown_keyword_refused_with_nearest_field(name):
    typo, nearest = TYPOS[name]
    entry = models.ZOO[name]
    assert nearest in known_fields(entry.config_class)
    match = f"has no field '{typo}' \\(did you mean '{nearest}'\\?\\)"
    with pytest.raises(ValueError, match=match):
        entry.tiny(**{typo: 4})
    with pytest.raises(ValueError, match=match):
        models.build_model(name, **{**entry.tiny_config, typo: 4})


def test_a_field_of_another_architecture_is_refused():
    with pytest.raises(ValueError, match="ZooLlamaConfig \\(zoo_llama\\) has no field 'q_lora_rank'"):
        models.build_config("llama", q_lora_rank=8)
    with pytest.raises(ValueError, match="has no fields 'kv_lora_rank', 'q_lora_rank': "):
        models.ZOO["moe"].tiny(q_lora_rank=8, kv_lora_rank=16)
    assert models.ZOO["gqla"].tiny(q_lora_rank=8).q_lora_rank == 8  # GQLA has it now


def test_config_json_with_unknown_field_refused(tmp_path):
    config = models.ZOO["moe"].tiny()
    config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "num_local_expert": 4}))
    match = "has no field 'num_local_expert' \\(did you mean 'num_local_experts'\\?\\)"
    for load in (type(config).from_pretrained, AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=match):
            load(tmp_path)
    path.write_text(json.dumps(saved))
    # ... and as a keyword override of from_pretrained, which transformers would drop silently
    with pytest.raises(ValueError, match=match):
        type(config).from_pretrained(tmp_path, num_local_expert=4)
    assert type(config).from_pretrained(tmp_path, num_local_experts=3).num_local_experts == 3


def test_another_architectures_checkpoint_loads_without_its_own_fields(tmp_path):
    """A Ladder checkpoint read as a Llama (a load the type table allows): `ladder_layers` is the Ladder's,
    left out by design; a field neither knows is still refused."""
    models.build_model("ladder", **models.ZOO["ladder"].tiny_config).save_pretrained(tmp_path)
    llama = models.ZooLlamaForCausalLM.from_pretrained(tmp_path)
    assert type(llama.config) is ZooLlamaConfig and "ladder_layers" not in llama.config.to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "ladder_layerz": 3}))
    with pytest.raises(ValueError, match="ZooLlamaConfig \\(zoo_llama\\) has no field 'ladder_layerz'"):
        models.ZooLlamaForCausalLM.from_pretrained(tmp_path)


def test_hydra_override_refused(tmp_path):
    from train.pretrain import train

    overrides = ["model=moe", "+model.config.num_local_expert=4", f"paths.output_dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("pretrain", overrides=overrides)
    with pytest.raises(ValueError, match="has no field 'num_local_expert' \\(did you mean 'num_local_experts'\\?\\)"):
        train(cfg)


def test_standard_fields_pass():
    config = ZooLlamaConfig(
        torch_dtype="bfloat16",
        architectures=["ZooLlamaForCausalLM"],
        auto_map={"AutoConfig": "configuration.ZooLlamaConfig"},
        bos_token_id=1,
        eos_token_id=[2, 3],
        pad_token_id=0,
        tie_word_embeddings=True,
        transformers_version="4.46.0",
        rope_theta=5000.0,
        max_length=64,  # a generation setting: transformers drops it from the config
        use_bfloat16=False,
        name_or_path="somewhere",
    )
    assert config.tie_word_embeddings and config.eos_token_id == [2, 3]
    assert config.rope_parameters["rope_theta"] == 5000.0
    assert models.ZOO["gqla"].tiny(num_kv_groups=2).num_key_value_heads == 2  # an attribute_map alias


def test_transformers_4_llama_config_json_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_JSON))
    config = ZooLlamaConfig.from_pretrained(tmp_path)
    assert config.model_type == "zoo_llama" and config.rope_parameters["rope_type"] == "llama3"
    assert config.num_key_value_heads == 2
    hf = LlamaConfig.from_pretrained(tmp_path)
    assert ZooLlamaConfig.from_dict(hf.to_dict()).to_dict()["rope_parameters"] == hf.rope_parameters


@pytest.mark.parametrize("path", sorted((REPO / "conf" / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_conf_model_builds(path):
    # Each conf/model file builds its architecture's config, and every field it sets is the config's value (a field
    # renamed or dropped on the way would be silently ignored otherwise).
    spec = yaml.safe_load(path.read_text())
    fields = spec.get("config") or {}
    config = models.build_config(spec["name"], **fields)
    assert type(config) is models.get(spec["name"]).config_class
    for key, value in fields.items():
        # transformers keeps rope_theta in rope_parameters
        held = config.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(config, key)
        assert (list(held) if isinstance(held, tuple) else held) == value, (path.name, key, held, value)


@pytest.mark.parametrize("name", sorted(models.ZOO))
def test_round_trips_keep_working(name, tmp_path):
    config = models.ZOO[name].tiny()
    again = type(config).from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is type(config) and loaded.to_diff_dict() == config.to_diff_dict()


def test_another_architectures_config_says_so(tmp_path):
    """A config.json of an architecture this class does not load: its fields are refused, and the error says
    whose config it is (a DeepSeek checkpoint read by the zoo's gqla config: convert it instead)."""
    from transformers import DeepseekV3Config

    DeepseekV3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="model_type='deepseek_v3', another architecture's than ZooGQLAConfig's"):
        models.ZooGQLAConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", sorted(models.ZOO))
@pytest.mark.parametrize(("field", "value"), [("num_attention_heads", 0), ("hidden_size", -64), ("num_hidden_layers", 0)])
def test_a_size_that_is_not_positive_is_one_sentence(name, field, value):
    # num_attention_heads=0 used to end in transformers' bare ZeroDivisionError (head_dim = hidden / heads).
    entry = models.ZOO[name]
    with pytest.raises(ValueError, match=rf"^{field}={value} must be a positive integer\.$"):
        entry.tiny(**{field: value})
