"""The environment a GPU check ran in: Python, torch, CUDA, the GPU and its driver (nvidia-smi), triton, fla,
transformers, the NCCL environment variables set."""

import importlib.metadata
import os
import platform
import subprocess

import torch


def package_version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "triton": package_version("triton") or package_version("pytorch-triton"),
        "fla": package_version("fla-core") or package_version("flash-linear-attention") or "not installed",
        "transformers": package_version("transformers"),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "device": str(device),
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "TORCH_NCCL_"))},
    }
    env["nccl_env_set"] = bool(env["nccl_env"])
    if device.type == "cuda":
        try:
            props = torch.cuda.get_device_properties(device)
            env.update(
                gpu=props.name,
                gpu_memory_gib=props.total_memory / 2**30,
                sm_count=props.multi_processor_count,
                compute_capability=f"{props.major}.{props.minor}",
                gpu_count=torch.cuda.device_count(),
                cudnn=torch.backends.cudnn.version(),
            )
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:  # noqa: BLE001 - recorded, the run goes on
            env["cuda_info_error"] = f"{type(err).__name__}: {err}"
        try:
            env["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,power.limit",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=15,
            ).stdout.strip()  # fmt: skip
        except Exception as err:  # noqa: BLE001 - optional
            env["nvidia_smi"] = f"unavailable ({type(err).__name__})"
    return env
