"""Shared test fixtures: fp32 determinism, one OpenMP thread, quiet logs."""

import os

# One OpenMP thread per process (before torch is imported; subprocesses inherit it): the suite's ops are tiny,
# and on a shared 2-core machine a second thread makes each one wait for a descheduled worker (a small matmul
# took 13 ms at 2 threads against 36 us at 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield
