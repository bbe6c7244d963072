"""Alpha-beta link model and the simulated link's virtual clock.

A collective of n bytes over a P-way ring costs, per NCCL's ring algorithms,
    all-reduce:       2 (P-1) alpha + 2 (P-1)/P * n / beta
    all-gather:         (P-1) alpha +   (P-1)/P * n / beta     (n = gathered output size)
    reduce-scatter:     (P-1) alpha +   (P-1)/P * n / beta     (n = input size)
    all-to-all:         (P-1) alpha +   (P-1)/P * n / beta
with alpha the per-hop latency and beta the per-direction bandwidth in bytes/s.

`VirtualClock` plays rank 0 of a P-way group in one process: compute is measured for real between
communication events; each collective goes on one FIFO link starting when both it is issued and the
link is free; waiting on a result that is not ready yet advances the clock to its finish time and
that gap is the exposed communication.
"""

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LinkPreset:
    name: str
    alpha_s: float  # latency per hop, seconds
    beta_Bps: float  # bandwidth per direction, bytes per second
    note: str = ""


LINK_PRESETS: dict[str, LinkPreset] = {
    # NVLink 4 on H100 SXM: 450 GB/s per direction nominal; NCCL reaches ~360 GB/s bus bandwidth.
    "nvlink-h100": LinkPreset("nvlink-h100", 3e-6, 360e9, "H100 SXM NVLink 4, NCCL ring bus bandwidth"),
    # PCIe 4.0 x16: 32 GB/s nominal, ~24 GB/s achieved (P2P off goes through host memory).
    "pcie4": LinkPreset("pcie4", 10e-6, 24e9, "PCIe 4.0 x16, achieved"),
    "ethernet-25g": LinkPreset("ethernet-25g", 25e-6, 25e9 / 8 * 0.9, "25 GbE, 90% line rate"),
    # NCCL_P2P_DISABLE=1 on an NVSwitch node: no GPU-to-GPU copies, traffic is staged through host memory
    # (NCCL's SHM transport) over each GPU's PCIe link. Not measured here: PCIe Gen5 x16 is ~50 GB/s per
    # direction nominal and every byte crosses it twice (GPU -> host -> GPU), hence ~25 GB/s; per-hop
    # latency of a host round trip taken as the `pcie4` preset's 10 us.
    "p2p-off": LinkPreset(
        "p2p-off", 10e-6, 25e9, "NCCL P2P disabled: staged through host memory over PCIe Gen5 (assumed)"
    ),
}

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def collective_time(kind: str, nbytes: int, world_size: int, link: LinkPreset) -> float:
    """Seconds for one collective of `nbytes` on a `world_size`-way ring over `link`."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"Unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}.")
    p = world_size
    if p <= 1:
        return 0.0
    steps = 2 * (p - 1) if kind == "all_reduce" else p - 1
    return steps * link.alpha_s + steps / p * nbytes / link.beta_Bps


def get_link(name_or_preset: "str | LinkPreset") -> LinkPreset:
    if isinstance(name_or_preset, LinkPreset):
        return name_or_preset
    if name_or_preset not in LINK_PRESETS:
        raise ValueError(f"Unknown link preset {name_or_preset!r}; choose one of {sorted(LINK_PRESETS)}.")
    return LINK_PRESETS[name_or_preset]


@dataclass
class VirtualClock:
    """The simulated rank's timeline. `now` is a function returning seconds of real compute time."""

    link: LinkPreset
    world_size: int
    now: "callable" = time.perf_counter
    sync: "callable | None" = None  # e.g. torch.cuda.synchronize, so measured compute is finished
    clock: float = 0.0  # virtual time, seconds
    link_free_at: float = 0.0
    exposed: float = 0.0  # communication time not covered by compute
    comm_busy: float = 0.0  # total link time
    _last: float | None = field(default=None, repr=False)

    def start(self) -> None:
        if self.sync:
            self.sync()
        self.clock = self.link_free_at = self.exposed = self.comm_busy = 0.0
        self._last = self.now()

    def _advance(self) -> None:
        """Add the compute time since the last event to the virtual clock."""
        if self._last is None:
            self.start()
            return
        if self.sync:
            self.sync()
        t = self.now()
        self.clock += t - self._last
        self._last = t

    def rebase(self) -> None:
        """Restart the compute stopwatch: bookkeeping time since the last event is not compute."""
        self._last = self.now()

    def issue(self, kind: str, nbytes: int) -> float:
        """Put a collective on the link; returns the virtual time its result is ready."""
        self._advance()
        duration = collective_time(kind, nbytes, self.world_size, self.link)
        start = max(self.clock, self.link_free_at)
        self.link_free_at = start + duration
        self.comm_busy += duration
        self.rebase()
        return self.link_free_at

    def wait(self, ready_at: float) -> None:
        self._advance()
        if ready_at > self.clock:
            self.exposed += ready_at - self.clock
            self.clock = ready_at
        self.rebase()

    def elapsed(self) -> float:
        """Virtual time so far, including compute since the last event."""
        self._advance()
        self.rebase()
        return self.clock
