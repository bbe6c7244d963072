"""Sequence parallelism (parallel/sequence.py): each rank's chunk == the unsharded computation.

- the ops on 2 and 4 gloo ranks (fp64, 1e-10): LASP-2 and LASP-1 == the quadratic reference of the whole
  sequence, outputs and dQ / dK / dV (and a learned decay's gradient, summed over the ranks as
  parallel.grad_sync sums it), with and without decay, with chunks of 6 tokens and a kernel chunk of 4;
  LASP-2H and ring attention == SDPA of the whole sequence (GQA, causal and left-padded), values and
  gradients; perturbing token j leaves every output before j bit-identical; comm.send_recv shifts a ring;
- the Linear-Llama (pure and "LLLN" hybrid, both sp methods) at sp 2 == one process: each chunk's
  logits, and every parameter's gradient after parallel.grad_sync;
- on a fake 4-way mesh, simulated: LASP-2's and LASP-1's counted bytes do not change when N doubles,
  ring attention's and LASP-2H's double; a forward issues the collectives the model's entry declares;
  `none` mode gives the real shapes and counts nothing;
- training `model=linear parallel=sp2` gives one process's loss curve and validation loss;
- bad input (N not divisible by P, an unknown sp_method, a tp degree) is one clear error each.
"""

import copy
import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import models
import parallel
from models.common.attention import make_causal_mask
from models.linear.ops import linear_attention_chunked, linear_attention_quadratic
from parallel import comm, sequence
from parallel.grad_sync import sync_gradients
from tests.distributed import run_ranks

TIGHT = dict(rtol=1e-10, atol=1e-10)
CHUNK = 6  # tokens per rank: not a multiple of the kernel's chunk
KERNEL_CHUNK = 4


def intra(q, k, v, log_decay):
    return linear_attention_chunked(q, k, v, log_decay, chunk_size=KERNEL_CHUNK)[0]


def _split(x, group, dim=2):
    return sequence.split_sequence(x, group, dim=dim)


# --- the ops on gloo ------------------------------------------------------------------------------------


def _linear_ops(rank, p, group):
    b, h, n, d = 2, 3, CHUNK * p, 4
    d_out = torch.randn(b, h, n, d + 1, dtype=torch.float64)
    for method in ("lasp2", "lasp1"):
        for decayed in (False, True):
            q, k = (torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
            v = torch.randn(b, h, n, d + 1, dtype=torch.float64, requires_grad=True)
            g = (-torch.rand(h, dtype=torch.float64) - 0.05).requires_grad_() if decayed else None
            reference = linear_attention_quadratic(q, k, v, g)
            ref_grads = torch.autograd.grad(reference, [x for x in (q, k, v, g) if x is not None], d_out)
            chunks = [_split(x.detach(), group).requires_grad_() for x in (q, k, v)]
            log_decay = g.detach().clone().requires_grad_() if decayed else None
            out = sequence.linear_attention(*chunks, group, log_decay, method=method, intra=intra)
            what = f"{method}, decay={decayed}, P={p}"
            torch.testing.assert_close(out, _split(reference.detach(), group), **TIGHT, msg=what)
            out.backward(_split(d_out, group))
            for chunk, ref in zip(chunks, ref_grads, strict=False):
                torch.testing.assert_close(chunk.grad, _split(ref, group), **TIGHT, msg=what)
            if decayed:  # each rank holds its uses' share: summed over sp, as parallel.grad_sync does
                total = comm.all_reduce(log_decay.grad, group).wait()
                torch.testing.assert_close(total, ref_grads[3], **TIGHT, msg=what)
            # Causality across ranks: perturbing token j (in the last rank's chunk) changes nothing before it.
            j = n - CHUNK // 2
            k2, v2 = k.detach().clone(), v.detach().clone()
            k2[:, :, j] += 1.0
            v2[:, :, j] -= 2.0
            with torch.no_grad():
                again = sequence.linear_attention(
                    _split(q.detach(), group),
                    _split(k2, group),
                    _split(v2, group),
                    group,
                    None if g is None else g.detach(),
                    method=method,
                    intra=intra,
                )
            before = max(0, min(CHUNK, j - rank * CHUNK))  # this rank's tokens that come before j
            assert torch.equal(again[:, :, :before], out.detach()[:, :, :before]), what


def _softmax_ops(rank, p, group):
    b, heads, kv_heads, n, d = 2, 4, 2, CHUNK * p, 8
    padding = torch.ones(b, n, dtype=torch.long)
    padding[0, :3] = 0  # row 0 is left-padded
    d_out = torch.randn(b, heads, n, d, dtype=torch.float64)
    for method in ("lasp2", "lasp1"):
        for padded in (False, True):
            q = torch.randn(b, heads, n, d, dtype=torch.float64, requires_grad=True)
            k, v = (torch.randn(b, kv_heads, n, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
            full_mask = make_causal_mask(padding if padded else None, n, 0, q.device)
            reference = F.scaled_dot_product_attention(
                q, k, v, attn_mask=full_mask, is_causal=full_mask is None, enable_gqa=True
            )
            ref_grads = torch.autograd.grad(reference, (q, k, v), d_out)
            # The mask the trunk gives this rank: keys up to the end of its chunk, diagonal offset by rank.
            seen = padding[:, : (rank + 1) * CHUNK] if padded else None
            mask = make_causal_mask(seen, CHUNK, 0, q.device, batch_size=b, q_offset=rank * CHUNK)
            chunks = [_split(x.detach(), group).requires_grad_() for x in (q, k, v)]
            out = sequence.softmax_attention(*chunks, group, mask, method=method)
            what = f"{method}, padded={padded}, P={p}"
            torch.testing.assert_close(out, _split(reference.detach(), group), **TIGHT, msg=what)
            out.backward(_split(d_out, group))
            for chunk, ref in zip(chunks, ref_grads, strict=True):
                torch.testing.assert_close(chunk.grad, _split(ref, group), **TIGHT, msg=what)


def _send_recv(rank, p, group):
    x = torch.full((2, 3), float(rank), requires_grad=True)
    y = comm.send_recv(x, group, shift=1).wait()
    assert torch.equal(y, torch.full((2, 3), float((rank - 1) % p)))
    (y * (rank + 1)).sum().backward()  # my value went to rank + 1, which scaled it by rank + 2
    assert torch.equal(x.grad, torch.full((2, 3), float((rank + 1) % p + 1)))


def _ops(rank, p):
    group = parallel.init_mesh(sp=p).get_group("sp")
    torch.manual_seed(0)  # every rank draws the same whole sequences, then takes its chunk
    _send_recv(rank, p, group)
    _linear_ops(rank, p, group)
    _softmax_ops(rank, p, group)


@pytest.mark.parametrize("p", [2, 4])
def test_ops_match_the_unsharded_references_on_gloo(p):
    run_ranks(_ops, p)


# --- the model on gloo ---------------------------------------------------------------------------------

MODEL_CASES = [
    ("linear", {"decay": "learned"}),
    ("linear", {"decay": "retnet", "sp_method": "lasp1"}),
    ("linear_hybrid", {}),  # "LLLN", lightning decay, LASP-2 + LASP-2H
    ("linear_hybrid", {"sp_method": "lasp1"}),  # LASP-1 + ring attention
]


def _model(rank, p):
    mesh = parallel.init_mesh(sp=p)
    group = mesh.get_group("sp")
    for name, overrides in MODEL_CASES:
        torch.manual_seed(0)
        config = models.get(name).tiny(chunk_size=KERNEL_CHUNK, **overrides)
        reference = models.get(name).model_class(config).double()
        model = copy.deepcopy(reference)
        parallel.parallelize(model, mesh)
        ids = torch.randint(0, config.vocab_size, (2, CHUNK * p))
        logits = reference(input_ids=ids, use_cache=False).logits
        weights = torch.randn_like(logits)  # the loss: sum of weights x logits, over the whole sequences
        (logits * weights).sum().backward()
        chunk_logits = model(input_ids=_split(ids, group, dim=1), use_cache=False).logits
        what = f"{name} {overrides}"
        torch.testing.assert_close(chunk_logits, _split(logits.detach(), group, dim=1), **TIGHT, msg=what)
        # Each rank's loss is its chunk's part x P: grad_sync's mean over sp is then the whole loss's gradient.
        (chunk_logits * _split(weights, group, dim=1)).sum().mul(p).backward()
        sync_gradients(model, mesh)
        expected = dict(reference.named_parameters())
        for param_name, param in model.named_parameters():
            torch.testing.assert_close(
                param.grad, expected[param_name].grad, **TIGHT, msg=f"{what}: {param_name}"
            )


def test_linear_models_at_sp2_match_one_process():
    run_ranks(_model, 2)


# --- counted bytes, declared collectives and `none` mode on a fake 4-way mesh ------------------------------


@pytest.fixture
def fake_sp4():
    """A 4-way sp mesh on the fake process group: this process is rank 0 of 4."""
    mesh = parallel.init_mesh(sp=4, fake=True)
    yield mesh
    dist.destroy_process_group()
    comm.set_mode("real")


def _counted(group, kind: str, method: str, n: int) -> dict:
    """Counters of one forward and backward of the `kind` ("linear" or "softmax") attention of `method` on
    chunks of n / 4 tokens (B 2, H 4, D 8; the softmax layer with 2 KV heads)."""
    b, h, c, d = 2, 4, n // 4, 8
    kv_heads = h if kind == "linear" else h // 2
    q = torch.randn(b, h, c, d, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, c, d, requires_grad=True) for _ in range(2))
    comm.reset_counters()
    if kind == "linear":
        out = sequence.linear_attention(q, k, v, group, method=method, intra=intra)
    else:
        out = sequence.softmax_attention(q, k, v, group, method=method)
    out.sum().backward()
    return comm.snapshot_counters()


def test_lasp_bytes_are_flat_in_n_ring_bytes_grow(fake_sp4):
    group, p = fake_sp4.get_group("sp"), 4
    with comm.use_mode("simulated", link="nvlink-h100") as clock:
        clock.start()
        counts = {
            (kind, method, n): _counted(group, kind, method, n)
            for kind in ("linear", "softmax")
            for method in ("lasp2", "lasp1")
            for n in (64, 128)
        }
        assert clock.busy_by["send_recv"] > 0 and clock.busy_by["all_gather"] > 0  # both on the link
    state = 2 * 4 * 8 * 8 * 4  # one rank's B x H states of d_k x d_v, fp32
    # LASP-2: one all-gather of the P states forward, one backward, whatever N.
    lasp2 = {"all_gather": {"calls": 2, "bytes": 2 * p * state}}
    assert counts["linear", "lasp2", 64] == counts["linear", "lasp2", 128] == lasp2
    # LASP-1: P-1 hops of one state each way.
    lasp1 = {"send_recv": {"calls": 2 * (p - 1), "bytes": 2 * (p - 1) * state}}
    assert counts["linear", "lasp1", 64] == counts["linear", "lasp1", 128] == lasp1
    # Ring attention and LASP-2H move K and V: twice the tokens, twice the bytes, as many calls.
    for method, kind in (("lasp1", "send_recv"), ("lasp2", "all_gather")):
        short, long = counts["softmax", method, 64][kind], counts["softmax", method, 128][kind]
        assert long["calls"] == short["calls"] and long["bytes"] == 2 * short["bytes"]
    # Ring attention: P-1 shifts of a K/V block [2, B, H_kv, C, D] forward; backward those again and the P
    # shifts of their (fp32) gradient accumulators.
    kv_block = 2 * 2 * 2 * 16 * 8 * 4
    assert counts["softmax", "lasp1", 64]["send_recv"] == {
        "calls": 3 * p - 2,
        "bytes": (3 * p - 2) * kv_block,
    }


@pytest.mark.parametrize("name", ["linear", "linear_hybrid"])
@pytest.mark.parametrize("method", ["lasp2", "lasp1"])
def test_a_forward_issues_the_declared_collectives(fake_sp4, name, method):
    entry = models.get(name)
    config = entry.tiny(sp_method=method)
    model = entry.model_class(config)
    parallel.parallelize(model, fake_sp4)
    with comm.use_mode("simulated", link="nvlink-h100"), torch.no_grad():
        comm.reset_counters()
        logits = model(input_ids=torch.zeros(2, 8, dtype=torch.long), use_cache=False).logits
    assert logits.shape == (2, 8, config.vocab_size)
    counted = {kind: c["calls"] for kind, c in comm.snapshot_counters().items()}
    declared = {kind: c.calls for kind, c in entry.collectives_per_forward(config, {"sp": 4}).items()}
    assert counted == declared


def test_none_mode_keeps_the_shapes_and_counts_nothing(fake_sp4):
    group = fake_sp4.get_group("sp")
    q, k, v = (torch.randn(2, 4, 8, 8, requires_grad=True) for _ in range(3))
    comm.reset_counters()
    with comm.use_mode("none"):
        for method in ("lasp2", "lasp1"):
            out = sequence.linear_attention(
                q, k, v, group, torch.full((4,), -0.1), method=method, intra=intra
            )
            out.sum().backward()
            assert out.shape == q.shape
            out = sequence.softmax_attention(q, k[:, :2], v[:, :2], group, method=method)
            out.sum().backward()
            assert out.shape == q.shape
    assert comm.snapshot_counters() == {}


# --- bad input -------------------------------------------------------------------------------------------


def test_bad_input_is_one_clear_error(fake_sp4):
    group = fake_sp4.get_group("sp")
    with pytest.raises(
        ValueError, match=r"N=10 tokens does not split over sp=4 ranks.*divisible by 4, e\.g\. 8 or 12"
    ):
        sequence.split_sequence(torch.zeros(2, 10), group)
    with pytest.raises(ValueError, match=r"N=3 tokens does not split over sp=4 ranks.*e\.g\. 4\.$"):
        sequence.split_sequence(torch.zeros(2, 3), group)
    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match=r"Unknown sp_method 'ulysses'; choose one of lasp2: .*; lasp1: "):
        sequence.linear_attention(q, q, q, group, method="ulysses", intra=intra)
    with pytest.raises(ValueError, match=r"Unknown sp_method 'ring'"):
        sequence.softmax_attention(q, q, q, group, method="ring")
    config = models.get("linear").tiny()
    with pytest.raises(ValueError, match=r"shards over sp or over tp, not both at once \(tp=2 with sp=2\)"):
        models.get("linear").check_layout(config, {"sp": 2, "tp": 2})
    models.get("linear").check_layout(config, {"dp": 2, "sp": 4, "tp": 1})


# --- training at sp 2 ------------------------------------------------------------------------------------

STEPS = 4
RUN = [
    "model=linear",
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "+model.config.chunk_size=8",  # the 16-token chunks of sp 2 are two kernel chunks; the 32 tokens four
    "data.seq_len=32",
    "data.batch_size=4",
    "trainer.limit_val_batches=2",
    "optimizer.warmup_steps=2",
    "logger=csv",
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=2",
    "callbacks.progress_bar=null",
]


def _metrics(run_dir: Path, key: str) -> list[float]:
    (path,) = run_dir.glob("csv/*/metrics.csv")
    return [float(row[key]) for row in csv.DictReader(path.open()) if row.get(key)]


def test_training_at_sp2_gives_the_one_process_loss_curve(tmp_path):
    # Imported here: the spawned ranks of the tests above import this module, and need none of it.
    from tests.test_train import compose_pretrain, subprocess_env
    from train.pretrain import train

    train(compose_pretrain(RUN, tmp_path / "one_process"))
    run_dir = tmp_path / "sp2"
    proc = subprocess.run(
        [sys.executable, "-m", "train.pretrain", f"hydra.run.dir={run_dir}", *RUN, "parallel=sp2"],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for key in ("train/loss", "val/loss"):
        one, sp2 = _metrics(tmp_path / "one_process", key), _metrics(run_dir, key)
        assert len(one) == len(sp2) >= 2, key
        torch.testing.assert_close(torch.tensor(sp2), torch.tensor(one), rtol=1e-5, atol=0, msg=key)
