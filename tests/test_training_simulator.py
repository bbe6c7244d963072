"""The speed simulator's training step, memory and layout planner (eval/simulator/training.py, memory.py, planner.py):
deterministic, FLOPs and state bytes by hand, FSDP2's collectives as FSDP2 issues them, predicted activation
memory against a real CPU run, and a planner whose best layout fits and whose rejected ones do not."""

import math

import pytest
import torch

import models
from eval.simulator.device import DeviceModel, get_device
from eval.simulator.memory import predict_training_memory
from eval.simulator.planner import links_for, plan_training, strides
from eval.simulator.training import OPTIMIZER_BYTES_PER_PARAM, TrainLayout, record_training

H100 = DeviceModel(get_device("h100-sxm"))


def _llama():
    return models.get("llama").tiny()


def test_two_runs_identical():
    layout = TrainLayout(dp=2, tp=2, micro_batch=2, seq_len=32, ac="selective")
    a = record_training("llama", _llama(), layout).predict(H100, "nvlink-h100")
    b = record_training("llama", _llama(), layout).predict(H100, "nvlink-h100")
    assert a == b


def _hand_flops(c, batch: int, seq: int) -> tuple[float, float, float]:
    """(forward, backward, one layer stack's forward) matmul + attention FLOPs of the tiny llama, by hand."""
    t, d, f, v = batch * seq, c.hidden_size, c.intermediate_size, c.vocab_size
    hd = d // c.num_attention_heads
    linears = d * (d + 2 * c.num_key_value_heads * hd) + d * d + 3 * d * f  # q k v, o, gate up down
    attention = 4 * batch * c.num_attention_heads * seq * seq * hd // 2  # causal: half the square
    layer_fwd = 2 * t * linears + attention
    layers_fwd = c.num_hidden_layers * layer_fwd
    head = 2 * t * d * v
    forward = layers_fwd + head
    # Backward: two matmuls per forward matmul (input and weight gradients); flash attention's 2.5x its forward.
    backward = c.num_hidden_layers * (2 * 2 * t * linears + attention * 5 / 2) + 2 * head
    return forward, backward, layers_fwd


@pytest.mark.parametrize("ac", ["none", "full"])
def test_step_flops_by_hand(ac):
    """Recorded FLOPs = forward + backward (2x every matmul, 2.5x flash attention) + full AC's recomputed layers."""
    c = _llama()
    layout = TrainLayout(micro_batch=2, seq_len=32, ac=ac)
    run = record_training("llama", c, layout)
    forward, backward, layers = _hand_flops(c, 2, 32)
    expected = forward + backward + (layers if ac == "full" else 0)
    assert sum(run.clock.flops) == pytest.approx(expected, rel=1e-9)


def test_fsdp_collectives_where_fsdp2_issues_them():
    """Per micro-batch: the root and every layer gathered for the forward, every layer again for the backward
    (reshard_after_forward), every unit reduce-scattered once; fewer gathers without resharding."""
    c = _llama()
    n = c.num_hidden_layers

    def kinds(**kw):
        run = record_training("llama", c, TrainLayout(dp=4, micro_batch=1, seq_len=16, **kw))
        issued = [args[0] for name, args, _ in run.recorder.calls if name == "issue"]
        return {k: issued.count(k) for k in set(issued)}

    assert kinds() == {"all_gather": 1 + 2 * n, "reduce_scatter": n + 1}
    assert kinds(reshard_after_forward=False) == {"all_gather": 1 + n, "reduce_scatter": n + 1}
    assert kinds(fsdp=False) == {"all_reduce": 1}


def test_replicated_trainer_reduces_experts_over_dp_only():
    """Without FSDP (parallel.grad_sync): the replicated gradients all-reduced over dp x ep, the experts' over dp."""
    run = record_training("moe", models.get("moe").tiny(), TrainLayout(dp=2, ep=2, fsdp=False, seq_len=16))
    issued = [(args[0], args[2]) for name, args, _ in run.recorder.calls if name == "issue" and args[0] == "all_reduce"]
    assert issued[-2:] == [("all_reduce", 4), ("all_reduce", 2)]


def test_grad_accumulation_and_optimizer():
    c = _llama()
    one = record_training("llama", c, TrainLayout(dp=2, seq_len=16)).predict(H100, "nvlink-h100")
    four = record_training("llama", c, TrainLayout(dp=2, seq_len=16, grad_accum=4)).predict(
        H100, "nvlink-h100"
    )
    assert four["step_s"] == pytest.approx(4 * one["micro_batch_s"] + one["optimizer_s"])
    assert four["tokens_per_s_per_device"] > one["tokens_per_s_per_device"]  # the optimizer paid once per 4


@pytest.mark.parametrize(
    "layout",
    [TrainLayout(dp=1, seq_len=16), TrainLayout(dp=4, seq_len=16), TrainLayout(dp=2, tp=2, seq_len=16),
     TrainLayout(dp=4, fsdp=False, seq_len=16)],
    ids=["one", "fsdp4", "fsdp2_tp2", "replicated4"],
)  # fmt: skip
def test_state_bytes_by_hand(layout):
    """Parameters, gradients (fp32) and AdamW's two moments of this rank's shard, exactly, at each sharding."""
    c = _llama()
    d, f, v, hd = c.hidden_size, c.intermediate_size, c.vocab_size, c.hidden_size // c.num_attention_heads
    tp = layout.tp
    per_layer = (d * d + 2 * d * c.num_key_value_heads * hd + d * d + 3 * d * f) // tp + 2 * d  # + two norms
    total = c.num_hidden_layers * per_layer + 2 * v * d + d  # embed, head (not tied), final norm
    # FSDP2 shards each parameter on dim 0 into F chunks of ceil(rows / F) rows: rank 0 holds a full chunk.
    memory = predict_training_memory("llama", c, layout)
    f_size = layout.fsdp_size
    if f_size == 1:
        assert memory.params_bytes == 4 * total
    else:
        assert memory.params_bytes == pytest.approx(4 * total / f_size, rel=0.02)
    assert memory.grads_bytes == memory.params_bytes
    assert memory.optimizer_bytes == 2 * memory.params_bytes
    run = record_training("llama", c, layout)
    assert run.shard_params * 4 == pytest.approx(memory.params_bytes, rel=0.02)
    assert OPTIMIZER_BYTES_PER_PARAM * run.shard_params > 0


def _measured_saved_bytes(arch: str, config, seq: int, batch: int) -> int:
    """Bytes of the tensors a real CPU forward saves for its backward (unique storages, parameters excluded), the
    model in bf16 as the memory replay runs the replicated trainer: what `saved_activations_bytes` predicts."""
    torch.manual_seed(0)
    model = models.get(arch).model_class(config).to(torch.bfloat16).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    ids = torch.randint(0, config.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    del loss
    return sum(storages.values())


@pytest.mark.parametrize("arch", ["llama", "moe", "linear"])
def test_activation_memory_against_a_real_run(arch):
    """Predicted (fake tensors, PyTorch's MemTracker) vs measured (a real CPU forward's saved tensors): within 10%."""
    config = models.get(arch).tiny(vocab_size=256)
    seq, batch = 64, 4
    predicted = predict_training_memory(arch, config, TrainLayout(seq_len=seq, micro_batch=batch, fsdp=False))
    measured = _measured_saved_bytes(arch, models.get(arch).tiny(vocab_size=256), seq, batch)
    assert predicted.saved_activations_bytes == pytest.approx(measured, rel=0.10)


def test_ac_lowers_activation_memory():
    c = _llama()
    peaks = {ac: predict_training_memory("llama", c, TrainLayout(seq_len=64, micro_batch=4, ac=ac)).saved_activations_bytes
             for ac in ("none", "selective", "full")}  # fmt: skip
    assert peaks["full"] < peaks["selective"] < peaks["none"]


def test_links_by_node():
    """A group inside a node runs on NVLink, one spanning nodes on the hierarchical link."""
    layout = TrainLayout(dp=16, tp=4)
    assert strides(layout.degrees) == {"tp": 1, "sp": 4, "ep": 4, "dp": 4}
    links = links_for(layout, 8, "nvlink-h100", "ib-hdr-200g")
    assert links["tp"].name == "nvlink-h100"
    assert links["fsdp"].name == "nvlink-h100+ib-hdr-200g" and links["fsdp"].ranks_per_node == 2
    assert links_for(TrainLayout(dp=2, tp=4), 8, "nvlink-h100", "ib-hdr-200g")["fsdp"].name == "nvlink-h100"


def _deep(arch: str, layers: int = 8):
    """The tiny config of `arch` at `layers` layers, deep enough for shallow stacks to be shorter: Ladder's schedule
    over the last half of 12 (two segments), a hybrid at 16 (its pattern's period is 4); GQLA on its TP path."""
    c = models.get(arch).tiny()
    fields = {**c.to_dict(), "num_hidden_layers": 16 if len(getattr(c, "layer_pattern", "")) > 1 else layers}
    if "ladder_layers" in fields and fields.get("residual", "ladder") == "ladder":
        fields["num_hidden_layers"] = max(fields["num_hidden_layers"], 12)
        fields["ladder_layers"] = fields["num_hidden_layers"] // 2
    if "attn_path" in fields:
        fields["attn_path"] = "gqa"
    return type(c).from_dict(fields)


STACK_LAYOUTS = [
    TrainLayout(dp=2, tp=2, micro_batch=1, seq_len=32, ac="none"),
    TrainLayout(dp=4, micro_batch=2, seq_len=32, ac="full"),
    TrainLayout(dp=2, tp=2, micro_batch=1, seq_len=32, ac="selective", fsdp=False),
]


# Every architecture; the default run keeps one of each way the layers repeat (plain, ladder segments, a first
# layer apart, MoE every other layer), the rest are slow.
STACK_DEFAULT = ("llama", "ladder", "moepp", "scmoe")


@pytest.mark.parametrize(
    "arch", [a if a in STACK_DEFAULT else pytest.param(a, marks=pytest.mark.slow) for a in models.ZOO]
)
def test_shallow_stacks_give_the_full_replay(arch):
    """A step's time and peak memory from replays of shallow stacks (eval.simulator.stack) equal the full depth's
    replay: fp64 sums, so to rounding (rel 1e-9)."""
    from eval.simulator import stack

    config = _deep(arch)
    terms = {settle: stack.stack_terms(arch, config, settle) for settle in (stack.TIME_SETTLE, stack.MEMORY_SETTLE)}
    for found in terms.values():
        assert len(found) > 1 and all(c.num_hidden_layers < config.num_hidden_layers for c, _ in found)  # shortened
    layout = STACK_LAYOUTS[list(models.ZOO).index(arch) % len(STACK_LAYOUTS)]
    fast = stack.predict_training(arch, terms[stack.TIME_SETTLE], layout, H100, "nvlink-h100")
    full = record_training(arch, config, layout).predict(H100, "nvlink-h100")
    for key in ("step_s", "exposed_s", "tokens_per_s_per_device", "mfu"):
        assert fast[key] == pytest.approx(full[key], rel=1e-9), key
    fast_memory = stack.predict_training_memory(arch, terms[stack.MEMORY_SETTLE], layout)
    full_memory = predict_training_memory(arch, config, layout)
    assert fast_memory.peak_bytes == pytest.approx(full_memory.peak_bytes, rel=1e-9)


def test_planner_best_fits_and_rejected_do_not():
    c = _llama()
    kw = dict(gpus=4, gpus_per_node=4, device=H100, seq_len=32, global_batch_tokens=4 * 2 * 32,
              micro_batches=(1, 2), ac_modes=("none", "full"), fsdp=(True,), tp=[1, 2], show_progress=False)  # fmt: skip
    everything = {r["label"]: r for r in plan_training("llama", c, memory_gib=1e6, prune=False, **kw)["rows"]}
    assert all(math.isfinite(r["mfu"]) and 0 < r["mfu"] < 1 for r in everything.values())
    peaks = sorted(r["peak_gib"] for r in everything.values())
    bound = peaks[len(peaks) // 2]  # about half the layouts fit
    plan = plan_training("llama", c, memory_gib=bound, **kw)
    assert plan["best"] is not None and plan["best"]["peak_gib"] <= bound
    assert all(r["peak_gib"] > bound for r in plan["rows"] if not r["fits"] and not r["not_replayed"])
    assert all(r["peak_gib"] <= bound for r in plan["rows"] if r["fits"])
    assert any(not r["fits"] for r in plan["rows"])
    fitting = [r["tokens_per_s_per_device"] for r in everything.values() if r["peak_gib"] <= bound]
    assert plan["best"]["tokens_per_s_per_device"] == max(fitting)
    # Pruned (the default): the layouts that do not fit are not timed, nor replayed in memory where a lighter one
    # (a smaller micro-batch, more checkpointing) is over the bound already; the others as when all are replayed.
    assert any(r["not_replayed"] for r in plan["rows"])
    for row in plan["rows"]:
        full = everything[row["label"]]
        if row["not_replayed"]:
            assert row["peak_gib"] is None and not row["fits"] and full["peak_gib"] > bound
        else:
            assert row["peak_gib"] == full["peak_gib"]
        assert row["tokens_per_s_per_device"] == (full["tokens_per_s_per_device"] if row["fits"] else None)


def test_planner_rows_equal_full_replays(monkeypatch):
    """The planner's rows from shallow stacks, on two worker processes, are the rows of full-depth replays in one."""
    import eval.simulator.planner as planner

    config = _deep("moe")
    kw = dict(gpus=4, gpus_per_node=2, device=H100, seq_len=32, global_batch_tokens=8 * 32, micro_batches=(1, 2),
              ac_modes=("none", "full"), fsdp=(True,), ep=[2], memory_gib=1e6, show_progress=False)  # fmt: skip
    fast = plan_training("moe", config, workers=2, **kw)["rows"]
    monkeypatch.setattr(planner, "stack_terms", lambda arch, config, settle: [(config, 1.0)])
    full = plan_training("moe", config, **kw)["rows"]
    assert len(fast) >= 4 and [r["label"] for r in fast] == [r["label"] for r in full]
    for a, b in zip(fast, full, strict=True):
        for key in ("tokens_per_s_per_device", "mfu", "step_s", "exposed_s", "peak_gib"):
            assert a[key] == pytest.approx(b[key], rel=1e-9), (a["label"], key)


@pytest.mark.parametrize("task", ["train", "generate"])
def test_plan_app(tmp_path, task):
    """`python -m eval.plan` end to end at the tiny shape: the report, the JSON and the best layout's command."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from eval.plan import run_plan
    from eval.simulator.heldout import _BENCH_YAML

    overrides = ["model=llama", "bench_shape=tiny", "gpus=2", "gpus_per_node=2", "seq_len=32", "micro_batches=[1]",
                 "ac=[none]", f"task={task}", "generate.batch=2", "generate.prompt_len=8", "generate.new_tokens=4"]  # fmt: skip
    with initialize_config_dir(str(_BENCH_YAML.parent), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("plan", overrides=overrides), resolve=False)
    result = run_plan(cfg, tmp_path)
    assert result["best"] is not None and result["best"]["fits"]
    assert (tmp_path / "README.md").read_text().count(result["best"]["label"]) >= 1
    assert (tmp_path / "plan.png").exists() and (tmp_path / "plan.json").exists()
    if task == "train":
        assert "-m train.pretrain model=llama" in result["command"] and "parallel.dp=" in result["command"]
    else:
        assert {r["label"] for r in result["rows"]} >= {"1 GPU", "tp2"}


def test_bench_training_section(tmp_path):
    """`eval.bench bench_preset=train`: each layout predicted and measured side by side; the predicted row is the
    training replay's own prediction, the measured row a real step of this machine."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from eval.bench.app import run_bench, settings_of
    from eval.simulator.heldout import _BENCH_YAML, device_model

    overrides = ["bench_preset=train", "bench_shape=tiny", "archs=[llama,ladder]", "training.seq_len=32",
                 "training.repeats=1", "training.warmup=0", "training.ac=[none]", "training.layouts=[{dp: 2}]"]  # fmt: skip
    with initialize_config_dir(str(_BENCH_YAML.parent), version_base="1.3"):
        plain = OmegaConf.to_container(compose("bench", overrides=overrides), resolve=False)
    results = run_bench(settings_of(plain), tmp_path)
    rows = results["training"]
    assert [(r["arch"], r["compute"]) for r in rows] == [
        ("llama", "h100-sxm"), ("llama", "measured (this CPU)"), ("ladder", "h100-sxm"), ("ladder", "measured (this CPU)")
    ]
    layout = TrainLayout(dp=2, micro_batch=2, seq_len=32)
    config = models.get("llama").bench_config({k: v for k, v in plain["bench_shape"].items() if k != "name"}, {})
    expected = record_training("llama", config, layout).predict(device_model("h100-sxm"), "nvlink-h100")
    assert rows[0]["step_ms"] == pytest.approx(1e3 * expected["step_s"])
    assert rows[1]["step_ms"] > 0 and rows[1]["achieved_tflops"] > 0
    assert "## Training steps" in (tmp_path / "README.md").read_text()


def test_inference_memory_static_cache_by_hand():
    """Generation's memory: the weights in bf16 and the static K/V cache of max_len tokens (2 x layers x batch x
    max_len x KV heads x head_dim x 2 bytes), at TP 1 and TP 2 (each rank its KV heads)."""
    from eval.simulator.memory import predict_inference_memory

    c = _llama()
    hd = c.hidden_size // c.num_attention_heads
    for tp in (1, 2):
        m = predict_inference_memory("llama", models.get("llama").tiny_at({"tp": tp}), {"tp": tp}, batch=3, prompt_len=8, max_len=64)
        cache = 2 * c.num_hidden_layers * 3 * 64 * (c.num_key_value_heads // tp) * hd * 2
        assert m["cache_and_state_bytes"] >= cache
        assert m["cache_and_state_bytes"] == pytest.approx(cache, rel=0.05)  # + the cache's fill level, the prompt
        assert m["peak_bytes"] >= m["weights_bytes"] + cache


@pytest.mark.parametrize("degrees", [{"dp": 2, "ep": 2}, {"ep": 2}], ids=["dp2_ep2", "ep2"])
def test_moe_memory_and_step_at_expert_parallel_layouts(degrees):
    """FSDP2 over dp x ep with the experts over dp (their own flattened mesh, made before the fake mode), or left
    out of FSDP at dp 1 (fp32 experts under bf16 mixed precision): memory and time replay; the experts' shards by
    hand (4 local experts' weights of 2 on this ep rank, over dp)."""
    c = models.get("moe").tiny()
    layout = TrainLayout(**degrees, seq_len=32)
    memory = predict_training_memory("moe", c, layout)
    run = record_training("moe", c, layout)
    moe_layers = c.num_hidden_layers // c.moe_layer_freq
    local_experts = 3 * c.hidden_size * c.intermediate_size * c.num_local_experts // layout.ep * moe_layers
    replicated = run.all_params - local_experts * layout.ep
    assert run.shard_params == replicated // (layout.dp * layout.ep) + local_experts // layout.dp
    assert run.shard_params * 4 == pytest.approx(memory.params_bytes, rel=0.02)
    assert run.predict(H100, "nvlink-h100")["step_s"] > 0


@pytest.mark.parametrize("arch", ["scmoe", "kraken", "ladder"])
def test_memory_replay_of_units_of_several_modules(arch):
    """Architectures whose FSDP2 units are a layer's weight-owning modules (parallel.fsdp.unit_modules) replay under
    FSDP2 (ScMoE's router reads its gate's weight outside the gate's forward: FSDPMemTracker loses that gather)."""
    c = models.get(arch).tiny_at({"tp": 1})
    memory = predict_training_memory(arch, c, TrainLayout(dp=2, seq_len=32))
    assert memory.activations_bytes > 0 and memory.peak_bytes > memory.params_bytes + memory.optimizer_bytes


@pytest.mark.parametrize("arch", ["llama", "moe_ladder"])
def test_the_planned_command_runs_as_printed(tmp_path, arch):
    """The best layout's `train.pretrain` overrides compose, pass the pretraining checks and build the model they
    name (the plan's fields added with ++, a ladder variant under its sibling's group)."""
    import shlex

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from eval.plan import run_plan
    from eval.simulator.heldout import _BENCH_YAML
    from train.module import CausalLMModule
    from train.pretrain_checks import check_config

    model = [f"model={arch}"] if arch == "llama" else ["model=moe", f"model.name={arch}"]
    overrides = [*model, "bench_shape=tiny", "bench_shape.vocab_size=8192", "gpus=2", "gpus_per_node=2",
                 "seq_len=32", "micro_batches=[1]", "ac=[none]", "task=train"]  # fmt: skip
    with initialize_config_dir(str(_BENCH_YAML.parent), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("plan", overrides=overrides), resolve=False)
        printed = run_plan(cfg, tmp_path)["command"]
        args = shlex.split(printed.split("-m train.pretrain", 1)[1])
        pretrain = compose("pretrain", overrides=[*args, "trainer=cpu", f"paths.output_dir={tmp_path / 'run'}"])
    check_config(pretrain)
    module = CausalLMModule(
        model_name=pretrain.model.name, model_config=OmegaConf.to_container(pretrain.model.config, resolve=True),
        vocab_size=8192, optimizer=OmegaConf.to_container(pretrain.optimizer, resolve=True),
    )
    assert module.model.config.num_hidden_layers == 4 and module.model.config.vocab_size == 8192
    assert (getattr(module.model.config, "residual", "standard") == "ladder") == arch.endswith("_ladder")


def _plan_cfg(*overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from eval.simulator.heldout import _BENCH_YAML

    with initialize_config_dir(str(_BENCH_YAML.parent), version_base="1.3"):
        return OmegaConf.to_container(compose("plan", overrides=["bench_shape=tiny", "gpus=2", "gpus_per_node=2",
                                                                 "seq_len=32", *overrides]), resolve=False)  # fmt: skip


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["compute=measured"], r"compute='measured' measures on this machine .* eval.plan predicts for one of"),
        (["global_batch_tokens=-8192"], r"global_batch_tokens=-8192 must be null or a positive multiple of seq_len"),
        (["task=generate", "generate.latency_ms=-1"], r"generate.latency_ms=-1 must be null .* positive"),
        (["task=generate", "generate.batch=0"], r"generate.batch=0 must be an integer >= 1"),
    ],
)
def test_plan_inputs_out_of_range_are_one_error(tmp_path, overrides, message):
    from eval.plan import run_plan

    with pytest.raises(ValueError, match=message):
        run_plan(_plan_cfg(*overrides), tmp_path)


def test_no_layout_says_when_only_the_latency_bound_misses(tmp_path):
    from eval.plan import no_layout, run_plan

    cfg = _plan_cfg("task=generate", "generate.batch=2", "generate.prompt_len=8", "generate.new_tokens=4",
                    "generate.latency_ms=0.000001")
    result = run_plan(cfg, tmp_path)
    assert result["best"] is None and any(r["fits"] for r in result["rows"])
    assert no_layout(result, cfg).startswith("No layout meets generate.latency_ms=1e-06: the fastest decode step")
    assert "No layout meets generate.latency_ms" in (tmp_path / "README.md").read_text()
