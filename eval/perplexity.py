"""Validation loss and perplexity: `train.metrics.evaluate_loss`, the one definition the trainer's
validation shares, under the name evaluations have imported it by."""

from train.metrics import evaluate_loss

__all__ = ["evaluate_loss"]
