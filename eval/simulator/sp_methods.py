"""The four sequence-parallel algorithms of parallel/sequence.py as the linear model builds them (a layer pattern
and an `sp_method`), and their configs at a bench shape: read by the bench's sequence-parallel section
(eval/bench/sp.py) and by the LASP-2 held-out row (eval/simulator/heldout/lasp2.py)."""

import models

# The four sequence-parallel algorithms of parallel/sequence.py, each as Linear-Llama builds it: the layer
# pattern (one letter repeated over the shape's layers: L linear, N softmax) and the config's sp_method.
SP_ALGORITHMS = {
    "lasp2": {"pattern": "L", "sp_method": "lasp2", "label": "LASP-2",
              "what": "linear layer, one all-gather of the d_k x d_v states, in flight during the intra-chunk compute"},
    "lasp1": {"pattern": "L", "sp_method": "lasp1", "label": "LASP-1",
              "what": "linear layer, the states pass a ring: P-1 serial hops"},
    "lasp2h": {"pattern": "N", "sp_method": "lasp2", "label": "LASP-2H",
               "what": "softmax layer, all-gather of K and V (backward: reduce-scatter of dK, dV)"},
    "ring": {"pattern": "N", "sp_method": "lasp1", "label": "ring attention",
             "what": "softmax layer, P-1 shifts of the K/V blocks, each during the attention to the block at hand"},
}  # fmt: skip


def method_config(shape: dict, overrides: dict, method: str, p: int):
    """Linear-Llama at the bench `shape` (less its name) with the layer pattern and sp_method of `method`
    (SP_ALGORITHMS), with `sequence_parallel.overrides` (e.g. a decay) under them."""
    spec = SP_ALGORITHMS[method]
    overrides = {**(overrides or {}), "layer_pattern": spec["pattern"], "sp_method": spec["sp_method"]}
    return models.get("linear").bench_config(dict(shape), {"sp": p}, **overrides)


def sp_config(cfg: dict, method: str, p: int):
    """`method_config` from a plain settings dict (`bench_shape`, `sequence_parallel.overrides`), as
    eval.simulator.heldout.lasp2 and the tests hold them."""
    shape = {k: v for k, v in cfg["bench_shape"].items() if k != "name"}
    return method_config(shape, cfg["sequence_parallel"].get("overrides"), method, p)
