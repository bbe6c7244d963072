"""Validation loss of a causal LM: one definition for the trainer's validation and for every evaluation.

Token-weighted: the loss is the mean over every predicted token (T-1 per block, minus masked labels), so
perplexity is exp of the average negative log-likelihood per token, the number users compare across
models. `summed_token_loss` is the per-batch piece (sums, so that batches and ranks combine exactly);
`evaluate_loss` runs it over a dataloader. It lives in `train` because the trainer uses it; `eval`
imports it from here (eval may import train, never the other way round).
"""

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # the label value Hugging Face losses skip


def summed_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token cross-entropies, number of predicted tokens) of `logits` [B, T, V] against
    `labels` [B, T] (position t predicts label t+1; labels equal to IGNORE_INDEX are skipped).

    `shifted`: `labels` are already each position's target (position t predicts label t), as sequence
    parallelism gives a chunk of a sequence shifted as a whole (train.data.next_token_targets)."""
    targets = labels if shifted else labels[:, 1:]
    logits = logits if shifted else logits[:, :-1]
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss_sum, (targets != IGNORE_INDEX).sum()


@torch.no_grad()
def evaluate_loss(model, dataloader, max_batches: int | None = None) -> dict:
    """{"loss", "ppl", "tokens"} of `model` on `dataloader` batches of {"input_ids": [B, T]} (and
    optionally "labels")."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for i, batch in enumerate(dataloader):
        if max_batches is not None and i >= max_batches:
            break
        ids = batch["input_ids"].to(device)
        labels = batch.get("labels", batch["input_ids"]).to(device)
        loss_sum, tokens = summed_token_loss(model(input_ids=ids, use_cache=False).logits, labels)
        nll += loss_sum.item()
        count += int(tokens)
    model.train(was_training)
    if count == 0:
        raise ValueError("The validation dataloader yielded no batches; check the split and seq_len.")
    loss = nll / count
    return {"loss": loss, "ppl": math.exp(loss), "tokens": count}
