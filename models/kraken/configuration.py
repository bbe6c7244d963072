"""Configuration of Kraken (Prabhakar et al., NeurIPS 2024): a Llama config plus `kraken_degree`.

Kraken runs `kraken_degree` (k) independent streams side by side in every layer, each a Llama decoder
block of its own. The Llama fields describe ONE stream:

- `hidden_size` is the stream width d' (the embedding, the final norm and the LM head are d' wide too);
- `num_attention_heads`, `num_key_value_heads`, `head_dim` and `intermediate_size` are per stream (the
  paper gives each stream n_head / k heads of a baseline with n_head heads);
- `num_hidden_layers` (L) counts layers, each holding k streams.

The conjunction `W_conj . concat_i(s_i) + b` maps the k streams (k * d') back to d' after the last layer.
`conjunction_init` says how W_conj starts (b starts at 0 in every case; modeling.py applies it):

- "random" (default): every entry N(0, initializer_range^2), as every other linear layer. This is what the
  authors' training code does (rohan-bp/kraken, training/model.py: nanoGPT's `_init_weights` gives every
  nn.Linear, the conjunction included, N(0, 0.02^2) and a zero bias; only the `c_proj` output projections
  get the residual scaling). At init the model's output is LN_f of a random projection of the streams.
- "mean": W_conj = (1/k) [I I ... I], so that at init y = LN_f(mean_i s_i), the average of the streams;
  at k = 1 the conjunction is the identity and the model is exactly a Llama (plus a trainable d' x d' layer).
- "identity": W_conj = [I I ... I], so that at init y = LN_f(sum_i s_i), the sum S that every layer's MLP
  reads (at k = 1 the identity). Under RMSNorm it computes "mean"'s function at init (LN_f(k x) = LN_f(x) up to
  the norm's eps); it differs in the size of W_conj's entries (1 against 1/k), which Adam's per-entry steps
  and weight decay see differently.

Measured (`python -m eval.replicate`, reports/quality-seeds: the tiny config, 3 seeds x 400 steps of
16 x 128 tokens, final validation loss, per-seed paired differences): kraken - llama +0.199 +- 0.031 nats; "mean"
- "random" +0.121 +- 0.060 (worse at every seed); "identity" - "random" +0.010 +- 0.011 (within the seed
noise). Neither closes the gap, so "random", the authors' initialisation, stays the default.

A checkpoint keeps its trained W_conj: `conjunction_init` acts at initialisation only.

Parameter matching (comparison with `llama` at equal size): `match_llama_parameters(llama, k)` picks the
d' whose Kraken has the parameter count closest to `llama`'s. Each stream gets llama's heads / k query
heads and KV heads / k KV heads (at least 1 each), an MLP half as wide relative to d' as llama's (the
paper's streams use ffn_expansion 2 against GPT-2's 4), and everything else (vocabulary, L, tied
embeddings, biases, rotary) unchanged; d' runs over multiples of 2 * (heads per stream), so head_dim is
even for rotary. `ZooKrakenConfig.from_llama(llama, k)` builds that config.

- `conf/model/llama.yaml` with the bundled tokenizer (8192 tokens; d=128, L=4, 4 heads, 2 KV heads, MLP
  352): 1,787,008 parameters. k=2: d'=116 (2 heads of 58, 1 KV head, MLP 160), 1,747,656 (-2.2%; the
  next width, 120, is further off). `conf/model/kraken.yaml` is that config.
- GPT-2-shaped Llamas (vocabulary 50304, tied; 125M: d=768, L=12, 12 heads, MLP 2048; 350M: d=1024,
  L=24, 16 heads) match at 125M k=2/4/6: d'=684/504/420 and 350M k=2/4: d'=896/648, each within one
  width step of the paper's 678/504/418 and 888/644 (GPT-2 also has learned positions and biases).
"""

from models.llama.configuration import ZooLlamaConfig

# Llama fields that describe one stream: `from_llama` derives them instead of copying them.
_PER_STREAM = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
_NOT_COPIED = ("model_type", "architectures", "transformers_version")
# A Kraken stream's MLP is half as wide, relative to its width, as the baseline's: the paper's streams use
# ffn_expansion 2 against GPT-2's 4, which is what makes its matched widths (678 at k=2, ...) come out.
FFN_SCALE = 0.5
# How the conjunction W_conj starts (see the module docstring).
CONJUNCTION_INITS = ("random", "mean", "identity")


class ZooKrakenConfig(ZooLlamaConfig):
    model_type = "zoo_kraken"
    # intermediate_size is one stream's MLP width here: validate() says so in its own error.
    size_fields = tuple(f for f in ZooLlamaConfig.size_fields if f != "intermediate_size")

    residual_refusal = (
        "Kraken has no sub-block collective left to defer: under TP each rank runs whole streams, so attention and "
        "MLP need no all-reduce, and its one all-reduce per layer (the sum of the streams) is already issued before "
        "the attention and waited at the MLP input, the ladder's idea built into the layer."
    )

    kraken_degree: int = 2
    conjunction_init: str = "random"

    def validate(self) -> None:
        # Runs at construction and again after from_pretrained's keyword overrides (see ZooLlamaConfig).
        super().validate()
        k = self.kraken_degree
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"kraken_degree={k!r} must be a positive integer: the number of streams per layer, which is "
                "also the TP degree the model runs at (1 = a plain Llama with a conjunction)."
            )
        if self.conjunction_init not in CONJUNCTION_INITS:
            raise ValueError(
                f"conjunction_init={self.conjunction_init!r} must be one of {', '.join(CONJUNCTION_INITS)}: how the "
                "conjunction W_conj starts (random: N(0, initializer_range^2), the authors' code; mean: the average "
                "of the streams; identity: their sum)."
            )
        if self.head_dim <= 0:
            raise ValueError(
                f"head_dim={self.head_dim} (per stream) must be positive; with hidden_size={self.hidden_size} "
                f"use at most {self.hidden_size} attention heads per stream or set head_dim."
            )
        if self.intermediate_size <= 0:
            raise ValueError(f"intermediate_size={self.intermediate_size} (the MLP width of one stream) must be positive.")

    def num_parameters_formula(self) -> int:
        """Parameter count from the shapes alone (the shared harness checks the model against it)."""
        d, k = self.hidden_size, self.kraken_degree
        # Llama's count is one stream per layer plus the embedding, the final norm and the (untied) head.
        llama = super().num_parameters_formula()
        one_stream = llama - self.vocab_size * d * (1 if self.tie_word_embeddings else 2) - d
        conjunction = k * d * d + d  # W_conj and its bias
        return llama + (k - 1) * one_stream + conjunction

    @classmethod
    def from_llama(cls, llama_config: ZooLlamaConfig, kraken_degree: int, hidden_size: int | None = None, **kwargs):
        """The Kraken matching `llama_config` (see the module docstring), of stream width `hidden_size`
        (default: `match_llama_parameters(llama_config, kraken_degree)`)."""
        fields = {k: v for k, v in llama_config.to_dict().items() if k not in (*_PER_STREAM, *_NOT_COPIED)}
        heads = max(1, llama_config.num_attention_heads // kraken_degree)
        width = hidden_size or match_llama_parameters(llama_config, kraken_degree)
        return cls(
            **{
                **fields,
                "kraken_degree": kraken_degree,
                "hidden_size": width,
                "num_attention_heads": heads,
                "num_key_value_heads": max(1, llama_config.num_key_value_heads // kraken_degree),
                "head_dim": width // heads,
                "intermediate_size": round(width * FFN_SCALE * llama_config.intermediate_size / llama_config.hidden_size),
                **kwargs,
            }
        )


def match_llama_parameters(llama_config: ZooLlamaConfig, kraken_degree: int) -> int:
    """The stream width d' whose Kraken (`ZooKrakenConfig.from_llama`) has the parameter count closest to
    `llama_config`'s: d' a multiple of 2 * (heads per stream); the smaller d' on a tie."""
    if isinstance(kraken_degree, bool) or not isinstance(kraken_degree, int) or kraken_degree < 1:
        raise ValueError(f"kraken_degree={kraken_degree!r} must be a positive integer.")
    target = llama_config.num_parameters_formula()
    step = 2 * max(1, llama_config.num_attention_heads // kraken_degree)

    def count(width: int) -> int:
        return ZooKrakenConfig.from_llama(llama_config, kraken_degree, hidden_size=width).num_parameters_formula()

    # The count grows with d': walk up to the first width at or above the target, then take the closer
    # of it and the width below.
    width = step
    while count(width) < target:
        width += step
    candidates = [w for w in (width - step, width) if w > 0]
    return min(candidates, key=lambda w: (abs(count(w) - target), w))
