"""The models the GPU check measures: which (`plan_items`: one `Item` per shape and architecture path, as rank 0
of its layout), how big (`size_items`: rank 0's weights from a meta model, layers cut to fit the GPU's memory),
and built (`build_meta_model` on the meta device for the predictions, `build_model` materialised on the device
for the timed runs; `free` releases one).
"""

import gc
from dataclasses import dataclass, field

import torch

from eval.gpu_check.errors import error_record
from eval.gpu_check.settings import Settings, load_shape


@dataclass
class Item:
    """One model: an architecture (path) at a bench shape, as rank 0 of its layout."""

    shape: str
    arch: str
    label: str
    degrees: dict  # the mesh rank 0 plays; {} = unsharded
    overrides: dict
    layers_full: int
    layers: int = 0  # after the memory cap
    params_gb: float | None = None  # rank-0 weights at `layers`
    notes: list = field(default_factory=list)

    @property
    def layout(self) -> str:
        if not self.degrees:
            return "unsharded (tp=1)"
        return ",".join(f"{k}={v}" for k, v in sorted(self.degrees.items())) + " rank 0"


def plan_items(s: Settings) -> list[Item]:
    """Every (shape, architecture path) measured, in order: the 8B shape first."""
    items = []
    for shape in s.shapes:
        layers = load_shape(shape)["num_hidden_layers"]
        for arch in s.archs:
            import models

            entry = models.get(arch)
            if arch == "gqla":
                items.append(Item(shape, arch, "gqla (gqa)", {"tp": s.degree}, {}, layers))
                items.append(
                    Item(shape, arch, "gqla (absorb)", {}, {"attn_path": "absorb"}, layers,
                         notes=["absorb runs unsharded only: the tp=1 model of the same shape, whole on one device"])
                )  # fmt: skip
            elif "ep" in entry.degrees:
                items.append(
                    Item(shape, arch, arch, {"ep": s.degree}, {}, layers,
                         notes=[f"EP {s.degree} (its tp layout keeps every expert whole on each rank)"])
                )  # fmt: skip
            else:
                items.append(Item(shape, arch, arch, {"tp": s.degree}, {}, layers))
    return items


def item_config(item: Item, layers: int):
    from eval.bench.settings import model_config

    shape = {**load_shape(item.shape), "num_hidden_layers": layers}
    cfg = {"bench_shape": shape, "config_overrides": {item.arch: dict(item.overrides)}}
    return model_config(cfg, item.arch, item.degrees)


def set_dispatch(model) -> str | None:
    """The MoE family's host-sync-free dispatch where the model has it; what runs (None: not an MoE model)."""
    if hasattr(model, "set_moe_dispatch"):
        model.set_moe_dispatch("padded")
        return "padded"
    if getattr(model.config, "num_local_experts", None):
        return "dropless (no set_moe_dispatch in this checkout)"
    return None


def build_meta_model(item: Item, layers: int):
    """Rank 0's shards on the meta device (the fake process group stays up: release() takes it down). An
    unsharded item gets a fake 8-way group too, never used by the model: record_generation's simulated mode
    plays rank 0 of at least 2 ranks."""
    import models
    import parallel
    from eval.simulator.replay import build_meta

    config = item_config(item, layers)
    if item.degrees:
        model = build_meta(item.arch, config, item.degrees)
    else:
        parallel.init_mesh(tp=8, fake=True)
        with torch.device("meta"):
            model = models.get(item.arch).model_class(config)
        model.to(torch.bfloat16).eval()
    set_dispatch(model)
    return model


def size_items(items: list[Item], s: Settings, errors: list) -> None:
    """Rank-0 weight bytes (bf16) of each item from its meta model; layers cut (to an even count) where the
    weights would pass --mem-frac of the GPU's memory."""
    from eval.simulator.replay import release

    budget = None
    if s.device.startswith("cuda"):
        budget = s.mem_frac * torch.cuda.get_device_properties(torch.device(s.device)).total_memory
    for item in items:
        item.layers = item.layers_full
        try:
            model = build_meta_model(item, item.layers_full)
            total = sum(p.numel() for p in model.parameters()) * 2
            in_layers = sum(p.numel() for p in model.model.layers.parameters()) * 2
        except Exception as err:  # noqa: BLE001 - reported, the item runs (and fails) later
            errors.append(error_record(f"{item.shape} {item.label}: sizing", err))
            continue
        finally:
            model = None
            release()
        per_layer = in_layers / item.layers_full
        if budget is not None and total > budget:
            fit = int((budget - (total - in_layers)) // per_layer) // 2 * 2
            item.layers = max(2, fit)
            item.notes.append(
                f"{item.layers} of {item.layers_full} layers: rank 0's {total / 1e9:.0f} GB of weights pass "
                f"{s.mem_frac:.0%} of the GPU's memory; predicted at the same layer count"
            )
        item.params_gb = (total - in_layers + per_layer * item.layers) / 1e9


def build_model(item: Item, layers: int, device: torch.device, dtype: torch.dtype):
    """Rank 0's shards materialised on `device` (eval.bench.generation.build_sharded; an unsharded item the
    same way without a mesh), random weights from the model's own init, the MoE dispatch set."""
    import models
    import parallel
    from eval.bench.generation import build_sharded
    from eval.simulator.replay import release

    release()
    if item.degrees:
        shape = {**load_shape(item.shape), "num_hidden_layers": layers}
        cfg = {
            "bench_shape": shape,
            "config_overrides": {item.arch: dict(item.overrides)},
            "seed": 0,
            "compile": False,
        }
        mesh = parallel.init_mesh(**item.degrees, fake=True)
        model = build_sharded(item.arch, cfg, item.degrees, mesh, device, dtype)
    else:
        with torch.device("meta"):
            model = models.get(item.arch).model_class(item_config(item, layers))
        model.to(dtype)
        model.to_empty(device=device)
        torch.manual_seed(0)
        with torch.no_grad():
            model.apply(model._init_weights)
        model.eval()
    return model, set_dispatch(model)


def free(device: torch.device) -> None:
    from eval.simulator.replay import release

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    release()
