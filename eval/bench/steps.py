"""The two programs of a generation, as the Ladder paper's gpt-fast benchmark writes them: `prefill` (the
prompt into a static cache, the first token) and `decode_step` (one token in, the next one out). The
greedy sampler is part of each step, so a compiled step is the whole step: nothing runs between two
steps but the next launch.

    cache = model.model.make_cache(batch_size=B, max_cache_len=N, static=True)   # models.common.cache
    prefill_fn, step_fn, graphs = compile_steps(mode="reduce-overhead")          # or (prefill, decode_step)
    token, logits = prefill_fn(model, ids, cache)
    for _ in range(new_tokens - 1):
        token, logits = step_fn(model, token, cache)

`compile_steps` is gpt-fast's recipe: the decode step with `fullgraph=True` (and `mode="reduce-overhead"`,
CUDA graphs, on CUDA), the prefill with `fullgraph=True, dynamic=False`. With a static cache every decode
step has the same shapes and reads its position on the device, so one graph serves them all; in real comm
mode under compile `parallel.comm` issues functional collectives, waited where each forward() waits them;
they are not counted at run time, so `CountingBackend` reads them off each compiled graph.
"""

import torch

from parallel import comm

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


class CountingBackend:
    """A torch.compile backend that reads each graph's collectives (`parallel.comm.graph_collectives`: a
    compiled graph's are not counted at run time), then compiles it with `backend` ("inductor", with
    `mode="reduce-overhead"` its CUDA graphs; or any registered backend name, e.g. "aot_eager").
    `graphs`: one {kind: {"calls", "bytes"}} per graph compiled (1 when every call reused the first)."""

    def __init__(self, backend: str = "inductor", mode: str | None = None):
        self.backend, self.mode = backend, mode
        self.graphs: list[dict] = []
        self.kernels: list[int] = []  # inductor only: kernels each graph launches (generated + extern calls)

    def __call__(self, gm, example_inputs):
        self.graphs.append(comm.graph_collectives(gm))
        if self.backend != "inductor":
            return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)
        from torch._dynamo.utils import counters
        from torch._inductor import metrics
        from torch._inductor.compile_fx import compile_fx

        before = metrics.generated_kernel_count + counters["inductor"]["extern_calls"]
        # torch.compile(mode="reduce-overhead") is inductor with these options. No cache of compiled graphs:
        # a cached graph is not generated again, and its kernels would not be counted.
        patches = dict(torch._inductor.list_mode_options(self.mode) if self.mode else {}, fx_graph_cache=False)
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
        self.kernels.append(metrics.generated_kernel_count + counters["inductor"]["extern_calls"] - before)
        return compiled


def compile_steps(mode: str | None = None, backend: str = "inductor"):
    """(prefill, decode_step, {"prefill": CountingBackend, "decode": CountingBackend}): both steps compiled
    with `fullgraph=True` (a graph break is an error, not a slowdown) and `dynamic=False`, the decode step
    under `mode` ("reduce-overhead": CUDA graphs; None on CPU, where there are none). Inductor's
    compute/communication reordering is switched on."""
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        for name, value in INDUCTOR_OVERLAP.items():
            setattr(inductor_config, name, value)
    # One graph per (architecture, comm mode, batch) in a bench process: more than dynamo's default 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    backends = {"prefill": CountingBackend(backend), "decode": CountingBackend(backend, mode)}
    return (
        torch.compile(prefill, fullgraph=True, dynamic=False, backend=backends["prefill"]),
        torch.compile(decode_step, fullgraph=True, dynamic=False, backend=backends["decode"]),
        backends,
    )
