"""Held-out row: ScMoE (Cai et al., ICML 2025, arXiv 2404.05019v3), inference and training speed-ups over top-2 MoE.

The paper's two inference headlines, one per machine (v3; v1 had other numbers):

- 8 x A30-PCIe, SwinV2-MoE-S on ImageNet-1K (Table 1): ScMoE (Pos-2) inference 1.66x over the standard top-2 MoE
  (training 1.43x); there communication is 60% of the MoE time (Section 4.2.1) and ScMoE hides 70% of it (Figure
  8(a), Section 4.2.3).
- 8 x A800-NVLink, GPT2-MoE-Medium (Table 2): ScMoE inference 1.17x (training 1.12x); communication 15% of the MoE
  time (Section 4.2.2); on this machine ScMoE hides all of it (Figure 8(b), measured on SwinV2-MoE-S).

Both are "end-to-end speedup of ... inference (one iteration)": one forward of a batch, every GPU one expert
parallel rank (8 experts: one per GPU, Appendix A.8), Tutel's capacity-padded dispatch (capacity factor 1.25 for
Swin, Table 9; 2.0 for GPT, Table 8). Predicted here with the zoo's `moe` (top-2, MoE every second block,
renormalised gates: the standard top-2 MoE) and `scmoe` (Pos-2 pairs: top-1 routed experts on the dense block's
post-attention stream plus a gated shared expert as wide as an expert, so the same compute per token), both with
the padded dispatch at the paper's capacity factor (models/common/moe.py `dispatch_padded`: E x C rows per
all-to-all, as Tutel sends), built on the meta device at expert parallelism 8 and replayed under the committed
device model and the link presets (`a30` + `pcie4`, `a800` + `nvlink-a800`), nothing fitted.

The zoo builds decoder language models only, so SwinV2-MoE-S is played by stand-ins of its four stages (Table 9:
image 192, window 12, embedding 96, depths 2/2/18/2, heads 3/6/12/24, patches of 4): stage s is a Llama-shaped
stack over windows of 12 x 12 = 144 tokens (Swin's window attention: each window attends within itself, so a
window is a sequence), hidden 96 x 2^s, SwiGLU width 8/3 x hidden (the FLOPs of Swin's 4x GELU MLP), at 128 images
per GPU (batch 1024 on 8 GPUs): stage 1 2048 windows, stage 2 512, stage 3 128 (its 12 x 12 map is one window),
stage 4 128 windows of 6 x 6 (the map is smaller than the window). Stage 3's MoE blocks (every second of its 18)
are the ones ScMoE changes (Appendix A.8); stage 4's one MoE block stays top-2 in both rows. Left out: patch
embedding and merging, the classifier, SwinV2's post-norm, cosine attention and relative position bias, and
attention is causal in the stand-in (Swin's is not: the stand-in's attention FLOPs are half).

GPT2-MoE-Medium (Table 8): 24 layers, hidden 1024, 16 heads, 16 experts per MoE layer (Table 8; Table 7's and
Figure 13's captions say 8: sensitivity), MoE every second block, sequences of 2048, GELU 4x MLP as SwiGLU of
width 2736 (8/3 x 1024 rounded up to a multiple of 8), GPT-2's vocabulary. The batch is not stated: assumed 8
sequences per GPU (sensitivity: 1 and 32). The forward computes every position's logits.

Cells: the two inference speed-ups (the headline: their geometric mean), the top-2 baseline's communication share
of MoE time on each machine (link time of the all-to-alls / (compute inside the MoE blocks + that link time), over
the blocks ScMoE changes: Figure 8 analyses those pairs), the share of ScMoE's all-to-all link time hidden (1 -
exposed / link time), and, not in the headline, the paper's other inference speed-ups over top-2 at the same
settings: top-1 and shared-expert MoE (Table 1), GPT2-MoE's shared-expert MoE and LLaMA2-MoE (Pos-1: an MoE block
in every layer, Table 2), GPT3-MoE-XL (Table 4; Table 8's shapes, the same assumed batch); and the paper's two
training speed-ups (1.43x, 1.12x) at the same settings, one training step of each model replayed by
eval.simulator.training (heldout/scmoe_train.py).
"""

from dataclasses import dataclass, replace
from functools import cache

import torch

from eval.simulator import replay
from eval.simulator.device import DeviceClock
from eval.simulator.heldout import TARGET, device_model, fitted_constants, geomean, scmoe_train
from models.common.moe import SparseMoE
from models.llama.configuration import ZooLlamaConfig
from models.moe.configuration import ZooMoeConfig
from models.scmoe.configuration import ZooScMoeConfig
from parallel import comm
from parallel.link import ClockRecorder, get_link

PAPER = "scmoe"
SOURCE = (
    "Cai, Jiang, Qin, Cui, Kim, Huang, 'Shortcut-connected Expert Parallelism for Accelerating Mixture of Experts', "
    "arXiv 2404.05019v3 (ICML 2025): Table 1 (SwinV2-MoE-S, 8 x A30-PCIe: ScMoE Pos-2 inference 1.66x, training "
    "1.43x over top-2), Table 2 (GPT2-MoE, 8 x A800-NVLink: inference 1.17x, training 1.12x), Sections 4.2.1-4.2.2 "
    "(communication 60% / 15% of MoE time), Section 4.2.3 and Figure 8 (70% of communication overlapped on "
    "8 x A30-PCIe, all of it on 8 x A800-NVLink), Appendix A.8 with Tables 8-9 (model shapes, 8 experts one per GPU, "
    "capacity factors 1.25 / 2.0, batch 1024 images, Tutel + Fairseq); the paper's text as stored in the code index"
)

MACHINES = {"pcie": ("a30", "pcie4"), "nvlink": ("a800", "nvlink-a800")}
PUBLISHED = {"pcie": 1.66, "nvlink": 1.17}  # inference speed-ups, Table 1 and Table 2
COMM_SHARE = {"pcie": 0.60, "nvlink": 0.15}  # of the top-2 MoE's MoE time, Sections 4.2.1 and 4.2.2
HIDDEN = {"pcie": 0.70, "nvlink": 1.0}  # of ScMoE's communication, Section 4.2.3 / Figure 8 (SwinV2-MoE-S)
EP = 8


# The variants timed: the paper's baseline and the architectures it compares (Tables 1, 2 and 4). "scmoe" is
# the shortcut-connected MoE at the stage's position (Pos-2 pairs, or Pos-1 with an MoE block in every layer).
VARIANTS = {
    "top2": "standard top-2 MoE (`moe`)",
    "top1": "standard top-1 MoE (`moe`, k = 1)",
    "shared": "shared-expert MoE: top-1 + a gated shared expert, no shortcut (`scmoe`, shortcut=False)",
    "scmoe": "ScMoE (`scmoe`): top-1 on the shortcut + a gated shared expert",
}


@dataclass(frozen=True)
class Stage:
    """One stack of a model: `layers` Llama-shaped blocks over `batch` sequences of `seq` tokens; `moe`: MoE blocks
    of `experts` experts, every second block (`every_layer`: every block, the paper's Pos-1 models), of the row's
    variant, or top-2 whatever the variant if `fixed`."""

    name: str
    hidden: int
    heads: int
    layers: int
    batch: int
    seq: int
    moe: bool = False
    fixed: bool = False  # an MoE stage ScMoE leaves as top-2 (SwinV2's stage 4)
    experts: int = 8
    capacity_factor: float | None = 1.25  # None: dropless (a sensitivity run)
    vocab: int | None = (
        None  # None: a stage inside a model (embeddings in, no head); else token ids and logits
    )
    ffn: int | None = None  # None: 8/3 x hidden, rounded up to a multiple of 8
    kv_heads: int | None = None  # None: = heads
    every_layer: bool = False

    @property
    def intermediate(self) -> int:
        return self.ffn or -(-8 * self.hidden // 3 // 8) * 8


def swin_stages(quick: bool = False) -> list[Stage]:
    """SwinV2-MoE-S at 192 x 192, window 12, 128 images per GPU, as four stand-in stacks (module docstring)."""
    if quick:
        return [Stage("stage 1", 16, 2, 2, 4, 16), Stage("stage 3", 64, 4, 4, 2, 16, moe=True, experts=4),
                Stage("stage 4", 128, 4, 2, 2, 4, moe=True, fixed=True, experts=4)]  # fmt: skip
    images = 1024 // EP
    return [
        Stage("stage 1", 96, 3, 2, images * 16, 144),  # 48 x 48 patches: 16 windows of 12 x 12
        Stage("stage 2", 192, 6, 2, images * 4, 144),  # 24 x 24: 4 windows
        Stage("stage 3", 384, 12, 18, images, 144, moe=True),  # 12 x 12: one window; 9 (dense, MoE) pairs
        Stage("stage 4", 768, 24, 2, images, 36, moe=True, fixed=True),  # 6 x 6, smaller than a window
    ]


def gpt2_stages(quick: bool = False, batch: int = 8, experts: int = 16) -> list[Stage]:
    """GPT2-MoE-Medium (Table 8) at `batch` sequences of 2048 per GPU."""
    if quick:
        return [Stage("gpt2", 64, 4, 4, 2, 32, moe=True, experts=4, capacity_factor=2.0, vocab=128)]
    return [Stage("gpt2-moe-medium", 1024, 16, 24, batch, 2048, moe=True, experts=experts, capacity_factor=2.0,
                  vocab=50257, ffn=2736)]  # fmt: skip


def other_language_models(quick: bool = False, batch: int = 8) -> dict[str, list[Stage]]:
    """Table 8's GPT3-MoE-XL (Pos-2 pairs, Table 4) and LLaMA2-MoE (an MoE block in every layer, Pos-1, Table 2),
    8 experts, capacity factor 2.0, sequences of 2048, `batch` per GPU (not stated). Their MLP widths are not
    stated: GPT-3's 4x GELU as SwiGLU 8/3 x 2048 -> 5464; LLaMA-2's own rule (8/3 x hidden, rounded up to a
    multiple of 256) -> 5632."""
    if quick:
        tiny = dict(moe=True, experts=4, capacity_factor=2.0, vocab=128)
        return {"GPT3-MoE-XL": [Stage("gpt3", 64, 4, 4, 2, 32, **tiny)],
                "LLaMA2-MoE": [Stage("llama2", 64, 4, 4, 2, 32, kv_heads=2, every_layer=True, **tiny)]}  # fmt: skip
    common = dict(moe=True, experts=8, capacity_factor=2.0)
    return {
        "GPT3-MoE-XL": [Stage("gpt3-moe-xl", 2048, 32, 24, batch, 2048, vocab=50257, ffn=5464, **common)],
        "LLaMA2-MoE": [Stage("llama2-moe", 2048, 16, 24, batch, 2048, vocab=32000, ffn=5632, kv_heads=4,
                             every_layer=True, **common)],
    }  # fmt: skip


def config_of(stage: Stage, variant: str):
    shape = dict(vocab_size=stage.vocab or 64, hidden_size=stage.hidden, intermediate_size=stage.intermediate,
                 num_hidden_layers=stage.layers, num_attention_heads=stage.heads,
                 num_key_value_heads=stage.kv_heads or stage.heads, max_position_embeddings=max(2048, stage.seq))  # fmt: skip
    if not stage.moe:
        return ZooLlamaConfig(**shape)
    # Tutel's capacity-padded dispatch (E x C rows computed and sent); None: the zoo's dropless dispatch.
    dispatch = "dropless" if stage.capacity_factor is None else "padded"
    moe = dict(
        num_local_experts=stage.experts, moe_dispatch=dispatch, dispatch_capacity_factor=stage.capacity_factor
    )
    if stage.fixed:
        variant = "top2"
    if variant in ("top2", "top1"):
        freq = 1 if stage.every_layer else 2
        return ZooMoeConfig(
            **shape, **moe, num_experts_per_tok=2 if variant == "top2" else 1, moe_layer_freq=freq
        )
    if variant not in VARIANTS:
        raise ValueError(f"Unknown variant {variant!r}; choose one of {sorted(VARIANTS)}.")
    # The shared expert as wide as a routed expert, gated by CG-1 (the zoo's default): top-2's compute per token.
    return ZooScMoeConfig(**shape, **moe, num_experts_per_tok=1, shortcut=variant == "scmoe",
                          shortcut_position=1 if stage.every_layer else 2)  # fmt: skip


def arch_of(stage: Stage, variant: str) -> str:
    if not stage.moe:
        return "llama"
    return "moe" if stage.fixed or variant in ("top2", "top1") else "scmoe"


def stage_model(stage: Stage, variant: str) -> tuple[str, object]:
    """(architecture, config) of a stage's stand-in (what scmoe_train records)."""
    return arch_of(stage, variant), config_of(stage, variant)


@dataclass
class Recorded:
    """A stage's recorded forward, and the [start, end) op marks of each MoE block's routed part (its `SparseMoE`:
    router, dispatch, experts, combine; what the baseline's MoE time is made of besides its all-to-alls)."""

    stage: Stage
    phase: replay.Phase
    moe_spans: list[list[int]]


@cache  # a recording serves every device model and link (eval.simulator.replay)
def record_stage(stage: Stage, variant: str, ep: int) -> Recorded:
    """One forward (inference: no cache, no gradients) of `stage` as `variant` on the meta device, sharded at expert
    parallelism `ep` on a fake mesh, recorded as replay does (ops under a DeviceClock, collectives through the
    simulated link's clock)."""
    name = arch_of(stage, variant)
    model = replay.build_meta(name, config_of(stage, variant), {"ep": ep} if stage.moe else {})
    clock, spans = DeviceClock(), []
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.register_forward_pre_hook(lambda *_: spans.append([clock.mark(), None]))
            module.register_forward_hook(lambda *_: spans[-1].__setitem__(1, clock.mark()))
    if stage.vocab is None:
        x = torch.empty(stage.batch, stage.seq, stage.hidden, device="meta", dtype=torch.bfloat16)

        def run():
            model.model(inputs_embeds=x, use_cache=False)
    else:
        ids = torch.zeros(stage.batch, stage.seq, dtype=torch.long, device="meta")

        def run():
            model(ids, use_cache=False, logits_to_keep=0)

    comm.reset_counters()
    with (
        torch.no_grad(),
        comm.use_mode("simulated", link="nvlink-h100", world_size=ep, now=clock.mark) as vclock,
    ):
        recorder = ClockRecorder(vclock)
        with clock:
            vclock.start()
            run()
            vclock.elapsed()
    replay.release()
    return Recorded(stage, replay.Phase(clock, recorder, comm.snapshot_counters()), spans)


def replay_model(recorded: list[Recorded], device, link) -> dict:
    """The stages' replays on `device` and `link` (the ep link): the forward's time, summed over the stages; and,
    over the stages whose MoE blocks ScMoE changes (Figure 8 analyses those pairs), the all-to-alls' link and
    exposed time and the compute inside the MoE blocks (their routed part; ScMoE's shared expert and gate are
    outside)."""
    out = {"time": 0.0, "a2a_busy": 0.0, "a2a_exposed": 0.0, "moe_compute": 0.0}
    for rec in recorded:
        r = rec.phase.replay(device, {"ep": link})
        times = rec.phase.clock.times(device)
        out["time"] += r["time"]
        if not rec.stage.moe or rec.stage.fixed:
            continue
        out["a2a_busy"] += r["busy_by"].get("all_to_all", 0.0)
        out["a2a_exposed"] += r["exposed_by"].get("all_to_all", 0.0)
        out["moe_compute"] += sum(times[b] - times[a] for a, b in rec.moe_spans)
    return out


def predict(stages: list[Stage], device, link, ep: int = EP, variant: str = "scmoe") -> dict:
    """{speedup of `variant` over top-2, comm_share (top-2), hidden (`variant`'s all-to-all time hidden), top2,
    <variant>}: one inference forward on `link`."""
    rows = {
        v: replay_model([record_stage(s, v, ep) for s in stages], device, link) for v in ("top2", variant)
    }
    base, other = rows["top2"], rows[variant]
    return {
        "speedup": base["time"] / other["time"],
        "comm_share": base["a2a_busy"] / (base["moe_compute"] + base["a2a_busy"]),
        "hidden": 1 - other["a2a_exposed"] / other["a2a_busy"] if other["a2a_busy"] else None,
        **rows,
    }


def validate(quick: bool = False) -> dict:
    ep = 2 if quick else EP
    models_of = {"pcie": swin_stages(quick), "nvlink": gpt2_stages(quick)}
    results = {}
    for machine, (device, link) in MACHINES.items():
        results[machine] = predict(models_of[machine], device_model(device), link, ep)
    # Figure 8(b)'s setting: SwinV2-MoE-S on 8 x A800-NVLink, for the hidden share published there.
    swin_nvlink = predict(models_of["pcie"], device_model("a800"), "nvlink-a800", ep)
    cells = [
        {"label": "8 x A30-PCIe, SwinV2-MoE-S: inference speed-up over top-2", "published": PUBLISHED["pcie"],
         "predicted": results["pcie"]["speedup"], "what": "one forward of 128 images per GPU (stand-in stages), "
         "moe top-2 / scmoe Pos-2, capacity factor 1.25, ep 8 over pcie4, a30"},
        {"label": "8 x A800-NVLink, GPT2-MoE-Medium: inference speed-up over top-2", "published": PUBLISHED["nvlink"],
         "predicted": results["nvlink"]["speedup"], "what": "one forward of 8 x 2048 tokens per GPU (assumed), "
         "every logit, capacity factor 2.0, ep 8 over nvlink-a800, a800"},
        {"label": "8 x A30-PCIe, SwinV2-MoE-S: communication share of MoE time (top-2)",
         "published": COMM_SHARE["pcie"], "predicted": results["pcie"]["comm_share"],
         "what": "all-to-all link time / (compute inside the MoE blocks + that link time), stage 3's blocks"},
        {"label": "8 x A800-NVLink, GPT2-MoE-Medium: communication share of MoE time (top-2)",
         "published": COMM_SHARE["nvlink"], "predicted": results["nvlink"]["comm_share"],
         "what": "as above, the GPT2 stand-in"},
        {"label": "8 x A30-PCIe, SwinV2-MoE-S: share of ScMoE's communication hidden", "published": HIDDEN["pcie"],
         "predicted": results["pcie"]["hidden"], "what": "1 - exposed / link time of ScMoE's all-to-alls"},
        {"label": "8 x A800-NVLink, SwinV2-MoE-S: share of ScMoE's communication hidden", "published": HIDDEN["nvlink"],
         "predicted": swin_nvlink["hidden"], "what": "Figure 8(b)'s setting: the Swin stand-in on a800 + nvlink-a800"},
    ]  # fmt: skip
    cells += _other_cells(quick, ep, models_of)
    train_cells = scmoe_train.cells(ep, models_of, MACHINES, stage_model)
    cells += train_cells
    published = geomean(PUBLISHED.values())
    predicted = geomean([cells[0]["predicted"], cells[1]["predicted"]])
    sensitivity = _sensitivity(quick, ep, models_of)
    train_sensitivity = scmoe_train.sensitivity(ep, models_of, stage_model)
    sensitivity += train_sensitivity
    return {
        "paper": "ScMoE (Cai, Jiang, Qin, Cui, Kim, Huang, ICML 2025)",
        "source": SOURCE,
        "headline": "Compared with the standard top-2 MoE, ScMoE (Pos-2) speeds up inference 1.66x on 8 x A30-PCIe "
        "(communication 60% of MoE time, 70% of it overlapped) and 1.17x on 8 x A800-NVLink (15%, all overlapped)",
        "setting": "8 x A30 (a30) over PCIe 4.0 (pcie4): SwinV2-MoE-S as four stand-in stacks, 128 images of 192 x 192 "
        "per GPU; 8 x A800 (a800) over NVLink (nvlink-a800): GPT2-MoE-Medium, 8 x 2048 tokens per GPU (assumed); "
        "expert parallelism 8, Tutel-style padded dispatch (capacity 1.25 / 2.0), one inference forward, bf16; "
        "`moe` top-2 every second block against `scmoe` Pos-2 (top-1 + shared expert). published / predicted: the "
        "geometric mean of the two machines' inference speed-ups (1.66 and 1.17)",
        "published": published,
        "predicted": predicted,
        "cells": cells,
        "sensitivity": sensitivity,
        "lacks": " ".join(
            filter(
                None,
                [
                    _lacks([c for c in cells if c not in train_cells], sensitivity),
                    scmoe_train.lacks(train_cells, train_sensitivity),
                ],
            )
        ),
        "notes": [
            "The training speed-ups (1.43x, 1.12x; cells, not the headline) are one training step of each model "
            "replayed by eval.simulator.training (heldout/scmoe_train.py: forward + backward + AdamW, FSDP2 over the 8 "
            "ranks in place of Fairseq's DDP, whose gradient all-reduce overlaps the backward as FSDP2's traffic does).",
            "The paper's numbers come from a Tutel + Fairseq implementation on two CUDA streams; the simulator "
            "overlaps each all-to-all with the compute between its issue and its wait on an ideal link, charging "
            "the committed contention constants for the overlapped seconds.",
            "SwinV2-MoE-S is played by Llama-shaped stand-ins of its stages (module docstring); GPT2-MoE-Medium's "
            "batch per GPU is not stated (8 sequences assumed).",
            "The shared-expert MoE here is `scmoe` with shortcut=False (top-1 routed experts and the gated shared "
            "expert on the block's own stream, the dispatch overlapping the shared expert); the paper's shared-expert "
            "baseline may overlap less (Figure 7's third timeline).",
            "On NVLink most of the predicted gain over top-2 comes from Tutel's padded compute at capacity factor 2.0 "
            "(top-2: 4 expert rows per token; top-1 + shared expert: 3), not from hiding communication (15% of the "
            "MoE time); at capacity 1.0 or dropless the GPT2 speed-up is ~1.06 (sensitivity).",
            "arXiv 2404.05019v1 reported other numbers for the same comparisons (training +30% / +11%, inference "
            "+40% / +15% on PCIe / NVLink); the cells use v3's tables.",
        ],
    }


# The paper's other inference speed-ups over top-2 (not the headline): (model, variant, published, source).
OTHER_CELLS = (
    ("SwinV2-MoE-S", "top1", 1.39, "Table 1"),
    ("SwinV2-MoE-S", "shared", 1.35, "Table 1"),
    ("GPT2-MoE-Medium", "shared", 1.06, "Table 2"),
    ("LLaMA2-MoE", "scmoe", 1.21, "Table 2 (Pos-1: an MoE block in every layer)"),
    ("LLaMA2-MoE", "shared", 1.11, "Table 2"),
    ("GPT3-MoE-XL", "scmoe", 1.18, "Table 4"),
)


def _other_cells(quick: bool, ep: int, models_of: dict) -> list[dict]:
    stages = {
        "SwinV2-MoE-S": models_of["pcie"],
        "GPT2-MoE-Medium": models_of["nvlink"],
        **other_language_models(quick),
    }
    cells = []
    for model, variant, published, where in OTHER_CELLS:
        machine = "pcie" if model.startswith("Swin") else "nvlink"
        device, link = MACHINES[machine]
        r = predict(stages[model], device_model(device), link, ep, variant)
        cells.append({"label": f"{'8 x A30-PCIe' if machine == 'pcie' else '8 x A800-NVLink'}, {model}: {variant} "
                               f"inference speed-up over top-2 (not the headline)", "published": published,
                      "predicted": r["speedup"], "what": f"{VARIANTS[variant]}; {where}; {link}, {device}"})  # fmt: skip
    return cells


def _sensitivity(quick: bool, ep: int, models_of: dict) -> list[dict]:
    out = []
    pcie = get_link("pcie4")
    half = replace(pcie, name="pcie4-half", beta_Bps=pcie.beta_Bps / 2)
    halved = predict(models_of["pcie"], device_model("a30"), half, ep)
    effect = "PCIe all-to-all bandwidth halved (traffic between CPU sockets; not measured)"
    out.append({"effect": effect, "value": "12 GB/s", "predicted": halved["speedup"]})
    out.append({"effect": effect + ": communication share of MoE time (top-2)", "value": "12 GB/s",
                "predicted": halved["comm_share"]})  # fmt: skip
    out.append({"effect": effect + ": share of ScMoE's communication hidden", "value": "12 GB/s",
                "predicted": halved["hidden"]})  # fmt: skip
    out.append({"effect": "no contention for overlapped communication (contention = contention_bw = 0)",
                "value": "pcie", "predicted": predict(models_of["pcie"], device_model("a30", contention=0.0,
                                                      contention_bw=0.0), "pcie4", ep)["speedup"]})  # fmt: skip
    free = device_model("a30", contention=0.0, contention_bw=0.0)
    out.append({"effect": "both: PCIe bandwidth halved and no contention", "value": "12 GB/s, 0",
                "predicted": predict(models_of["pcie"], free, half, ep)["speedup"]})  # fmt: skip
    stage3 = [s for s in models_of["pcie"] if s.moe and not s.fixed]
    out.append({"effect": "SwinV2 stage 3 alone (the stages ScMoE does not change left out)", "value": "pcie",
                "predicted": predict(stage3, device_model("a30"), "pcie4", ep)["speedup"]})  # fmt: skip
    if not quick:
        for batch in (1, 32):
            stages = gpt2_stages(batch=batch)
            out.append({"effect": "GPT2-MoE-Medium sequences per GPU", "value": batch,
                        "predicted": predict(stages, device_model("a800"), "nvlink-a800", ep)["speedup"]})  # fmt: skip
        eight = predict(gpt2_stages(experts=8), device_model("a800"), "nvlink-a800", ep)["speedup"]
        out.append({"effect": "GPT2-MoE-Medium experts per MoE layer (Table 7's caption)", "value": 8,
                    "predicted": eight})  # fmt: skip
        for cf in (1.0, None):
            stages = [replace(stage, capacity_factor=cf) for stage in gpt2_stages()]
            for variant in ("scmoe", "shared"):
                r = predict(stages, device_model("a800"), "nvlink-a800", ep, variant)
                out.append({"effect": f"GPT2-MoE-Medium dispatch: {variant} over top-2 (published: scmoe 1.17, "
                                      "shared 1.06)", "value": "dropless" if cf is None else f"capacity factor {cf}",
                            "predicted": r["speedup"]})  # fmt: skip
    return out


def _lacks(cells: list[dict], sensitivity: list[dict]) -> str:
    misses = [c for c in cells if abs(c["predicted"] / c["published"] - 1) > TARGET]
    if not misses:
        return ""
    half, half_share, half_hidden, no_contention, both, stage3 = sensitivity[:6]
    share, hidden = cells[2], cells[4]
    text = (
        f"Off by more than 15%: {'; '.join(c['label'] for c in misses)}. (1) PCIe, the speed-up: the effect the "
        f"model lacks is contention that depends on the link's byte rate. The device model charges every "
        f"overlapped second of bandwidth-bound communication contention_bw = {fitted_constants()['contention_bw']:.2f} of a second (fitted on H100 "
        f"NVLink, where NCCL streams ~360 GB/s through HBM and SMs beside the compute), whatever the link; an "
        f"all-to-all over a ~24 GB/s PCIe link moves ~15x fewer bytes per second through the GPU, so ScMoE's "
        f"overlap on PCIe is charged as if it were NVLink traffic. With no contention the PCIe cell predicts "
        f"{no_contention['predicted']:.3f} (published {cells[0]['published']:.2f}). Smaller parts: the stand-in "
        f"counts SwinV2's stages 1, 2 and 4, which ScMoE leaves unchanged (stage 3 alone: "
        f"{stage3['predicted']:.3f}). (2) PCIe, the shares: the link model gives the top-2 baseline a communication "
        f"share of {share['predicted']:.0%} (paper {share['published']:.0%}) and hides {hidden['predicted']:.0%} "
        f"of ScMoE's all-to-all time (paper {hidden['published']:.0%}): its ScMoE all-to-alls fit in the compute "
        f"windows they overlap (MLP_l; Attn_l+1 and the shared expert). At half the PCIe bandwidth the baseline's "
        f"share becomes {half_share['predicted']:.0%}, {half_hidden['predicted']:.0%} is hidden and the speed-up "
        f"is {half['predicted']:.3f} (with no contention as well: {both['predicted']:.3f}): the paper's PCIe "
        f"all-to-all is slower than the `pcie4` preset (24 GB/s, not measured on A30s; not tuned here)."
    )
    nvlink = [c for c in misses if "A800" in c["label"]]
    if nvlink:
        by = {(s["effect"].split(":")[1].split(" over")[0].strip(), s["value"]): s["predicted"]
              for s in sensitivity if s["effect"].startswith("GPT2-MoE-Medium dispatch")}  # fmt: skip
        if by:
            text += (
                f" (3) NVLink, the shared-expert and LLaMA2-MoE cells: the predicted gains there come mostly from "
                f"Tutel's padded compute at the stated capacity factor 2.0 (top-2 computes and sends 2 x 2.0 = 4 "
                f"rows per token, top-1 + shared expert 2 + 1), not from overlap; at capacity factor 1.0 GPT2's "
                f"shared-expert MoE predicts {by[('shared', 'capacity factor 1.0')]:.3f} (published 1.06) but ScMoE "
                f"{by[('scmoe', 'capacity factor 1.0')]:.3f} (published 1.17; dropless: "
                f"{by[('scmoe', 'dropless')]:.3f}). What makes ScMoE 10% faster than the shared-expert MoE in the "
                f"paper (Table 2) on a link that carries only 15% of the MoE time is more than its communication: "
                f"the simulator runs compute serially (one stream) and does not model the concurrency of the routed "
                f"experts with the dense path on the paper's two CUDA streams, nor what its shared-expert baseline "
                f"leaves unoverlapped (the zoo's shortcut=False variant hides the dispatch behind the shared expert)."
            )
    return text
