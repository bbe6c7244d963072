"""Configuration of the dense Llama baseline.

It is transformers' `LlamaConfig` with its own `model_type`, so every Llama field means what it means
in Hugging Face and an HF Llama `config.json` loads into it unchanged. Our own checks run on top of
transformers' (which, in 5.x, do not validate head counts).
"""

from transformers import LlamaConfig


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


class ZooLlamaConfig(LlamaConfig):
    model_type = "zoo_llama"

    def __post_init__(self, **kwargs):
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
        out = super().from_dict(config_dict, **kwargs)
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
