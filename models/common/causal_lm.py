"""Base classes every zoo architecture inherits: weight init, the decoder trunk and the LM head.

An architecture defines its config, its decoder layer (`make_layer`) and, if its residual stream is
not the standard one, `run_layers`. Everything else -- embeddings, positions, masks, KV cache, final
norm, LM head, loss, `generate()` -- is here once, with Hugging Face names so checkpoints load.
"""

import math

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from models.common.attention import make_causal_mask
from models.common.norm import RMSNorm
from models.common.rotary import RotaryEmbedding, rope_inv_freq

# Output projections feed the residual stream; GPT-2 / Megatron scale their init by 1/sqrt(2L) so the
# stream's variance does not grow with depth.
RESIDUAL_OUTPUT_PROJECTIONS = ("o_proj", "down_proj")


class ZooPreTrainedModel(PreTrainedModel):
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _supports_sdpa = True
    _supports_attention_backend = False

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            name = getattr(module, "_zoo_name", "")
            scale = 1 / math.sqrt(2 * self.config.num_hidden_layers) if name in RESIDUAL_OUTPUT_PROJECTIONS else 1
            init.normal_(module.weight, mean=0.0, std=std * scale)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, RotaryEmbedding):
            # Non-persistent buffer: not in checkpoints, so it must be rebuilt after meta-device loading.
            init.copy_(module.inv_freq, rope_inv_freq(module.rope_parameters, module.head_dim))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """HF `from_pretrained`, but a checkpoint whose shapes do not fit the config is one clear error."""
        if kwargs.get("ignore_mismatched_sizes"):
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *args, ignore_mismatched_sizes=True, output_loading_info=True, **kwargs
        )
        if info["mismatched_keys"]:
            key, ckpt_shape, model_shape = sorted(info["mismatched_keys"])[0]
            raise ValueError(
                f"Checkpoint {pretrained_model_name_or_path} does not fit {cls.__name__}'s config: {key} has shape "
                f"{tuple(ckpt_shape)} in the checkpoint but {tuple(model_shape)} from the config "
                f"({len(info['mismatched_keys'])} tensors differ); load it with the checkpoint's own config.json."
            )
        return (model, info) if want_info else model

    def post_init(self):
        # Remember each linear's attribute name so `_init_weights` can find residual output projections.
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                module._zoo_name = name.rsplit(".", 1)[-1]
        super().post_init()


class ZooDecoderModel(ZooPreTrainedModel):
    """Embedding -> decoder layers -> final RMSNorm. Subclasses give `make_layer`, maybe `run_layers`."""

    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([self.make_layer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope_parameters, config.head_dim)
        self.post_init()

    def make_layer(self, config, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache) -> torch.Tensor:
        """The standard pre-norm residual stream: one layer after another."""
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask, cache)
        return hidden_states

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past_len = cache.get_seq_length() if cache is not None else 0
        q_len = inputs_embeds.shape[1]
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + q_len, device=inputs_embeds.device)[None]
        mask = make_causal_mask(attention_mask, q_len, past_len, inputs_embeds.device)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = self.run_layers(inputs_embeds, position_embeddings, mask, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)


class ZooForCausalLM(ZooPreTrainedModel, GenerationMixin):
    """Decoder trunk (`self.model`, of class `base_model_class`) plus the LM head and the loss."""

    base_model_class: type[ZooDecoderModel]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden_states = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden_states = hidden_states[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden_states = hidden_states[:, logits_to_keep]
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)
