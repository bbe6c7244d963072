"""Configuration of Linear-Llama (`linear`): a Llama config plus the linear-attention fields.

- `layer_pattern`: which sequence mixer each layer has, one letter per layer, the string repeated a whole
  number of times over the layers (its length divides num_hidden_layers; write a pattern out in full otherwise): `L` = linear attention (models/linear/modeling.py), `N` = normal softmax attention (the
  shared Attention, with RoPE and a KV cache). "L" (default) is a pure linear model; "LLLN" is the LASP-2
  paper's hybrid, one softmax layer in four. `num_key_value_heads` applies to the N layers only; a linear
  layer has `num_attention_heads` heads of `head_dim` for q, k and v alike.
- `decay`: the per-head decay lambda_h of the linear layers' state (`none` | `lightning` | `retnet` |
  `learned`); see `modeling.fixed_log_decay` for the values and their papers.
- `chunk_size`: tokens per chunk of the chunked kernel on CPU (models/linear/ops.py); any sequence
  length works, a multiple of it or not.
- `sp_method` (`lasp2` | `lasp1`): the algorithms under sequence parallelism (parallel/sequence.py):
  `lasp2` = LASP-2 for the linear layers (one all-gather of d_k x d_v states) and LASP-2H for the softmax
  layers (all-gather of K and V); `lasp1` = the baselines, LASP-1 (a ring of states) and ring attention.
  On one device it changes nothing.
- `residual` (`standard` | `ladder`) with `ladder_layers`: the residual schedule (models/common/residual.py).
  Under TP (sharding.py) "ladder" waits each laddered sub-block's all-reduce one sub-block later; under SP a
  layer's collectives sit inside its mixer (the mixing needs them), so the schedule defers none there.
"""

from models.common.residual import check_residual
from models.llama.configuration import ZooLlamaConfig
from parallel.sequence import SP_METHODS

LAYER_KINDS = {"L": "linear attention", "N": "softmax attention"}
DECAYS = ("none", "lightning", "retnet", "learned")


class ZooLinearConfig(ZooLlamaConfig):
    model_type = "zoo_linear"

    layer_pattern: str = "L"
    decay: str = "none"
    chunk_size: int = 64
    sp_method: str = "lasp2"
    residual: str = "standard"
    ladder_layers: int | list[int] | None = None

    def validate(self) -> None:
        # Runs at construction and again after from_pretrained's keyword overrides (see ZooLlamaConfig).
        super().validate()
        self.ladder_layers = check_residual(self.residual, self.ladder_layers, self.num_hidden_layers)
        pattern, layers = self.layer_pattern, self.num_hidden_layers
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(LAYER_KINDS):
            bad = sorted(set(pattern) - set(LAYER_KINDS)) if isinstance(pattern, str) else []
            letters = f" (letters {bad} are neither)" if bad else ""
            raise ValueError(
                f"layer_pattern={pattern!r} must be a non-empty string of the letters L (linear attention) and "
                f"N (normal softmax attention){letters}, repeated over the layers: e.g. 'L' or 'LLLN'."
            )
        if len(pattern) > layers:
            raise ValueError(
                f"layer_pattern={pattern!r} has {len(pattern)} letters but the model has num_hidden_layers={layers}; "
                f"the pattern is repeated over the layers, so use at most {layers} letters."
            )
        if layers % len(pattern):
            # A pattern cut off at the last layer is most likely not what was meant ('LLN' over 4 layers would
            # be L L N L): write every layer out, or repeat a pattern whole.
            repeated = (pattern * layers)[:layers]
            fits = [n for n in range(1, layers + 1) if layers % n == 0]
            raise ValueError(
                f"layer_pattern={pattern!r} ({len(pattern)} letters) does not repeat a whole number of times over "
                f"num_hidden_layers={layers}: it would give {repeated!r}; write that out as the pattern if it is what "
                f"you mean, or use a pattern of {fits} letters."
            )
        if self.decay not in DECAYS:
            raise ValueError(f"decay={self.decay!r} is not a linear-attention decay; use one of {DECAYS}.")
        size = self.chunk_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"chunk_size={size!r} must be a positive integer (tokens per chunk of the kernel)."
            )
        if self.sp_method not in SP_METHODS:
            raise ValueError(
                f"sp_method={self.sp_method!r} is not a sequence-parallel method of this model; use one of "
                f"{tuple(SP_METHODS)} (LASP-2 and LASP-2H, or the baselines LASP-1 and ring attention)."
            )

    def is_linear_layer(self, layer_idx: int) -> bool:
        return self.layer_pattern[layer_idx % len(self.layer_pattern)] == "L"

    @property
    def num_linear_layers(self) -> int:
        return sum(self.is_linear_layer(i) for i in range(self.num_hidden_layers))

    def num_parameters_formula(self) -> int:
        """Parameter count from the shapes alone (the shared harness checks the model against it).

        A linear layer has q, k, v, the output gate g (d x H*h_d each) and o (H*h_d x d), the per-head
        output norm (h_d) and, for a learned decay, one value per head; it replaces a softmax layer's
        q, k, v, o with KV heads.
        """
        d, h, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        softmax = d * h * hd + 2 * d * kv * hd + h * hd * d
        linear = 5 * d * h * hd + hd + (h if self.decay == "learned" else 0)
        if self.attention_bias:
            softmax += h * hd + 2 * kv * hd + d
            linear += 4 * h * hd + d
        return super().num_parameters_formula() + self.num_linear_layers * (linear - softmax)
