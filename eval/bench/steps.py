"""The two programs of a generation, as the Ladder paper's gpt-fast benchmark writes them: `prefill` (the
prompt into a static cache, the first token) and `decode_step` (one token in, the next one out). The
greedy sampler is part of each step, so a compiled step is the whole step: nothing runs between two
steps but the next launch.

    cache = model.model.make_cache(batch_size=B, max_cache_len=N, static=True)   # models.common.cache
    prefill_fn, step_fn = compile_steps(mode="reduce-overhead")                  # or (prefill, decode_step)
    token, logits = prefill_fn(model, ids, cache)
    for _ in range(new_tokens - 1):
        token, logits = step_fn(model, token, cache)

`compile_steps` is gpt-fast's recipe: the decode step with `fullgraph=True` (and `mode="reduce-overhead"`,
CUDA graphs, on CUDA), the prefill with `fullgraph=True, dynamic=False`. With a static cache every decode
step has the same shapes and reads its position on the device, so one graph serves them all; in real comm
mode under compile `parallel.comm` issues functional collectives, waited where each forward() waits them.
"""

import torch

# What compile_steps sets for inductor when it compiles (the reference's): the scheduler may move compute
# between a collective's issue and its wait.
INDUCTOR_OVERLAP = {"reorder_for_compute_comm_overlap": True}


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt `ids` [B, T] into `cache`; the greedy first token [B, 1] and its logits [B, V]."""
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    return logits.argmax(-1, keepdim=True), logits


@torch.no_grad()
def decode_step(model, token: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: `token` [B, 1] in (appended to `cache`), the greedy next token [B, 1] and its logits out."""
    logits = model(token, cache=cache, use_cache=True).logits[:, -1]
    return logits.argmax(-1, keepdim=True), logits


def compile_steps(mode: str | None = None, backend="inductor"):
    """(prefill, decode_step) compiled: both `fullgraph=True` (a graph break is an error, not a slowdown),
    prefill `dynamic=False`, the decode step under `mode` ("reduce-overhead": CUDA graphs; None on CPU,
    where CUDA graphs do not exist). Inductor's compute/communication reordering is switched on."""
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        for name, value in INDUCTOR_OVERLAP.items():
            setattr(inductor_config, name, value)
    options = {"backend": backend, "fullgraph": True}
    step_options = dict(options, mode=mode) if mode is not None else options
    return (
        torch.compile(prefill, dynamic=False, **options),
        torch.compile(decode_step, dynamic=False, **step_options),
    )
