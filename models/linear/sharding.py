"""Shard layout of Linear-Llama: sequence parallelism over sp (parallel/sequence.py); the one place it is stated.

Rank r of the sp group holds tokens [r*N/P, (r+1)*N/P) of every sequence and runs the whole model on them;
every weight is replicated over sp (its gradient summed over the group by parallel.grad_sync). What the
ranks exchange is the sequence mixing of each layer, issued by the attention modules once they hold the
group (`sp_group`), with the config's `sp_method`:
- `lasp2`: per linear layer one all-gather of the d_k x d_v states (LASP-2: its size does not grow with N),
  per softmax layer of a hybrid all-gathers of K and V (LASP-2H; their backward reduce-scatters dK, dV);
- `lasp1`: the baselines, LASP-1's ring of states (P-1 serial hops) and ring attention (P-1 K/V shifts).
The trunk gets the group too: its `sequence_offset` starts this rank's positions and causal mask at r*N/P.

Not sharded: no tensor-parallel layout (a tp degree above 1 is refused; the heads would split as Llama's, but
the layout is not written) and no expert parallelism.
"""

from parallel.layout import check_planned

PLAN = {
    "sp": {
        "model": "group",  # the trunk: positions and the causal mask offset by the rank (sequence_offset)
        "model.layers.*.self_attn": "group",  # linear and softmax mixers alike
    },
}


def check_layout(config, degrees: dict[str, int]) -> None:
    """Any sp degree fits (the sequence length is checked where sequences are split, parallel.sequence.
    split_sequence); tp and ep have no layout."""
    check_planned(config, PLAN, degrees)
