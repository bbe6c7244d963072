"""The accelerators' datasheet presets: peak dense bf16 FLOP/s, HBM bandwidth and SM count of each GPU the zoo
predicts or measures on (`DEVICES`, `get_device`). The link presets beside them are parallel/link.py's; the
trainer's MFU (train.flops.peak_flops) and the speed simulator's device model (eval.simulator.device) read these.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class DevicePreset:
    name: str
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s
    hbm_Bps: float  # HBM bandwidth, bytes/s
    note: str = ""
    sms: int = 0  # streaming multiprocessors (spec sheet); 0: unknown (no wave quantisation possible)
    sm: str = ""  # CUDA architecture ("sm_90": Hopper; "sm_89": Ada; "sm_80": Ampere), for measured kernel tables; "": unknown


# SM counts: NVIDIA's spec sheets / architecture whitepapers (H100 SXM5 and H200: 132; A100 and A800: 108; A30: 56;
# RTX 4090: 128).
DEVICES: dict[str, DevicePreset] = {
    "h100-sxm": DevicePreset("h100-sxm", 989e12, 3.35e12, "H100 SXM5 80GB datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3", 132, "sm_90"),
    "h200": DevicePreset("h200", 989e12, 4.8e12, "H200 SXM 141GB datasheet: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e", 132, "sm_90"),
    "a100-sxm": DevicePreset("a100-sxm", 312e12, 2.039e12, "A100 SXM 80GB datasheet: 312 TFLOP/s dense bf16, 2.04 TB/s", 108, "sm_80"),
    # The held-out papers' GPUs (eval.simulator.heldout), from the spec sheets only (nothing fitted on them):
    "a100-40gb": DevicePreset("a100-40gb", 312e12, 1.555e12, "A100 SXM4 40GB datasheet: 312 TFLOP/s dense bf16, 1.555 TB/s HBM2", 108, "sm_80"),
    "a800": DevicePreset("a800", 312e12, 2.039e12, "A800 SXM4 80GB datasheet: 312 TFLOP/s dense bf16, 2.039 TB/s HBM2e (NVLink cut to 400 GB/s)", 108, "sm_80"),
    "rtx4090": DevicePreset("rtx4090", 165.2e12, 1.008e12, "GeForce RTX 4090 24GB (Ada whitepaper): 165.2 TFLOP/s dense bf16 with fp32 accumulate, 1,008 GB/s GDDR6X", 128, "sm_89"),
    "a30": DevicePreset("a30", 165e12, 0.933e12, "A30 PCIe 24GB datasheet: 165 TFLOP/s dense bf16, 933 GB/s HBM2", 56, "sm_80"),
}  # fmt: skip


def get_device(name: "str | DevicePreset") -> DevicePreset:
    if isinstance(name, DevicePreset):
        return name
    if name not in DEVICES:
        raise ValueError(f"Unknown device preset {name!r}; choose one of {sorted(DEVICES)} (or compute=measured).")
    return DEVICES[name]
