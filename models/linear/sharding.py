# PLACEHOLDER written by the model engineer (models/linear) so that the architecture registers: it has no
# shard layout yet. The sequence-parallel engineer replaces this file with the "sp" layout (PLAN["sp"],
# giving each layer's `self_attn` its `sp_group`: see models/linear/modeling.py's docstring for the calls
# the attention modules then make into parallel.sequence) and its check_layout.
"""Shard layout of Linear-Llama: none yet (placeholder; see the comment above)."""

PLAN = {}


def check_layout(config, degrees: dict[str, int]) -> None:
    """No sharded dimension fits until the sequence-parallel layout lands."""
    sharded = {d: n for d, n in degrees.items() if n > 1 and d != "dp"}
    if sharded:
        raise ValueError(
            f"{config.model_type} has no shard layout yet, so {sharded} does not fit; run it unsharded."
        )
