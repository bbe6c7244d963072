"""The machine the bench runs on: the device and dtype of the `device` and `dtype` settings, what results.json
says about the hardware."""

import os
import platform
from pathlib import Path

import torch
import transformers


def resolve_device(cfg: dict) -> tuple[torch.device, torch.dtype]:
    """The `device` and `dtype` settings (`auto`: cuda with bfloat16 where CUDA is available, else cpu with float32)."""
    name = cfg["device"]
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={cfg['device']} but CUDA is not available on this machine (torch {torch.__version__}); "
            "use device=auto or device=cpu."
        )
    dtype = cfg["dtype"]
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return device, getattr(torch, dtype)


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def hardware_info(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": _cpu_model(),
        "cpu_cores": cpu_cores(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
