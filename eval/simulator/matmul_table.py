"""Measured matmul throughput by shape on an H100 (sm_90), bf16: the device model's matmul efficiency by shape.

Source: OpenXLA's default GPU matmul performance table, `kDefaultMatmulPTable`, key "sm_90", in
xla/service/gpu/model/matmul_interpolator_data.h (read from the tensorflow/tensorflow mirror, third_party/xla/, at
commit 372d578bb861cc5804e56d37d93aec931a59762c): the FLOP/s XLA measured for a [b, m, k] x [b, k, n] matmul at every
m, n, k in {256, 512, 1024, 2048, 4096}. Kept here: the b = 1 entries, "bf16xbf16->bf16", in TFLOP/s (two decimals).
fp16 runs on the same tensor cores at the same rate on H100, so the table serves fp16 records too.

What the device model takes from it (`DeviceModel(matmul_table=True)`) is a ratio, not a rate: `shape_efficiency`
is the table's throughput at a matmul's shape over its throughput at 4096 x 4096 x 4096 (783 TFLOP/s, its best), so
the fitted `eff_flops` stays the efficiency of a large matmul and a small one (a short prompt's prefill at TP 8: few
output tiles for 132 SMs, a short K loop) is charged what the measurement says it loses. It applies on a device of
the architecture measured only (`DevicePreset.sm` "sm_90": H100, H200); the Ampere presets have no measured table
here and are charged none.

Between the grid's points: linear in log(throughput) over log2 of each dimension. Outside it:
- a dimension below 256 (a decode step's few rows, a router's few experts): 1, no shape charge (the table does not
  cover those kernels: they are GEMV-like and memory-bound, charged their bytes by the roofline);
- K above 4096: K = 4096 (the table's throughput rises with K and flattens by 4096: 739 -> 783 TFLOP/s from 2048 at
  4096 x 4096);
- an output larger than the grid in one dimension (a training step's 98,304 rows): the excess moved into the other
  dimension, keeping m x n (the output tiles, the matmul's parallelism), up to 4096 x 4096.
Not modelled: a kernel other than the one XLA measured at these shapes (split-K for a weight gradient's long K);
batched matmuls (`bmm`, `_grouped_mm`: charged without a shape ratio).
"""

import math
from functools import cache

SOURCE = (
    "OpenXLA kDefaultMatmulPTable, sm_90, b = 1, bf16 (xla/service/gpu/model/matmul_interpolator_data.h in "
    "tensorflow/tensorflow at 372d578bb861cc5804e56d37d93aec931a59762c, third_party/xla/)"
)
ARCH = "sm_90"  # the architecture measured: a device preset of another (`DevicePreset.sm`) is charged no shape ratio
DIMS = (256, 512, 1024, 2048, 4096)
# (m, n): TFLOP/s at k = 256, 512, 1024, 2048, 4096.
TFLOPS = {
    (256, 256): (6.45, 11.46, 19.46, 31.13, 84.31),
    (256, 512): (11.46, 21.96, 39.11, 62.37, 91.68),
    (256, 1024): (22.67, 41.84, 72.47, 118.99, 172.29),
    (256, 2048): (41.84, 78.22, 138.08, 215.78, 285.87),
    (256, 4096): (78.03, 138.08, 225.20, 324.59, 412.03),
    (512, 256): (11.46, 21.79, 39.29, 60.13, 91.06),
    (512, 512): (21.62, 40.72, 71.24, 114.72, 174.54),
    (512, 1024): (43.46, 80.47, 138.65, 216.48, 309.61),
    (512, 2048): (79.32, 143.40, 232.61, 342.39, 430.53),
    (512, 4096): (134.22, 236.30, 373.35, 522.25, 644.12),
    (1024, 256): (21.96, 40.92, 68.34, 113.17, 169.68),
    (1024, 512): (42.91, 82.24, 141.28, 220.03, 298.93),
    (1024, 1024): (82.04, 145.57, 236.30, 349.98, 470.11),
    (1024, 2048): (139.52, 237.55, 373.35, 524.29, 653.53),
    (1024, 4096): (209.72, 338.93, 490.29, 634.22, 738.47),
    (2048, 256): (43.58, 77.31, 135.85, 216.13, 307.49),
    (2048, 512): (83.89, 142.78, 235.88, 347.71, 451.15),
    (2048, 1024): (141.58, 238.40, 373.35, 523.27, 653.13),
    (2048, 2048): (213.04, 345.48, 493.90, 631.98, 737.97),
    (2048, 4096): (299.26, 450.40, 594.21, 715.35, 753.64),
    (4096, 256): (82.24, 137.24, 217.18, 304.69, 376.22),
    (4096, 512): (142.48, 238.82, 370.77, 521.74, 649.96),
    (4096, 1024): (216.48, 343.71, 488.06, 631.98, 738.47),
    (4096, 2048): (304.00, 447.02, 593.23, 716.07, 758.43),
    (4096, 4096): (392.16, 543.12, 677.44, 738.74, 783.33),
}  # fmt: skip
BEST = TFLOPS[(4096, 4096)][-1]


def _fold(m: float, n: float) -> tuple[float, float]:
    """An output beyond the grid in one dimension as the same number of elements with the excess in the other."""
    top = DIMS[-1]
    if m > top:
        m, n = top, n * m / top
    if n > top:
        n, m = top, min(top, m * n / top)
    return m, n


def _log_tflops(m: float, n: float, k: float) -> float:
    """log(TFLOP/s) at (m, n, k) inside the grid: linear in log2 of each dimension between its points."""
    coords = []
    for x in (m, n, k):
        t = math.log2(x / DIMS[0])  # 0 .. 4 across the grid
        i = min(int(t), len(DIMS) - 2)
        coords.append((i, t - i))
    total = 0.0
    for corner in range(8):
        weight, index = 1.0, []
        for axis, (i, frac) in enumerate(coords):
            upper = corner >> axis & 1
            weight *= frac if upper else 1 - frac
            index.append(DIMS[i + upper])
        if weight:
            total += weight * math.log(TFLOPS[(index[0], index[1])][DIMS.index(index[2])])
    return total


@cache
def shape_efficiency(m: int, n: int, k: int) -> float:
    """The table's throughput at an [m, k] x [k, n] matmul over its best (4096^3); 1 where a dimension is below the
    grid (module docstring)."""
    if min(m, n, k) < DIMS[0]:
        return 1.0
    fm, fn = _fold(float(m), float(n))
    return min(1.0, math.exp(_log_tflops(fm, fn, min(float(k), DIMS[-1]))) / BEST)
