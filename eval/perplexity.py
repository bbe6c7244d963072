"""Validation loss and perplexity of a causal LM over a dataloader of packed token blocks.

Token-weighted: the loss is the mean over every predicted token (T-1 per block), so perplexity is
exp of the average negative log-likelihood per token, the number users compare across models.
"""

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def evaluate_loss(model, dataloader, max_batches: int | None = None) -> dict:
    """{"loss", "ppl", "tokens"} of `model` on `dataloader` batches of {"input_ids": [B, T]}."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for i, batch in enumerate(dataloader):
        if max_batches is not None and i >= max_batches:
            break
        ids = batch["input_ids"].to(device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        targets = ids[:, 1:]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").item()
        count += targets.numel()
    model.train(was_training)
    if count == 0:
        raise ValueError("The validation dataloader yielded no batches; check the split and seq_len.")
    loss = nll / count
    return {"loss": loss, "ppl": math.exp(loss), "tokens": count}
