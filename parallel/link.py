"""Alpha-beta link model and the simulated link's virtual clock.

A collective of n bytes over a P-way ring costs, per NCCL's ring algorithms,
    all-reduce:       base + 2 (P-1) alpha + 2 (P-1)/P * n / beta
    all-gather:       base +   (P-1) alpha +   (P-1)/P * n / beta     (n = gathered output size)
    reduce-scatter:   base +   (P-1) alpha +   (P-1)/P * n / beta     (n = input size)
    all-to-all:       base +   (P-1) alpha +   (P-1)/P * n / beta     (equal splits, n = input size)
    send-recv:        base +         alpha +             n / beta     (one hop of a ring shift: n bytes out, n in)
with base the fixed latency of one collective (kernel launch and the ranks' handshake), alpha the per-hop
latency and beta the per-direction bandwidth in bytes/s.

An all-to-all with unequal splits (`all_to_all_time`) is charged by what THIS rank moves:
    base + (P-1) alpha + max(sent, received) / beta
with `sent` the bytes it sends to the other P-1 ranks and `received` the bytes it receives from them
(its own chunk stays local). One alpha per peer; sending and receiving overlap (links are full
duplex), so the larger direction sets the time. With equal splits sent = received = (P-1)/P * n,
which is the formula above. The model sees one rank only: a peer that is slower (more tokens routed
to it) finishes later in reality, which this rank's time does not include.

P is the size of the collective's own process group: on an ep x tp mesh an all-to-all over ep and an
all-reduce over tp are timed with their own P (`VirtualClock.issue(..., world_size=P)`).

`VirtualClock` plays one rank in one process: compute is measured for real between communication
events; each collective goes on a FIFO link starting when both it is issued and that link is free;
waiting on a result that is not ready yet advances the clock to its finish time and that gap is the
exposed communication (also kept per label in `exposed_by`, each label's link time in `busy_by`; the
label is the collective's kind unless the caller names one: `parallel.comm` keeps expert parallelism's
count exchange apart from its token all-to-alls). The clock holds one link for every group, or one per mesh
dimension (`{"tp": "nvlink-h100", "ep": "ethernet-25g"}`). Dimensions given the same preset share
one FIFO queue (they are taken to be the same hardware); different presets are independent links
whose transfers run at the same time.

A `HierarchicalLink` is the link of a group that spans nodes (NVLink inside a node of `ranks_per_node` GPUs,
one network NIC per GPU between nodes; ranks numbered node by node). A group within one node is timed on
the intra-node preset. A group across nodes, as NCCL times and runs it (src/graph/tuning.cc: with more than
one node every ring step is charged the network's latency; rings run on parallel channels, each channel
crossing a node boundary on its own NIC, so a node's NICs together carry the ring's bytes):
    ring collectives: max(base) + steps alpha_net + steps/P * n / min(beta_nvlink, nics_per_node beta_nic)
    send-recv:        base_net + alpha_net + n / beta_nic + p2p_launch_s
                      (a ring shift: every rank sends at once, the slowest hop is a node boundary's, one NIC)
    all-to-all:       max(base) + (P-1) alpha_net + off-node bytes / beta_nic  (each GPU's own NIC)
`p2p_launch_s` is the host's cost of one point-to-point hop issued and waited in turn (a send/recv pair
launched, then waited before the next is issued), charged on every send_recv, inside a node too.
"""

import time
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class LinkPreset:
    name: str
    alpha_s: float  # latency per hop, seconds
    beta_Bps: float  # bandwidth per direction, bytes per second
    note: str = ""
    base_s: float = 0.0  # fixed latency of one collective, seconds


@dataclass(frozen=True)
class HierarchicalLink:
    """NVLink inside a node, a network between nodes (module docstring)."""

    name: str
    intra: LinkPreset  # inside a node (NVLink via NVSwitch)
    inter: LinkPreset  # one GPU's network NIC (alpha per hop, beta per direction, base per collective)
    ranks_per_node: int = 8
    nics_per_node: int = 8  # network NICs a node's rings share out (one per GPU on a DGX A100)
    p2p_launch_s: float = 0.0  # host cost of one send/recv hop issued and waited in turn
    note: str = ""

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.nics_per_node < 1 or self.p2p_launch_s < 0:
            raise ValueError(f"{self.name}: ranks_per_node and nics_per_node must be >= 1, p2p_launch_s >= 0.")

    def spans_nodes(self, world_size: int) -> bool:
        return world_size > self.ranks_per_node


LINK_PRESETS: dict[str, LinkPreset] = {
    # NVLink 4 on H100 SXM: 450 GB/s per direction nominal; NCCL reaches ~360 GB/s bus bandwidth. Latencies
    # fitted to the Ladder paper's 70B table (eval.costmodel, reports/costmodel): 4.9 us per collective +
    # 1.5 us per hop, 25.9 us per small all-reduce at TP 8 (the table implies 24-28 us).
    "nvlink-h100": LinkPreset(
        "nvlink-h100", 1.5e-6, 360e9, "H100 SXM NVLink 4, NCCL ring bus bandwidth; latencies fitted", base_s=4.9e-6
    ),
    # NVLink 3 on A100 SXM (NVSwitch): 300 GB/s per direction nominal, ~230 GB/s NCCL bus bandwidth; latencies
    # taken from the H100 fit above (assumed: the same NCCL protocol costs, not measured).
    "nvlink-a100": LinkPreset(
        "nvlink-a100", 1.5e-6, 230e9, "A100 SXM NVLink 3 via NVSwitch; latencies assumed as nvlink-h100's", base_s=4.9e-6
    ),
    # NVLink 3 on A800 SXM (the export variant of A100: 400 GB/s bidirectional, 200 GB/s per direction); NCCL bus
    # bandwidth taken at nvlink-a100's fraction of nominal (230 / 300); latencies as nvlink-a100's (assumed).
    "nvlink-a800": LinkPreset(
        "nvlink-a800", 1.5e-6, 200e9 * 230 / 300, "A800 SXM NVLink 3 at 200 GB/s per direction; latencies assumed as nvlink-h100's",
        base_s=4.9e-6,
    ),
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
    # One GPU's HDR InfiniBand NIC (DGX A100 datasheet: 8 single-port ConnectX-6 200 Gb/s HDR per node, one per
    # GPU). Bandwidth 90% of the 25 GB/s line rate (assumed, as ethernet-25g); latencies NCCL's own model of the
    # network (NVIDIA/nccl src/graph/tuning.cc: hwLat[NET][Ring][Simple] = 14 us per hop, baseLat Ring Simple 8.4 us).
    "ib-hdr-200g": LinkPreset(
        "ib-hdr-200g", 14e-6, 25e9 * 0.9, "one GPU's 200 Gb/s HDR InfiniBand NIC, 90% line rate; NCCL's latencies",
        base_s=8.4e-6,
    ),
}

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def collective_time(kind: str, nbytes: int, world_size: int, link: "LinkPreset | HierarchicalLink") -> float:
    """Seconds for one collective of `nbytes` on a `world_size`-way ring over `link`."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"Unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}.")
    p = world_size
    if p <= 1:
        return 0.0
    if isinstance(link, HierarchicalLink):
        return _hierarchical_time(kind, nbytes, p, link)
    if kind == "send_recv":  # one hop; sending and receiving overlap (full duplex)
        return link.base_s + link.alpha_s + nbytes / link.beta_Bps
    steps = 2 * (p - 1) if kind == "all_reduce" else p - 1
    return link.base_s + steps * link.alpha_s + steps / p * nbytes / link.beta_Bps


def _hierarchical_time(kind: str, nbytes: int, p: int, link: HierarchicalLink) -> float:
    """`collective_time` on a `HierarchicalLink` (module docstring), p > 1."""
    intra, inter = link.intra, link.inter
    if kind == "send_recv":
        hop = inter if link.spans_nodes(p) else intra
        return hop.base_s + hop.alpha_s + nbytes / hop.beta_Bps + link.p2p_launch_s
    if not link.spans_nodes(p):
        return collective_time(kind, nbytes, p, intra)
    base = max(intra.base_s, inter.base_s)
    if kind == "all_to_all":  # equal splits: the bytes for other nodes leave through this GPU's own NIC
        off_node = (p - link.ranks_per_node) / p * nbytes
        return base + (p - 1) * inter.alpha_s + off_node / inter.beta_Bps
    steps = 2 * (p - 1) if kind == "all_reduce" else p - 1
    beta = min(intra.beta_Bps, link.nics_per_node * inter.beta_Bps)  # the slower of NVLink and a node's NICs
    return base + steps * inter.alpha_s + steps / p * nbytes / beta


def all_to_all_time(
    sent_bytes: int, received_bytes: int, world_size: int, link: "LinkPreset | HierarchicalLink"
) -> float:
    """Seconds for one rank's part of an all-to-all with unequal splits (bytes to / from OTHER ranks)."""
    if world_size <= 1:
        return 0.0
    if isinstance(link, HierarchicalLink):  # timed as if every peer were off-node (an upper bound)
        if not link.spans_nodes(world_size):
            return all_to_all_time(sent_bytes, received_bytes, world_size, link.intra)
        base = max(link.intra.base_s, link.inter.base_s)
        return base + (world_size - 1) * link.inter.alpha_s + max(sent_bytes, received_bytes) / link.inter.beta_Bps
    return link.base_s + (world_size - 1) * link.alpha_s + max(sent_bytes, received_bytes) / link.beta_Bps


def without_bandwidth(link: "LinkPreset | HierarchicalLink") -> "LinkPreset | HierarchicalLink":
    """`link` with unlimited bandwidth: what a collective then costs is the link's latency alone."""
    inf = float("inf")
    if isinstance(link, HierarchicalLink):
        return replace(link, intra=replace(link.intra, beta_Bps=inf), inter=replace(link.inter, beta_Bps=inf))
    return replace(link, beta_Bps=inf)


def get_link(name_or_preset: "str | LinkPreset | HierarchicalLink") -> "LinkPreset | HierarchicalLink":
    if isinstance(name_or_preset, (LinkPreset, HierarchicalLink)):
        return name_or_preset
    if name_or_preset not in LINK_PRESETS:
        raise ValueError(f"Unknown link preset {name_or_preset!r}; choose one of {sorted(LINK_PRESETS)}.")
    return LINK_PRESETS[name_or_preset]


def get_links(link) -> "LinkPreset | dict[str, LinkPreset]":
    """One preset (name or `LinkPreset`), or a {mesh dimension name: preset} mapping, resolved to presets."""
    if isinstance(link, dict):
        if not link:
            raise ValueError("A per-dimension link mapping needs at least one {dimension: preset} entry.")
        return {dim: get_link(preset) for dim, preset in link.items()}
    return get_link(link)


@dataclass
class VirtualClock:
    """The simulated rank's timeline. `now` is a function returning seconds of real compute time.

    `link` is one `LinkPreset` for every collective, or {mesh dimension name: LinkPreset}.
    `world_size` is the P used by `issue` calls that do not pass their own group's size.
    """

    link: "LinkPreset | dict[str, LinkPreset]"
    world_size: int | None = None
    now: "callable" = time.perf_counter
    sync: "callable | None" = None  # e.g. torch.cuda.synchronize, so measured compute is finished
    clock: float = 0.0  # virtual time, seconds
    exposed: float = 0.0  # communication time not covered by compute
    comm_busy: float = 0.0  # total link time, summed over links
    free_at: dict = field(default_factory=dict)  # LinkPreset -> virtual time its FIFO queue is free
    exposed_by: dict = field(default_factory=dict)  # label -> its part of `exposed`
    busy_by: dict = field(default_factory=dict)  # label -> its part of `comm_busy`
    _label_of: dict = field(default_factory=dict, repr=False)  # ready time of a collective in flight -> label
    _last: float | None = field(default=None, repr=False)

    @property
    def link_free_at(self) -> float:
        """When the last queued transfer on any link finishes."""
        return max(self.free_at.values(), default=0.0)

    def link_for(self, dim: str | None) -> LinkPreset:
        """The link a collective over mesh dimension `dim` (None: not a known mesh dimension) runs on."""
        if not isinstance(self.link, dict):
            return self.link
        if dim is None:
            raise ValueError(
                f"The simulated links are given per mesh dimension ({sorted(self.link)}), but this collective's "
                "process group is not a dimension of a mesh from parallel.init_mesh; use a mesh group, "
                "register the group with parallel.mesh.name_group, or give one link for all groups."
            )
        if dim not in self.link:
            raise ValueError(
                f"A collective runs over mesh dimension {dim!r} but the simulated links name only "
                f"{sorted(self.link)}; add a link for {dim!r}."
            )
        return self.link[dim]

    def start(self) -> None:
        if self.sync:
            self.sync()
        self.clock = self.exposed = self.comm_busy = 0.0
        self.free_at, self.exposed_by, self.busy_by, self._label_of = {}, {}, {}, {}
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

    def issue(
        self,
        kind: str,
        nbytes: int,
        world_size: int | None = None,
        dim: str | None = None,
        *,
        peer_bytes: "tuple[int, int] | None" = None,
        label: str | None = None,
    ) -> float:
        """Put a collective on its link; returns the virtual time its result is ready.

        `world_size`: the P of the collective's group (default: the clock's `world_size`); `dim`: the mesh
        dimension the group spans, which picks the link when links are given per dimension;
        `peer_bytes`: (sent, received) bytes to/from the other ranks, for an all-to-all with unequal
        splits (then timed by `all_to_all_time` instead of the ring formula on `nbytes`); `label`: what its
        link time and exposed time are counted under in `busy_by` / `exposed_by` (default: `kind`).
        """
        self._advance()
        p = world_size if world_size is not None else self.world_size
        if p is None:
            raise ValueError(f"No world size for a simulated {kind}: pass the group's size or give the clock one.")
        link = self.link_for(dim)
        if peer_bytes is not None:
            duration = all_to_all_time(*peer_bytes, p, link)
        else:
            duration = collective_time(kind, nbytes, p, link)
        start = max(self.clock, self.free_at.get(link, 0.0))
        self.free_at[link] = start + duration
        self.comm_busy += duration
        label = label or kind
        self.busy_by[label] = self.busy_by.get(label, 0.0) + duration
        self._label_of[self.free_at[link]] = label
        self.rebase()
        return self.free_at[link]

    def wait(self, ready_at: float) -> None:
        self._advance()
        label = self._label_of.pop(ready_at, "unlabelled")
        if ready_at > self.clock:
            self.exposed += ready_at - self.clock
            self.exposed_by[label] = self.exposed_by.get(label, 0.0) + ready_at - self.clock
            self.clock = ready_at
        self.rebase()

    def elapsed(self) -> float:
        """Virtual time so far, including compute since the last event."""
        self._advance()
        self.rebase()
        return self.clock


class ClockRecorder:
    """Records what one run asks of the simulated link's clock (each call, with its arguments) and every real
    time the clock reads, so that the run can be replayed on other link presets without running it again.

    The compute between collectives does not depend on the link (the stand-in results are the same), so a
    replay gives exactly what running again on that link would measure, without the run-to-run noise: the
    presets are compared on the same compute. Only top-level calls are recorded (the clock's own calls to
    its methods are replayed by it); a wait is recorded by the index of the collective it waits for."""

    CALLS = ("start", "issue", "wait", "rebase", "elapsed")

    def __init__(self, clock: VirtualClock):
        self.calls: list[tuple[str, tuple, dict]] = []
        self.times: list[float] = []
        self.issue_marks: list[float] = []  # what the run's clock read at each collective's issue
        self._depth = 0
        self._issue_index: dict[float, int] = {}
        real_now = clock.now

        def now():
            t = real_now()
            self.times.append(t)
            return t

        clock.now = now
        for name in self.CALLS:
            setattr(clock, name, self._recording(name, getattr(clock, name)))

    def _recording(self, name: str, method):
        def call(*args, **kwargs):
            if self._depth:  # the clock calling itself: replayed by the replaying clock itself
                return method(*args, **kwargs)
            self.calls.append((name, (self._issue_index[args[0]],) if name == "wait" else args, kwargs))
            self._depth += 1
            try:
                out = method(*args, **kwargs)
            finally:
                self._depth -= 1
            if name == "issue":
                self._issue_index[out] = len(self._issue_index)
                self.issue_marks.append(self.times[-1])
            return out

        return call

    def replay(self, link, times: "list[float] | None" = None) -> list[dict]:
        """The recorded calls on a fresh clock over `link` (a preset, or one per mesh dimension) with the
        recorded compute times; the clock's state at each `elapsed` call (the marks: end of forward, end of
        backward). `times` maps what the run's clock read to seconds: where the run's `now` was
        `eval.simulator.device.DeviceClock.mark` (an op count), `times[mark]` is the time after that many ops under
        a device model."""
        read = iter(self.times if times is None else [times[m] for m in self.times])
        clock = VirtualClock(get_links(link), now=lambda: next(read))
        ready, marks = [], []
        for name, args, kwargs in self.calls:
            if name == "issue":
                ready.append(clock.issue(*args, **kwargs))
            elif name == "wait":
                clock.wait(ready[args[0]])
            elif name == "elapsed":
                marks.append({"time": clock.elapsed(), "exposed": clock.exposed, "busy": clock.comm_busy,
                              "exposed_by": dict(clock.exposed_by), "busy_by": dict(clock.busy_by)})  # fmt: skip
            else:
                getattr(clock, name)(*args, **kwargs)
        return marks
