"""System-level overlap: schedules that change WHERE a layer waits its collectives, not what it computes.

A schedule is a setting of the run (`parallel.overlap` in conf/parallel; `set_overlap(model, schedule)`), applied to
the unchanged model after its shard layout:

- `none`: each collective is waited where the architecture's own `forward()` waits it.
- `token_split`: the batch split in two halves that take turns, so that one half's tensor-parallel all-reduce is in
  flight while the other half computes (TokenWeave's and Domino's batch split), and in an MoE layer one half's
  expert-parallel dispatch / combine all-to-all while the other half's experts run (DeepSeek's and SGLang's
  two-batch overlap). It needs a batch of two sequences or more; with a KV cache each half writes and reads its own
  rows of it (`models.common.cache.BatchSplit`).
- `seq_split`: the sequence split in two chunks that take turns in the same way (ISO's sequence-level overlap, for
  a prefill of one sequence): the second chunk's causal attention reads the first chunk's keys and values of the
  same layer, which are ready before it runs. Every forward of two tokens or more is split (prefill, training); a
  decode step's single token runs as `none`, having nothing to split.

- `collective_matmul`: tensor parallelism with the residual stream sharded along the sequence over the TP ranks
  between the first layer and the last (Megatron's sequence parallelism), the all-gather before each sub-block's
  column-parallel linears and the reduce-scatter after its row-parallel one decomposed into ring steps hidden
  behind the chunks' matmuls (PyTorch's async TP, Wang et al.'s collective matmul; parallel/collective_matmul.py).
  The trunk shards the stream on entry and gathers it after the last layer (`models.common.decoder.run_sequence_sharded`);
  each layer runs its `forward(..., sequence_sharded=True)`. A forward of one token (a decode step) runs as
  `none`; a longer one needs a multiple of the TP degree tokens.

Under either split the trunk splits the forward once and joins the halves after the last layer
(`models.common.decoder.run_split`); each layer runs its sub-blocks on the halves in turn, in its `split_layer`,
where the waits are written (the standard block's `models.common.PreNormDecoderLayer.split_layer`, the parallel
block's, `models.moe`'s MoE layer), and hands half 1's last collective on in flight, so that it runs behind the
next layer's first sub-block of half 0, as TokenWeave and Domino overlap across layers: only the last layer's last
collective is waited with no compute after it. The trunk then calls its layers' sub-blocks itself, so FSDP units
and activation-checkpointing regions are the sub-blocks' modules, as under the ladder schedule (the trunk's
`runs_layers_whole`).

The benches and the simulator name an architecture under a schedule `<arch>+<schedule>` (`llama+token_split`,
`models.schedule_of`).

An architecture takes a schedule by listing it in its model class's `overlap_schedules`; any other is refused with
the reason, before anything runs, and so is a schedule on a ladder variant (`residual='ladder'`: the residual
schedule runs the sub-blocks itself). Each schedule computes the same function as `none`: tests/test_overlap.py checks
logits, loss, gradients and cached decode against the unsplit model (fp64) and under TP 2 against the unsharded one.
"""

from torch import nn

SCHEDULES = ("none", "token_split", "seq_split", "collective_matmul")
# The fewest sequences a forward needs for the schedule to mean something (a batch split needs two halves).
MIN_BATCH = {"none": 1, "token_split": 2, "seq_split": 1, "collective_matmul": 1}


def check_overlap(model_class: type, schedule: str, residual: str = "standard") -> None:
    """One clear error for a schedule that is unknown or that `model_class` (under the residual schedule `residual`,
    its config's) does not take."""
    if schedule not in SCHEDULES:
        raise ValueError(f"overlap={schedule!r} is not a schedule; choose one of {list(SCHEDULES)}.")
    takes = ("none", *getattr(model_class, "overlap_schedules", ()))
    if schedule not in takes:
        raise ValueError(
            f"{model_class.__name__} does not take overlap={schedule!r}: it takes {list(takes)} (its layers wait their "
            "collectives in a schedule of their own, or split batches would change what they compute). An "
            "architecture takes a schedule by listing it in its model class's `overlap_schedules`."
        )
    if schedule != "none" and residual != "standard":
        raise ValueError(
            f"overlap={schedule!r} is not built for residual={residual!r}: the ladder residual schedule runs its "
            "layers' sub-blocks itself (models/common/residual.py), each collective waited one sub-block later, so the "
            "schedule's trunk (a split, or the sequence-sharded layers of collective_matmul) would not run; use the "
            "architecture's standard form or overlap='none'."
        )


def set_overlap(model: nn.Module, schedule: str) -> nn.Module:
    """Run `model`'s trunk (every module with an `overlap` setting) under `schedule` (in place); returns `model`.
    Set before activation checkpointing, compile and FSDP, whose units follow how the trunk calls its layers."""
    check_overlap(type(model), schedule, getattr(model.config, "residual", "standard"))
    trunks = [m for m in model.modules() if hasattr(m, "overlap")]
    if schedule != "none" and not trunks:
        raise ValueError(f"{type(model).__name__} lists overlap={schedule!r} but has no module with an `overlap` setting.")
    for trunk in trunks:
        trunk.overlap = schedule
    return model
