"""Base classes every zoo architecture inherits: the decoder trunk and the LM head, on `ZooPreTrainedModel`
(models/common/pretrained.py: weight init, checkpoint loading).

An architecture defines its config, its decoder layer (`make_layer`) and, if its residual stream is
not the standard one, `run_layers`. Everything else -- embeddings, positions, masks, KV cache, final
norm, LM head, loss, `generate()` -- is here once, with Hugging Face names so checkpoints load.

Hooks of the trunk (`ZooDecoderModel`), each with the standard (Llama) behaviour as its default:

- `make_layer(config, layer_idx)`: decoder layer `layer_idx` (no default).
- `run_layers(hidden_states, position_embeddings, attention_mask, cache)`: the residual stream; returns
  the hidden states, or `(hidden_states, aux_losses)` with `aux_losses` a dict of named scalar losses,
  already weighted, which the LM head adds to the loss (`ZooCausalLMOutput.aux_losses`).
- `make_rotary(config)`: the rotary embedding (any dimension), or None for a model without RoPE, whose
  layers then get `position_embeddings=None`.
- `make_cache(batch_size=None, max_cache_len=None)`: the cache of a forward with `use_cache` and no
  cache, and of `generate()`; any transformers `Cache` subclass (recurrent states, latent KV, ...).
- `sequence_offset(q_len)`: how many tokens of each sequence precede this forward's chunk (0 on one
  device; a sequence-parallel layout returns its rank's start). `forward(..., seq_offset=n)` overrides it.
"""

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from models.common.attention import make_causal_mask
from models.common.cache import (
    StaticKVCache,
    cache_capacity,
    cache_start,
    check_capacity,
    is_static,
    make_static_causal_mask,
)
from models.common.decoder import SPLITS, run_sequence_sharded, run_split, runs_sequence_sharded, runs_split
from models.common.norm import RMSNorm
from models.common.pretrained import ZooPreTrainedModel
from models.common.rotary import RotaryEmbedding
from models.common.values import has_values


def check_generate_mask(inputs, kwargs: dict) -> None:
    """One clear error, naming both lengths, when `generate()`'s `attention_mask` is not one entry per prompt
    token ([batch, prompt length], as forward() asks of its mask). The prompt is `inputs` (or `input_ids=`),
    which holds every token of the sequence, cached ones included; or `inputs_embeds=` when no ids and no
    cache are given."""
    mask = kwargs.get("attention_mask")
    prompt, name = inputs, "input_ids"
    if prompt is None:
        prompt = kwargs.get("input_ids")
    if prompt is None and kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
        prompt, name = kwargs.get("inputs_embeds"), "inputs_embeds"
    if not isinstance(mask, torch.Tensor) or not isinstance(prompt, torch.Tensor) or prompt.dim() < 2:
        return
    batch, length = prompt.shape[:2]
    if tuple(mask.shape) != (batch, length):
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)} but {name} has shape {tuple(prompt.shape)}: generate() "
            f"needs one mask entry per prompt token, shape ({batch}, {length}) (1 for a token to attend to, 0 for "
            "padding), as forward() does."
        )


def forward_is_compiled(model: nn.Module) -> bool:
    """Whether `model`'s calls run compiled: HF's recipe (`model.forward = torch.compile(model.forward)`) or
    `model.compile()`."""
    forward = model.__dict__.get("forward")
    return getattr(forward, "_torchdynamo_orig_callable", None) is not None or (
        getattr(model, "_compiled_call_impl", None) is not None
    )


@dataclass
class ZooModelOutput(BaseModelOutputWithPast):
    """The trunk's output, with the auxiliary losses its `run_layers` returned ({} if none)."""

    aux_losses: dict[str, torch.Tensor] | None = None


@dataclass
class ZooCausalLMOutput(CausalLMOutputWithPast):
    """`loss` = `lm_loss` + sum of `aux_losses` (when labels are given); the parts are kept apart so that a
    trainer can log them separately. `aux_losses` is {} for architectures without any."""

    lm_loss: torch.FloatTensor | None = None
    aux_losses: dict[str, torch.Tensor] | None = None


class ZooDecoderModel(ZooPreTrainedModel):
    """Embedding -> decoder layers -> final RMSNorm. Subclasses give `make_layer`, maybe the other hooks
    (module docstring)."""

    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([self.make_layer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = self.make_rotary(config)  # None: no RoPE anywhere in the model
        # The system-level overlap schedule (parallel/overlap.py), set by parallel.set_overlap: under
        # "token_split" / "seq_split" `run_layers` runs the layers over the forward's two halves
        # (models.common.decoder.run_split), under "collective_matmul" on the sequence's chunks
        # (models.common.decoder.run_sequence_sharded).
        self.overlap = "none"
        self.post_init()

    @property
    def runs_layers_whole(self) -> bool:
        """Whether `run_layers` calls each layer as a module (`layer(...)`), so that hooks on the layer (an FSDP
        unit, a compiled forward) see all of its work. False where it calls the layers' sub-blocks itself: under a
        splitting overlap schedule (each layer's `split_layer`), and in the trunks that wait elsewhere."""
        return self.overlap not in SPLITS

    def make_layer(self, config, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def make_rotary(self, config) -> RotaryEmbedding | None:
        """RoPE over each head's full `head_dim` (Llama). Return a RotaryEmbedding of another dimension
        (e.g. only a decoupled key's d_r dims), or None when no layer uses rotary embeddings."""
        return RotaryEmbedding(config.rope_parameters, config.head_dim)

    def make_cache(
        self, batch_size: int | None = None, max_cache_len: int | None = None, static: bool = False
    ) -> Cache:
        """A fresh, empty cache for this model (the one hook where caches are made: `forward` with
        `use_cache` and no cache, `generate()`, the bench and the speed simulator).

        `batch_size` and `max_cache_len` (rows, and the most tokens it will hold; None = unknown) are for
        caches that allocate up front; the default, one growing `DynamicLayer` per model layer, needs
        neither. `static=True`: the cache of a compiled decode step (models.common.cache): fixed buffers of
        `max_cache_len` tokens written in place, the fill level on the device; `generate(...,
        cache_implementation="static")` asks for it. Override to return any `Cache` subclass (both forms): a
        recurrent state per layer, a latent KV cache, several cache layers per model layer, ... Under tensor
        parallelism it is made after sharding, so it holds this rank's share (e.g. its KV heads).
        """
        if static:
            return StaticKVCache(self.config.num_hidden_layers, self.static_capacity(max_cache_len), self.device)
        return DynamicCache(config=self.config)

    def static_capacity(self, max_cache_len) -> int:
        """`max_cache_len` checked for a static cache (a positive int), with the once-per-model warning when it
        reaches past max_position_embeddings (a static cache's forward never reads its fill level on the host)."""
        check_capacity(max_cache_len)
        limit = self.config.max_position_embeddings
        if max_cache_len > limit and not getattr(self, "_warned_long_input", False):
            self._warned_long_input = True
            warnings.warn(
                f"A static cache of {max_cache_len} tokens reaches beyond max_position_embeddings={limit}; "
                f"outputs past position {limit} are extrapolated (warned once per model).",
                stacklevel=3,
            )
        return max_cache_len

    def sequence_offset(self, q_len: int) -> int:
        """How many tokens of each sequence come before this forward's `q_len` (not counting the cache).

        0 on one device. Under sequence parallelism rank r of P holds tokens [r*N/P, (r+1)*N/P) of each
        sequence, so its layout returns r * q_len: the trunk then starts positions at past_len + that and
        shifts the causal mask's diagonal to match (see `forward`).
        """
        return 0

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        """The standard pre-norm residual stream: one layer after another.

        Returns the hidden states; an architecture with auxiliary losses (a router's load balance, ...)
        returns `(hidden_states, {name: scalar loss})`, each loss already weighted: the LM head adds them
        to the loss as they are.
        """
        if runs_split(self.overlap, hidden_states):
            return run_split(self.layers, self.overlap, hidden_states, position_embeddings, attention_mask, cache)
        if runs_sequence_sharded(self.overlap, hidden_states):
            return run_sequence_sharded(self.layers, hidden_states, position_embeddings, attention_mask, cache)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask, cache)
        return hidden_states

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _check_inputs(self, input_ids, inputs_embeds, past_len: int | None, seq_offset: int = 0) -> None:
        """One clear error for inputs that would fail deep inside the forward, or silently misbehave.

        Shape checks are free. The token-id range needs the ids' values, which on CUDA means a sync:
        it runs on prefill and training steps but not on single-token decode steps (those ids come
        from the model's own output) nor under torch.compile (it would break the graph). `past_len` None:
        a static cache, whose fill level is on the device (every single-token forward counts as decode, and
        the position warning is `make_cache`'s, from the cache's length).
        """
        name, x, dims = ("input_ids", input_ids, 2) if input_ids is not None else ("inputs_embeds", inputs_embeds, 3)
        if x.dim() != dims:
            want = "[batch, seq_len]" if dims == 2 else "[batch, seq_len, hidden_size]"
            raise ValueError(f"{name} has shape {tuple(x.shape)}; it must be {want} (x[None] adds a batch dimension).")
        batch, q_len = x.shape[:2]
        if batch == 0 or q_len == 0:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}, an empty batch or sequence; pass at least one sequence "
                "of at least one token."
            )
        compiling = torch.compiler.is_compiling()
        # Skipped where it cannot read values: under compile, and on the meta device (the speed simulator
        # runs the real forward without values); and for single-token decode (a host sync per token).
        if input_ids is not None and not compiling and has_values(input_ids) and not (past_len != 0 and q_len == 1):
            lowest, highest = torch.aminmax(input_ids)
            lowest, highest, vocab = int(lowest), int(highest), self.config.vocab_size
            if highest >= vocab:
                raise ValueError(
                    f"input_ids holds token id {highest}, but vocab_size={vocab} allows ids 0..{vocab - 1}; "
                    f"encode with the model's own tokenizer, or use a model with vocab_size >= {highest + 1}."
                )
            if lowest < 0:
                raise ValueError(
                    f"input_ids holds token id {lowest}, but ids must be in 0..{vocab - 1} (vocab_size={vocab}); "
                    "a negative id is usually padding or a label's ignore index (-100): pass the pad token's id."
                )
        # RoPE extrapolates past max_position_embeddings without failing, but the model was not trained
        # there: say so once per model, not on every decode step.
        if past_len is None:
            return
        total = past_len + seq_offset + q_len
        limit = self.config.max_position_embeddings
        if total > limit and not compiling and not getattr(self, "_warned_long_input", False):
            self._warned_long_input = True
            before = f"{past_len} cached + {seq_offset} preceding" if seq_offset else f"{past_len} cached"
            warnings.warn(
                f"The input reaches position {total} ({before} + {q_len} new tokens), beyond "
                f"max_position_embeddings={limit}; outputs past position {limit} are extrapolated. Keep "
                f"inputs within {limit} tokens (warned once per model).",
                stacklevel=3,
            )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        seq_offset: int | None = None,
        **kwargs,
    ) -> ZooModelOutput:
        """`seq_offset`: tokens of each sequence before this chunk that are not in the cache (default:
        `sequence_offset(q_len)`, 0 on one device). Positions start at past_len + seq_offset, and the mask
        covers past_len + seq_offset + q_len keys with the diagonal shifted to match (`make_causal_mask`):
        the chunk attends at its global positions. Bringing in the K/V (or states) of the preceding tokens
        -- all-gathered over the sequence-parallel group, say -- is the architecture's business; the
        trunk only offsets positions and the mask. Explicit `position_ids` are used as given.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        static = is_static(cache)
        # A static cache's fill level is a device tensor (models.common.cache); a growing cache's, an int.
        past_len = None if static else (cache.get_seq_length() if cache is not None else 0)
        x = input_ids if input_ids is not None else inputs_embeds
        if seq_offset is None:  # (a malformed x is refused just below, by _check_inputs)
            seq_offset = self.sequence_offset(x.shape[1] if x.dim() > 1 else 0)
        if isinstance(seq_offset, bool) or not isinstance(seq_offset, int) or seq_offset < 0:
            raise ValueError(
                f"seq_offset={seq_offset!r} must be a non-negative int: the number of tokens of each sequence "
                "before this chunk (under sequence parallelism, rank r of P holding tokens [r*N/P, (r+1)*N/P): r*N/P)."
            )
        if static and seq_offset:
            raise ValueError(
                f"seq_offset={seq_offset}: a static cache holds whole sequences from position 0; a chunk of a "
                "sequence-parallel forward runs without a cache."
            )
        self._check_inputs(input_ids, inputs_embeds, past_len, seq_offset)
        batch, q_len = x.shape[:2]
        if use_cache and cache is None:
            cache = self.make_cache(batch_size=batch)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        device = inputs_embeds.device
        if static:
            # Positions and mask from the device-side fill level: the same graph for every decode step.
            start = cache_start(cache, device)
            if position_ids is None:
                position_ids = (start + torch.arange(q_len, device=device))[None]
            capacity = cache_capacity(cache)
            if capacity is None:  # recurrent states only: the mask says which of this chunk's tokens are padding
                chunk = None if attention_mask is None else attention_mask[:, -q_len:]
                mask = make_static_causal_mask(chunk, start.new_zeros(()), q_len, q_len, device, batch)
            else:
                mask = make_static_causal_mask(attention_mask, start, q_len, capacity, device, batch)
        else:
            if position_ids is None:
                start = past_len + seq_offset
                position_ids = torch.arange(start, start + q_len, device=device)[None]
            mask = make_causal_mask(attention_mask, q_len, past_len, device, batch_size=batch, q_offset=seq_offset)
        position_embeddings = None if self.rotary_emb is None else self.rotary_emb(inputs_embeds, position_ids)
        out = self.run_layers(inputs_embeds, position_embeddings, mask, cache)
        hidden_states, aux_losses = out if isinstance(out, tuple) else (out, {})
        return ZooModelOutput(last_hidden_state=self.norm(hidden_states), cache=cache, aux_losses=aux_losses)


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
        seq_offset: int | None = None,
        **kwargs,
    ) -> ZooCausalLMOutput:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            seq_offset=seq_offset,
        )
        hidden_states = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden_states = hidden_states[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden_states = hidden_states[:, logits_to_keep]
        logits = self.lm_head(hidden_states)
        loss = lm_loss = None
        aux_losses = outputs.aux_losses
        if labels is not None:
            lm_loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            loss = lm_loss + sum(aux_losses.values()) if aux_losses else lm_loss
        return ZooCausalLMOutput(loss=loss, logits=logits, cache=outputs.cache, lm_loss=lm_loss, aux_losses=aux_losses)

    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        """transformers' `generate()`, after one clear error for an `attention_mask` that does not fit the
        prompt (`check_generate_mask`), before any work: generate slices the mask per step, so a longer one
        would otherwise generate without a word and a shorter one fail deep in the rotary embedding."""
        check_generate_mask(inputs, kwargs)
        check = getattr(self, "check_compiled_generate", None)  # the MoE family's (models/common/moe.py)
        if check is not None and forward_is_compiled(self):
            check()
        return super().generate(inputs, *args, **kwargs)

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask=None, **kwargs):
        """generate() on a static cache turns the 2-D padding mask into transformers' 4-D mask before each
        forward; the trunk builds its own from the 2-D one (and the cache's device-side fill level), so it is
        passed on as it is."""
        return attention_mask

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
    ) -> None:
        """`generate()`'s cache: the trunk's `make_cache`, where transformers would build its default
        `DynamicCache(config=...)` or its `StaticCache(config=...)` (neither has a place for an architecture's
        own cache: Kraken's per-stream layers, GQLA's latent, linear attention's states).
        `cache_implementation="static"` gives `make_cache(..., static=True)` of generate's max length.

        A cache passed by the caller, `use_cache=False` and the other `cache_implementation`s ("offloaded",
        "quantized", ...) keep transformers' handling (transformers 5.x GenerationMixin).
        """
        implementation = generation_config.cache_implementation
        own = (
            model_kwargs.get("cache") is None
            and generation_config.use_cache is not False
            and implementation in (None, "dynamic", "static")
        )
        if not own:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        # Beams and returned sequences each take a row, as in transformers' own sizing of static caches.
        rows = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1) * batch_size
        if implementation == "static" and generation_config.max_cache_len is not None:
            max_cache_length = max(max_cache_length, generation_config.max_cache_len)
        # `static` only when asked: an override of the hook written before it had the keyword still serves.
        static = {"static": True} if implementation == "static" else {}
        cache = self.model.make_cache(batch_size=rows, max_cache_len=max_cache_length, **static)
        if generation_config.is_assistant:  # assisted decoding rolls the assistant's cache back
            cache.activate_past_recording()
        model_kwargs["cache"] = cache
