"""A rank does not outlive its launcher: torchrun killed alone (SIGKILL, no chance to stop its workers), the rank
it started gets SIGTERM from the kernel, stops at the end of its step with a checkpoint, and exits."""

import os
import signal
import subprocess
import sys
import time

import psutil
import torch

from tests.test_train import TINY, subprocess_env


def test_ranks_end_when_torchrun_is_killed(tmp_path):
    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-port=0", "-m", "train.pretrain",
        f"hydra.run.dir={run}", *TINY, "trainer=cpu", "logger=none", "trainer.max_steps=100000",
        "trainer.val_check_interval=1000", "callbacks.model_checkpoint.every_n_train_steps=100000",
    ]
    with open(tmp_path / "launcher.log", "w") as out:
        launcher = subprocess.Popen(command, cwd=tmp_path, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    ranks = []
    try:
        deadline = time.monotonic() + 180
        log = run / "pretrain.log"
        while not (log.exists() and "[val] step      0" in log.read_text()):
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the rank did not start training"
            time.sleep(0.5)
        ranks = psutil.Process(launcher.pid).children(recursive=True)
        assert ranks
        time.sleep(2)  # some steps in
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        _, alive = psutil.wait_procs(ranks, timeout=90)
        assert not alive, f"ranks outlived their launcher: {[p.pid for p in alive]}"
        # SIGTERM, not a kill: the rank stopped at the end of a step and wrote its checkpoint.
        last = run / "checkpoints" / "last.ckpt"
        assert torch.load(last, weights_only=False)["global_step"] > 0
    finally:
        for process in ranks:
            if process.is_running():
                process.kill()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
