"""Device model of the speed simulator: every aten operation is charged a roofline time instead of timed.

A model's real `forward()` runs on the meta device (shapes, no values, no memory: a 70B model at TP 8
costs nothing to build) under `DeviceClock`, a dispatch mode that records each aten operation as one op
of (FLOPs, HBM bytes, kernel or not). `DeviceClock.mark()` (the number of ops so far) is what the
simulated link's `VirtualClock` reads as its `now`: the issue and wait points of `forward()` (through
`parallel.comm`) are kept exactly where the code puts them, and a recorded run is then replayed
(`parallel.link.ClockRecorder`) with the ops' times under any `DeviceModel`, so one run serves every
device preset, link preset and fitted constant.

One op's time on a device (roofline, plus a fixed cost per kernel):

    time = max(FLOPs / (peak_flops x eff_flops), bytes / (hbm_Bps x eff_hbm)) + kernel_overhead_s

- FLOPs: PyTorch's own formulas (`torch.utils.flop_counter.flop_registry`: matmuls, attention kernels),
  plus the ones it lacks (`EXTRA_FLOPS`: the routed experts' `_grouped_mm`, 2 x rows x K x N, forward and
  backward); every other op is memory-bound (`MEMORY_BOUND`: a few operations per element it reads, far
  below any GPU's FLOP/byte ridge), and `eval.simulator.audit` lists every op the zoo runs on meta that has
  no formula, failing on one that is in neither list.
- Bytes: the operands' and results' sizes (what a kernel reads and writes once). Exceptions: an op that
  writes into part of a tensor in place (a static KV cache's `index_copy_`) moves its source, not the whole
  destination; a gather (`embedding`, `index_select`) reads the rows it returns, not the whole table.
- Views, aliases and factory ops (`view`, `transpose`, `expand`, `empty`, ...) cost nothing.
- Fusion (assumed, `fuse_pointwise=True`): the papers' numbers are compiled (torch.compile, CUDA graphs),
  which fuses chains of elementwise ops into the kernels around them; elementwise ops (aten's `pointwise`
  tag) cost nothing, everything else (matmuls, attention, reductions such as a norm's mean, copies,
  concatenations, gathers) is one kernel.
- Attention: `F.scaled_dot_product_attention` is charged as the program a GPU runs for it, an explicit choice of
  the recording (`attention_program`): eval.simulator.attention says what each program's kernels move.
- Small, launch-bound steps (a decode step, a prefill at batch 1 on a short prompt): every kernel pays
  `kernel_overhead_s` on top of its roofline time, whatever its size, so a step of N kernels costs at least
  N x kernel_overhead_s. Wave quantisation is optional and off by default (`DeviceModel(wave_quantisation=
  True)`; the committed constants were fitted without it): a matmul's output is cut into 128 x 128 tiles
  (`output_tiles`), run one per SM at a time (the preset's SM count, from the spec sheet), so one whose tiles
  are fewer than the SMs, or not a whole number of waves, keeps only tiles / (waves x SMs) of the chip busy
  and its FLOP time is divided by that. Off, a small compute-bound matmul (a short prompt's prefill) is
  charged as if the whole chip ran it. Not modelled either way: the tile shape a library picks (64-wide or
  split-K kernels for skinny matmuls), tensor-core padding of small dimensions, L2 reuse (an operand read
  twice is charged twice), and a kernel's latency beyond the fixed overhead (a small reduction's tail).
  Memory-bound matmuls (decode's weight reads) are charged their bytes either way.
- Matmul efficiency by shape (`DeviceModel(matmul_table=True)`, on in the committed fit): on a Hopper preset, a 2-D
  matmul's FLOP time is also divided by the throughput XLA measured on an H100 at its (m, n, k) over the throughput
  at 4096^3 (eval.simulator.matmul_table: OpenXLA's sm_90 table), so a short prompt's prefill at TP 8 (few output
  tiles, a short K loop) pays what the measurement says; `eff_flops` is then a large matmul's efficiency.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from eval.simulator.attention import attention_charges, attention_program_of, sdpa_keywords, tensor_bytes
from eval.simulator.matmul_table import ARCH as MATMUL_TABLE_ARCH
from eval.simulator.matmul_table import shape_efficiency
from parallel.devices import DEVICES, DevicePreset, get_device
from train.flops import EXTRA_FLOPS


@dataclass(frozen=True)
class DeviceModel:
    """A device preset and the constants that turn an op's FLOPs and bytes into seconds."""

    device: DevicePreset
    eff_flops: float = 0.6  # fraction of peak FLOP/s a compute-bound kernel reaches
    eff_hbm: float = 0.7  # fraction of HBM bandwidth a memory-bound kernel reaches
    kernel_overhead_s: float = 2e-6  # per kernel: launch gap and tail (CUDA graphs keep it small)
    # Fraction of the communication time that overlaps compute still paid: NCCL's kernels take SMs and HBM
    # bandwidth from the compute they run beside (added by the replay, `eval.simulator.replay.Phase.replay`).
    # `contention` is the latency-bound regime's (small messages: the launch and the protocol's handshakes),
    # `contention_bw` the bandwidth-bound regime's (large messages stream through HBM and SMs for their
    # whole duration); a collective's link time is split between the two by the link model's own terms
    # (latency: base + hops x alpha; bandwidth: the rest). None: `contention` for both.
    contention: float = 0.0
    contention_bw: float | None = None
    # Wave quantisation of matmuls (off: the committed fit has none): a matmul's 128 x 128 output tiles run in
    # waves of one tile per SM, so its FLOP time is divided by tiles / (waves x SMs) (`wave_efficiency`).
    wave_quantisation: bool = False
    # Matmul efficiency by shape (off: the committed fit has none): a 2-D matmul's FLOP time is divided by the
    # measured H100 throughput at its (m, n, k) over the throughput at 4096^3 (`eval.simulator.matmul_table`).
    matmul_table: bool = False
    # Host-side cost of one collective launched outside a CUDA graph (a prefill or a training step; a decode step
    # captured in a graph replays its collectives without it), added to the link's fixed latency by the replay
    # (`eval.simulator.replay.Phase.replay(graphed=False)`): c10d's issue path (the NCCL stream made to wait on the
    # compute stream, a Work and its events, the kernel launch) and the ranks' skew in reaching the collective,
    # which the slowest rank's launch sets. 0: none.
    collective_launch_s: float = 0.0

    def __post_init__(self):
        for name in ("eff_flops", "eff_hbm"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name}={value!r} must be in (0, 1].")
        if self.kernel_overhead_s < 0:
            raise ValueError(f"kernel_overhead_s={self.kernel_overhead_s!r} must be >= 0.")
        if self.collective_launch_s < 0:
            raise ValueError(f"collective_launch_s={self.collective_launch_s!r} must be >= 0.")
        if not 0 <= self.contention <= 1:
            raise ValueError(f"contention={self.contention!r} must be in [0, 1].")
        if self.contention_bw is not None and not 0 <= self.contention_bw <= 1:
            raise ValueError(f"contention_bw={self.contention_bw!r} must be in [0, 1].")
        if self.wave_quantisation and self.device.sms < 1:
            raise ValueError(
                f"wave_quantisation=True needs the device's SM count; preset {self.device.name!r} has sms="
                f"{self.device.sms!r} (the presets of DEVICES have theirs: {sorted(DEVICES)})."
            )

    def contention_at(self, bandwidth_share: float) -> float:
        """The contention of overlapped communication whose link time is `bandwidth_share` bandwidth-bound
        (the rest latency-bound)."""
        bw = self.contention if self.contention_bw is None else self.contention_bw
        return (1 - bandwidth_share) * self.contention + bandwidth_share * bw

    @classmethod
    def from_config(
        cls, device: "str | DevicePreset", *, eff_flops, eff_hbm, kernel_overhead_us, contention, contention_bw=None,
        wave_quantisation=False, collective_launch_us=0.0, matmul_table=False,
    ) -> "DeviceModel":
        """From the configs' units (conf/bench.yaml `device_model`, conf/costmodel.yaml): the per-kernel
        overhead in microseconds, a preset by name."""
        return cls(
            get_device(device),
            eff_flops=float(eff_flops),
            eff_hbm=float(eff_hbm),
            kernel_overhead_s=float(kernel_overhead_us) * 1e-6,
            contention=float(contention),
            contention_bw=None if contention_bw is None else float(contention_bw),
            wave_quantisation=bool(wave_quantisation),
            matmul_table=bool(matmul_table),
            collective_launch_s=float(collective_launch_us) * 1e-6,
        )

    def op_time(self, flops: float, nbytes: float, kernel: bool, tiles: int = 0, mnk: tuple = ()) -> float:
        if not kernel:
            return 0.0
        shape = self.wave_efficiency(tiles) * self.shape_efficiency(mnk)
        compute = flops / (self.device.peak_flops * self.eff_flops * shape)
        return max(compute, nbytes / (self.device.hbm_Bps * self.eff_hbm)) + self.kernel_overhead_s

    def wave_efficiency(self, tiles: int) -> float:
        """The fraction of the SMs a kernel of `tiles` output tiles keeps busy over its waves: tiles / (waves x
        SMs), waves = ceil(tiles / SMs); 1 without wave quantisation or for a kernel of no tiles (not a matmul)."""
        if not self.wave_quantisation or tiles <= 0:
            return 1.0
        sms = self.device.sms
        return tiles / (-(-tiles // sms) * sms)

    def shape_efficiency(self, mnk: tuple) -> float:
        """A 2-D matmul's measured throughput at its (m, n, k) over a large one's (`eval.simulator.matmul_table`); 1
        without the table, on a device of another architecture than the table's, or for another op (no `mnk`)."""
        return shape_efficiency(*mnk) if mnk and self.uses_matmul_table else 1.0

    @property
    def uses_matmul_table(self) -> bool:
        """Whether matmuls are charged the measured table's efficiency by shape: on, and a device of its architecture."""
        return self.matmul_table and self.device.sm == MATMUL_TABLE_ARCH


# Ops that produce no data of their own: views and aliases (also caught by `OpOverload.is_view`),
# factories whose memory is not read, and metadata queries.
_FREE = {
    "aten::detach", "aten::alias", "aten::lift_fresh", "aten::_unsafe_view", "aten::empty", "aten::empty_like",
    "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided", "aten::scalar_tensor", "aten::arange",
    "aten::promote_types", "aten::_local_scalar_dense", "aten::sym_size", "aten::sym_stride", "aten::sym_numel",
}  # fmt: skip
_GATHERS = {"aten::embedding", "aten::index_select", "aten::gather", "aten::index"}


# Matmuls whose output is cut into tiles, one per SM at a time (wave quantisation, `DeviceModel.wave_efficiency`).
_MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm"}
TILE = 128  # a matmul kernel's output tile, 128 x 128 (cuBLAS / CUTLASS's common tile for bf16 on A100 / H100)


def output_tiles(out: torch.Tensor) -> int:
    """The 128 x 128 tiles of a matmul's output [..., M, N]: batch x ceil(M / 128) x ceil(N / 128) (a grouped
    matmul's [rows, N] as one: its groups' boundaries add a partial tile each, not counted)."""
    if out.dim() < 2:
        return 1
    batch = out.numel() // (out.shape[-2] * out.shape[-1]) if out.shape[-2] * out.shape[-1] else 0
    return batch * -(-out.shape[-2] // TILE) * -(-out.shape[-1] // TILE)



def matmul_shape(name: str, args, out: torch.Tensor) -> tuple:
    """(m, n, k) of a 2-D matmul (`mm`: [m, k] x [k, n]; `addmm`: bias + [m, k] x [k, n]); () for a batched or
    grouped one (no shape ratio for those: `eval.simulator.matmul_table`)."""
    if name not in ("aten::mm", "aten::addmm") or out.dim() != 2:
        return ()
    a = args[0] if name == "aten::mm" else args[1]
    return (int(out.shape[0]), int(out.shape[1]), int(a.shape[-1]))

# The ops without a FLOP formula that the zoo's models run (eval.simulator.audit), by why they are memory-bound:
# a constant number of operations per element (or O(log n) for a sort), against hundreds of FLOPs per byte at
# a GPU's ridge point. Pointwise ops (aten's tag) are memory-bound too and need no entry.
MEMORY_BOUND = {
    "softmax (a few ops per element)": {
        "aten::_softmax", "aten::_safe_softmax", "aten::_log_softmax", "aten::_softmax_backward_data",
        "aten::_log_softmax_backward_data",
    },
    "reduction or scan (one op per element read)": {"aten::sum", "aten::mean", "aten::cumsum", "aten::amax", "aten::max"},
    "selection (a compare per element; sort: log n)": {"aten::topk", "aten::sort", "aten::argsort"},
    "data movement (copies, gathers, scatters, padding, concatenation)": {
        "aten::_to_copy", "aten::copy_", "aten::cat", "aten::stack", "aten::constant_pad_nd", "aten::embedding",
        "aten::embedding_dense_backward", "aten::gather", "aten::index", "aten::index_add_", "aten::index_copy_",
        "aten::index_put", "aten::index_put_", "aten::index_select", "aten::masked_scatter",
        "aten::masked_scatter_backward", "aten::scatter_add", "aten::select_backward", "aten::slice_backward",
        "aten::tril", "aten::repeat_interleave", "aten::clone",
    },
    "fill (writes, reads nothing)": {"aten::zeros", "aten::ones", "aten::ones_like", "aten::zeros_like", "aten::new_zeros", "aten::full", "aten::fill_"},
    "loss (a gather and a sum)": {"aten::nll_loss_forward", "aten::nll_loss_backward"},
    "collective (charged by the link model, parallel.link)": {
        "c10d::allreduce_", "c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::alltoall_base_",
        "c10d::send", "c10d::recv_", "c10d::allgather_", "c10d::alltoall_",
    },
}  # fmt: skip


def _tensors(tree) -> list[torch.Tensor]:
    out = []
    for x in tree:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out += _tensors(x)
    return out





def _is_pointwise(func) -> bool:
    return torch.Tag.pointwise in func.tags or func._schema.name in ("aten::_to_copy", "aten::copy_", "aten::clone")


class DeviceClock(TorchDispatchMode):
    """Records every aten op run inside it as (FLOPs, bytes, kernel); `mark()` counts the ops so far.

    Use as a context manager around the run (it also enters a function mode that charges
    `F.scaled_dot_product_attention` as one fused kernel). `times(model)` gives the cumulative time after
    each op under a `DeviceModel`: a mark m recorded during the run is at time `times(model)[m]`.
    """

    def __init__(self, fuse_pointwise: bool = True, gqa_expand: bool = False, attention_program: str | None = None):
        super().__init__()
        self.fuse_pointwise = fuse_pointwise
        self.attention_program = attention_program_of(gqa_expand, attention_program)
        # Read by eval.simulator.kernels.flash_attention (training replays: flash or gqa_expand only).
        self.gqa_expand = self.attention_program == "gqa_expand"
        self.flops: list[float] = []
        self.bytes: list[float] = []
        self.kernel: list[bool] = []
        self.tiles: list[int] = []  # a matmul's 128 x 128 output tiles (wave quantisation); 0 for other ops
        self.mnk: list[tuple] = []  # a 2-D matmul's (m, n, k) (matmul efficiency by shape); () for other ops
        self.names: list[str] = []
        self._quiet = 0  # > 0 inside a fused kernel already charged (the attention's decomposition)
        self._last_times = None  # ((DeviceModel, op count), times): replays on several links reuse them
        self._shares: dict = {}  # (op count, wave SMs, table on) -> each op's FLOP share (`_matmul_shares`)
        self._attention = _FusedAttention(self)

    def __enter__(self):
        self._attention.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._attention.__exit__(*exc)
        return out

    def mark(self) -> int:
        return len(self.flops)

    @contextmanager
    def quiet(self):
        """Ops run inside are not charged: a fused kernel whose decomposition runs here is charged once, as
        one kernel, by whoever enters this (`charge` its cost; eval.simulator.kernels, `_FusedAttention`)."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def charge(self, name: str, flops: float, nbytes: float, kernel: bool = True, tiles: int = 0,
               mnk: tuple = ()) -> None:  # fmt: skip
        self.names.append(name)
        self.flops.append(float(flops))
        self.bytes.append(float(nbytes))
        self.kernel.append(kernel)
        self.tiles.append(int(tiles))
        self.mnk.append(tuple(mnk))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._quiet:
            return out
        name = func._schema.name  # without the overload: "aten::arange", not "aten::arange.start"
        if func.is_view or name in _FREE:
            return out
        packet = func.overloadpacket
        results = _tensors(out if isinstance(out, (list, tuple)) else [out])
        formula = EXTRA_FLOPS.get(packet) or flop_registry.get(packet)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            nbytes = sum(tensor_bytes(t) for t in _tensors(list(args) + list(kwargs.values()))) + sum(map(tensor_bytes, results))
            matmul = name in _MATMULS and bool(results)
            self.charge(name, flops, nbytes, tiles=output_tiles(results[0]) if matmul else 0,
                        mnk=matmul_shape(name, args, results[0]) if matmul else ())  # fmt: skip
        elif name in _GATHERS:
            self.charge(name, 0, 2 * sum(map(tensor_bytes, results)))
        elif func._schema.is_mutable and name not in ("aten::copy_",):
            # In place into part of a tensor (index_copy_, index_put_, ...): the source moves, read and written.
            mutated = {id(a) for a, arg in zip(args, func._schema.arguments, strict=False) if arg.alias_info and arg.alias_info.is_write}
            sources = [t for t in _tensors(list(args) + list(kwargs.values())) if id(t) not in mutated]
            self.charge(name, 0, 2 * sum(map(tensor_bytes, sources)))
        elif self.fuse_pointwise and _is_pointwise(func):
            self.charge(name, 0, 0, kernel=False)
        else:
            inputs = _tensors(list(args) + list(kwargs.values()))
            self.charge(name, 0, sum(map(tensor_bytes, inputs)) + sum(map(tensor_bytes, results)))
        return out

    def times(self, model: DeviceModel) -> list[float]:
        """Cumulative seconds after 0, 1, ..., n ops (n + 1 values) under `model` (`op_time` of each op)."""
        key = (model, len(self.flops))
        if self._last_times is None or self._last_times[0] != key:
            self._last_times = (key, self._cumulative(model))
        return self._last_times[1]

    def _matmul_shares(self, model: DeviceModel) -> np.ndarray:
        """Each op's share of the chip's FLOP/s (wave quantisation x efficiency by shape; 1 for non-matmuls), computed
        once per clock and setting: a plan replays one recording under many device models."""
        key = (len(self.tiles), model.wave_quantisation and model.device.sms, model.uses_matmul_table)
        if key not in self._shares:
            self._shares[key] = np.asarray([model.wave_efficiency(t) * model.shape_efficiency(s)
                                            for t, s in zip(self.tiles, self.mnk, strict=True)], dtype=np.float64)  # fmt: skip
        return self._shares[key]

    def _cumulative(self, model: DeviceModel) -> list[float]:
        flops, nbytes, kernel = (np.asarray(x, dtype=np.float64) for x in (self.flops, self.bytes, self.kernel))
        d = model.device
        waves = self._matmul_shares(model)
        per_op = kernel * (
            np.maximum(flops / (d.peak_flops * model.eff_flops * waves), nbytes / (d.hbm_Bps * model.eff_hbm))
            + model.kernel_overhead_s
        )
        return np.concatenate([[0.0], np.cumsum(per_op)]).tolist()


class _FusedAttention(TorchFunctionMode):
    """Charges `F.scaled_dot_product_attention` as the clock's attention program's kernels (one flash-attention
    kernel by default) and runs it quietly."""

    def __init__(self, clock: DeviceClock):
        super().__init__()
        self.clock = clock

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        charges = attention_charges(
            *sdpa_keywords(args, kwargs), program=self.clock.attention_program, fuse_pointwise=self.clock.fuse_pointwise
        )
        for charge in charges:
            self.clock.charge(*charge)
        with self.clock.quiet():
            return func(*args, **kwargs)
