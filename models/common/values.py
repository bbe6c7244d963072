"""Whether a tensor has values: the speed simulator runs the models' real code on tensors that have none.

Two kinds of tensors carry shapes but no values: the meta device's (the time replay, eval.simulator.replay) and
FakeTensorMode's (the memory replay, eval.simulator.memory: fake tensors keep their device, so that FSDP and
PyTorch's memory trackers run as on a real device). Code that would read a value (a routing's counts, a check of
the token ids) takes the stand-in path for both.
"""

import torch
from torch._subclasses.fake_tensor import is_fake


def has_values(t: torch.Tensor) -> bool:
    """False for a meta or fake tensor (shapes only), True otherwise."""
    return not (t.is_meta or is_fake(t))
