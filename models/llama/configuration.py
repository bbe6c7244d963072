"""Configuration of the dense Llama baseline.

It is transformers' `LlamaConfig` with its own `model_type`, so every Llama field means what it means
in Hugging Face and an HF Llama `config.json` loads into it unchanged. Our own checks run on top of
transformers' (which, in 5.x, do not validate head counts).

Every zoo config derives from `ZooLlamaConfig`, and every one refuses a field it does not know
(`check_fields`): transformers keeps an unknown keyword as a plain attribute that nothing reads, so a typo
(`num_local_expert=4`) or a field of another architecture (DeepSeek's `q_lora_rank` on a model that has no
query low-rank path) would otherwise train or load a different model without a word. Known: the fields of
the class and its bases (its dataclass fields and `attribute_map` aliases), and the keys transformers itself
reads or drops in `PreTrainedConfig.__post_init__` / `from_dict` (`torch_dtype`, legacy `rope_theta` /
`rope_scaling`, generation settings, ...) or that older config.json files carry (`STANDARD_FIELDS`).
A config.json of another architecture that this one may load (a Ladder checkpoint read as a Llama) loads with
that architecture's own fields left out (`without_fields_of_source`).
"""

import dataclasses
import difflib

from transformers import GenerationConfig, LlamaConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

# Keys a config.json or a caller may pass that are not dataclass fields of PreTrainedConfig but that
# transformers handles (reads, renames or drops) itself, or that config.json files written by transformers 4
# carry (its PretrainedConfig.__init__ took them): they still load.
STANDARD_FIELDS = frozenset(
    {
        # read or dropped by PreTrainedConfig.__post_init__ / from_dict in transformers 5
        "torch_dtype", "num_labels", "name_or_path", "_name_or_path", "_commit_hash", "output_attentions",
        "attn_implementation", "experts_implementation", "per_layer_config", "_attn_implementation_internal",
        "_experts_implementation_internal", "_attn_implementation_autoset", "model_type", "transformers_version",
        "rope_theta", "rope_scaling", "partial_rotary_factor",
        # written into config.json by save_pretrained / register_for_auto_class / quantizers
        "auto_map", "architectures", "custom_pipelines", "quantization_config",
        # transformers 4's PretrainedConfig.__init__ arguments (old checkpoints carry them)
        "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "tie_word_embeddings", "is_decoder",
        "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder", "finetuning_task",
        "tokenizer_class", "prefix", "bos_token_id", "pad_token_id", "eos_token_id", "sep_token_id",
        "decoder_start_token_id", "task_specific_params", "chunk_size_feed_forward", "output_hidden_states",
        "return_dict", "id2label", "label2id", "problem_type", "dtype", "is_encoder_decoder",
    }
)


# from_dict keywords that are loading options, not config fields.
LOADING_KWARGS = frozenset({"return_unused_kwargs", "_from_auto", "_from_pipeline", "gguf_file", "trust_remote_code"})


def known_fields(config_class) -> set[str]:
    """The field names `config_class(...)` / its config.json may carry: the dataclass fields of the class
    and its bases, their `attribute_map` aliases, transformers' standard keys and generation settings."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    aliases = set()
    for klass in config_class.__mro__:
        aliases |= set(getattr(klass, "attribute_map", {}) or {})
    generation = set(GenerationConfig._get_default_generation_params())
    return fields | aliases | generation | STANDARD_FIELDS


# The fields of the residual schedule (models/common/residual.py), which an architecture opts into by declaring
# `residual`; one that does not says why in its config class's `residual_refusal`.
RESIDUAL_FIELDS = ("residual", "ladder_layers")


def check_fields(config_class, names) -> None:
    """One clear error naming each of `names` that `config_class` does not know, with the nearest known one
    (the residual schedule's fields: the class's `residual_refusal`, why it does not take the schedule)."""
    known = known_fields(config_class)
    unknown = sorted(n for n in names if n not in known)
    if not unknown:
        return
    schedule = [n for n in unknown if n in RESIDUAL_FIELDS]
    if schedule:
        raise ValueError(
            f"{config_class.__name__} ({config_class.model_type}) has no field {schedule[0]!r}: it takes no other "
            f"residual schedule. {config_class.residual_refusal}"
        )
    hints = []
    for name in unknown:
        near = difflib.get_close_matches(name, sorted(known), n=1)
        hints.append(f"{name!r} (did you mean {near[0]!r}?)" if near else f"{name!r}")
    one = len(unknown) == 1
    raise ValueError(
        f"{config_class.__name__} ({config_class.model_type}) has no field{'' if one else 's'} {', '.join(hints)}: "
        f"transformers would keep {'it as an attribute' if one else 'them as attributes'} that nothing reads, so "
        f"the model would silently differ from the one asked for. Fix the name, or drop "
        f"{'it' if one else 'them'} (the fields: the annotations of {config_class.__name__} and of its bases)."
    )


# The sizes a model is built from: each a positive integer (num_key_value_heads may be None: = the heads).
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings")  # fmt: skip


def check_sizes(config) -> None:
    """One clear error for a size that is not a positive integer (`num_attention_heads=0` would otherwise end in
    a bare ZeroDivisionError inside transformers). The fields are the class's `size_fields`: a subclass whose own
    `validate` says more about one of them (what it means there) leaves it out."""
    for name in type(config).size_fields:
        value = getattr(config, name, None)
        if value is None and name == "num_key_value_heads":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")


def check_heads(hidden_size: int, num_attention_heads: int, num_key_value_heads: int, head_dim: int) -> None:
    if num_attention_heads <= 0 or num_key_value_heads <= 0:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} and num_key_value_heads={num_key_value_heads} "
            "must both be positive."
        )
    if num_attention_heads % num_key_value_heads != 0:
        fits = [d for d in range(1, num_attention_heads + 1) if num_attention_heads % d == 0]
        raise ValueError(
            f"num_attention_heads={num_attention_heads} is not divisible by "
            f"num_key_value_heads={num_key_value_heads}; num_key_value_heads must be one of {fits}."
        )
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings.")


def without_fields_of_source(config_class, config_dict: dict) -> dict:
    """A config.json of another architecture that this class may load (its `model_type` one of those
    models/common/pretrained.py's LOADS_FROM allows: a Ladder checkpoint read by the zoo llama) carries that
    architecture's own fields (`ladder_layers`), which this class leaves out by design: they are dropped here,
    so that only fields neither architecture knows (typos) are refused. Any other model_type drops nothing
    (its fields are refused: that checkpoint is not this architecture's)."""
    from models.common.pretrained import LOADS_FROM  # (models.common imports no config: no cycle, but late)

    source_type = config_dict.get("model_type")
    if not source_type or source_type == config_class.model_type:
        return config_dict
    if source_type not in LOADS_FROM.get(config_class.model_type, ()):
        return config_dict
    try:
        source_class = CONFIG_MAPPING[source_type]
    except KeyError:
        return config_dict
    theirs = known_fields(source_class) if dataclasses.is_dataclass(source_class) else set()
    drop = theirs - known_fields(config_class)
    return {k: v for k, v in config_dict.items() if k not in drop}


class ZooLlamaConfig(LlamaConfig):
    model_type = "zoo_llama"
    size_fields = SIZE_FIELDS  # checked by `check_sizes` before transformers' __post_init__ (a class attribute)
    # Why the architecture has no `residual` field, for `check_fields` (a class attribute, not a field).
    residual_refusal = (
        "The dense Llama under the ladder residual schedule is the `ladder` architecture (model=ladder, its "
        "ladder_layers; converter=llama_to_ladder), which keeps Llama's checkpoints as they are."
    )

    def __post_init__(self, **kwargs):
        # `kwargs` are the keywords that are not dataclass fields: the place where an unknown one shows.
        check_fields(type(self), kwargs)
        # Before transformers' own __post_init__, which divides by some of them (head_dim = hidden / heads).
        check_sizes(self)
        super().__post_init__(**kwargs)
        # A config read from another architecture's config.json (an HF Llama, say) keeps that file's
        # model_type as an instance attribute; saved as is, it would reload as the other architecture.
        self.model_type = type(self).model_type
        self.validate()

    def validate(self) -> None:
        """transformers' checks, then the zoo's; subclasses add theirs (calling super first).

        One method for every path a config takes: `__post_init__` runs it, and so do `from_dict`
        (transformers sets `from_pretrained(..., field=value)` overrides AFTER `__post_init__`), the
        models' `__init__` (a field changed by assignment) and `save_pretrained`.
        """
        super().validate()
        check_heads(self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        config_dict = without_fields_of_source(cls, config_dict)
        if not kwargs.get("return_unused_kwargs"):
            # `Config.from_pretrained(dir, field=value)`: transformers sets the overrides it knows and drops
            # the rest without a word. (A model's from_pretrained asks for the unused ones back and hands
            # them to the model's __init__, which refuses them itself.)
            check_fields(cls, [k for k in kwargs if k not in LOADING_KWARGS])
        try:
            out = super().from_dict(config_dict, **kwargs)
        except ValueError as error:
            source_type = config_dict.get("model_type")
            if source_type in (None, cls.model_type) or "has no field" not in str(error):
                raise
            raise ValueError(
                f"This config is model_type={source_type!r}, another architecture's than {cls.__name__}'s "
                f"({cls.model_type!r}); load it with its own class, or convert it (python -m train.convert "
                f"converter=..., models.CONVERTERS). {error}"
            ) from error
        # `config` or `(config, unused_kwargs)`, depending on `return_unused_kwargs`.
        config = out[0] if isinstance(out, tuple) else out
        config.validate()
        return out

    def num_parameters_formula(self) -> int:
        """Parameter count from the shapes alone (the shared harness checks the model against it)."""
        d, h, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        bias = self.attention_bias
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        if bias:
            attn += h * hd + 2 * kv * hd + d
        mlp = 3 * d * self.intermediate_size + (2 * self.intermediate_size + d if self.mlp_bias else 0)
        layer = attn + mlp + 2 * d  # two RMSNorm weights
        embed = self.vocab_size * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return embed + self.num_hidden_layers * layer + d + head
