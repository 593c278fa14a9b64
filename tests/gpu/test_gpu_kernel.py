"""GPU suite for the CuteDSL step kernel (skipped without CUDA).

Run on a GPU machine with ``bash bench/gpu_all.sh`` (this suite + the GPU benchmark), or
``python -m pytest -q tests/gpu``. Passed on an H200 (2026-11-27): docs/performance.md, section 4.

* Parity: pool mode is bit-identical (torch.equal on the bits) to gather -> dense kernel ->
  scatter, for every batch size 1..32 plus 64 and 256, pools of 37 and 1000 rows, with and
  without update_kv_state and dst_state_batch_indices, trailing and interleaved padding of
  all three kinds, poisoned unread rows, untouched rows checked bit for bit
  (helpers.check_pool_parity with the CUDA kernel as step function).
* Accuracy: error vs the float64 reference <= 2x PyTorch-float32's error + a small atol,
  for every supported N, D and R and every state / B-x dtype.
* No memory outside the pools is touched, whatever the indices hold (guard zones).
* A padded step captured in a CUDA graph and replayed with new indices and inputs equals eager.
* Multi-token steps (T in 1..8, every index form, both index layouts): bit-identical to T one-token
  dense kernel steps on the gathered rows; accurate against float64 for every state dtype; a
  captured speculative step replays like eager.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (PAD_KINDS, assert_accurate, assert_bits_equal, check_pool_parity, clone_inputs, make_inputs,
                      make_pool_indices, poison_)

from mamba3_step import mamba3_step_fn
from mamba3_step.contract import source_rows
from mamba3_step.reference import mamba3_step_reference
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import speculative_indices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
# The flagship specialisation (D=64, N=128, R=4; H is a runtime size) with few heads: parity is
# about indexing, not size, and a 1000-row pool stays small to build and poison.
SHAPE = dict(H=2, D=64, N=128, R=4)
BATCHES = list(range(1, 33)) + [64, 256]


def _n_pad(B: int) -> int:
    return B // 3 if B >= 3 else (1 if B == 2 else 0)


# Mode combinations (update_kv_state, with_dst, padding layout). Every (batch, pool) pair runs two
# of them and every combination runs with every batch-size residue, so the suite covers all of it
# in 136 cases instead of the 544 of the full cross product (which --full-matrix runs).
COMBOS = [(kv, dst, layout) for kv in (False, True) for dst in (False, True) for layout in ("trailing", "interleaved")]


def _parity_cases(full: bool):
    for P in (37, 1000):  # a pool smaller than the biggest batches, and a roomy one
        for B in BATCHES:
            picks = range(len(COMBOS)) if full else (B % 8, (B + 4) % 8)
            for i in picks:
                kv, dst, layout = COMBOS[i]
                yield pytest.param(P, B, kv, dst, layout, id=f"P{P}-B{B}-kv{kv:d}-dst{dst:d}-{layout}")


@pytest.mark.parametrize("P,B,update_kv_state,with_dst,layout", list(_parity_cases(False)))
def test_pool_parity_against_gather_dense_scatter(P, B, update_kv_state, with_dst, layout):
    _parity(P, B, update_kv_state, with_dst, layout)


@pytest.mark.full_matrix
@pytest.mark.parametrize("P,B,update_kv_state,with_dst,layout", list(_parity_cases(True)))
def test_pool_parity_full_cross_product(P, B, update_kv_state, with_dst, layout):
    _parity(P, B, update_kv_state, with_dst, layout)


def _parity(P, B, update_kv_state, with_dst, layout):
    inputs = make_inputs(B, P, **SHAPE, seed=B * 1000 + P, device=DEV)
    src, dst, kinds = make_pool_indices(B, P, n_pad=_n_pad(B), layout=layout, null_slot_id=P // 2,
                                        with_dst=with_dst, seed=B + P, device=DEV)
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=P // 2, update_kv_state=update_kv_state,
                      seed=B)


def _kernel_and_references(inputs: dict, indices: dict) -> tuple:
    """One step three ways on copies of ``inputs``: the kernel, the float64 reference (inputs
    promoted) and PyTorch-float32; each as (its tensors after the step, its out)."""
    ref64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
             for k, v in clone_inputs(inputs).items()}
    out64 = mamba3_step_reference(StepTensors(**ref64, **indices), compute_dtype=torch.float64)
    t32 = clone_inputs(inputs)
    out32 = mamba3_step_reference(StepTensors(**t32, **indices), compute_dtype=torch.float32)
    run = clone_inputs(inputs)
    out = mamba3_step_fn(**run, **indices)
    torch.cuda.synchronize()
    return (run, out), (ref64, out64), (t32, out32)


def _accuracy_case(B, P, shape, dtypes, seed):
    inputs = make_inputs(B, P, **shape, dtypes=dtypes, seed=seed, device=DEV)
    src, dst, kinds = make_pool_indices(B, P, n_pad=2, layout="interleaved", pad_kinds=("negative", "oob"),
                                        seed=seed, device=DEV)
    (run, out), (ref64, out64), (t32, out32) = _kernel_and_references(inputs, dict(state_batch_indices=src))
    live = torch.tensor([k == "live" for k in kinds], device=DEV)
    rows = src[live].long()
    scale_out = out64.abs().max().item()
    scale_state = ref64["state"][rows].abs().max().item()
    assert_accurate("out", out, out64, out32, scale_out)
    assert_accurate("state", run["state"][rows], ref64["state"][rows], t32["state"][rows], scale_state)
    assert_bits_equal(out[~live], torch.zeros_like(out[~live]), "padding lanes' out")


@pytest.mark.parametrize("N", [32, 64, 128, 256])
def test_accuracy_every_N(N):
    _accuracy_case(9, 20, dict(H=3, D=64, N=N, R=4), {}, seed=N)


@pytest.mark.parametrize("D", [32, 64, 128])
def test_accuracy_every_D(D):
    _accuracy_case(9, 20, dict(H=3, D=D, N=128, R=4), {}, seed=D + 1)


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_accuracy_every_R(R):
    _accuracy_case(9, 20, dict(H=3, D=64, N=128, R=R), {}, seed=R + 2)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16", "float32"])
def test_accuracy_every_dtype(state_dtype, kv_dtype):
    _accuracy_case(9, 20, dict(H=2, D=64, N=64, R=2),
                   dict(state_dtype=state_dtype, kv_dtype=kv_dtype, x_dtype=kv_dtype, proj_dtype=kv_dtype),
                   seed=7)


@pytest.mark.parametrize("has_z,has_outproj", [(False, False), (True, False), (False, True)])
def test_parity_without_z_or_outproj(has_z, has_outproj):
    inputs = make_inputs(12, 30, **SHAPE, has_z=has_z, has_outproj=has_outproj, seed=3, device=DEV)
    src, dst, kinds = make_pool_indices(12, 30, n_pad=4, null_slot_id=0, with_dst=True, seed=5, device=DEV)
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=0, update_kv_state=True)


def test_dense_state_out_matches_in_place():
    inputs = make_inputs(10, None, **SHAPE, seed=4, device=DEV)
    a, b = clone_inputs(inputs), clone_inputs(inputs)
    state_out = poison_(torch.empty_like(a["state"]))
    before = a["state"].clone()
    out_a = mamba3_step_fn(**a, state_out=state_out)
    out_b = mamba3_step_fn(**b)
    assert_bits_equal(out_a, out_b, "out")
    assert_bits_equal(state_out, b["state"], "state_out vs in-place state")
    assert_bits_equal(a["state"], before, "state untouched when state_out is given")


def test_tile_D_smaller_than_headdim_matches_default():
    inputs = make_inputs(6, 12, H=2, D=128, N=64, R=2, seed=9, device=DEV)
    src = torch.tensor([3, -1, 0, 11, 12, 5], dtype=torch.int32, device=DEV)
    a, b = clone_inputs(inputs), clone_inputs(inputs)
    out_a = mamba3_step_fn(**a, state_batch_indices=src, tile_D=32, num_warps=2)
    out_b = mamba3_step_fn(**b, state_batch_indices=src)
    # tiling changes no arithmetic order: same bits
    assert_bits_equal(out_a, out_b, "out")
    assert_bits_equal(a["state"], b["state"], "state")


def test_no_access_outside_the_pools_whatever_the_indices():
    """Pools are views into larger poisoned buffers; extreme indices leave the guard zones alone."""
    P, B = 9, 8
    inputs = make_inputs(B, P, **SHAPE, seed=12, device=DEV)
    guarded = {}
    for key in ("state", "Bstate", "Xstate"):
        t = inputs[key]
        row = t[0].numel()
        buf = poison_(torch.empty((P + 4) * row, dtype=t.dtype, device=DEV), seed=len(key))
        view = buf[2 * row:(P + 2) * row].view(t.shape)
        view.copy_(t)
        inputs[key] = view
        guarded[key] = (buf, buf.clone(), row)
    src = torch.tensor([-(2**31), -1, P, P + 1, 2**31 - 1, 2, -2, 0], dtype=torch.int32, device=DEV)
    dst = torch.tensor([0, 1, 2, 3, 4, -(2**31), 2**31 - 1, 5], dtype=torch.int32, device=DEV)
    mamba3_step_fn(**inputs, state_batch_indices=src, dst_state_batch_indices=dst, update_kv_state=True)
    torch.cuda.synchronize()
    for key, (buf, before, row) in guarded.items():
        assert_bits_equal(buf[:2 * row], before[:2 * row], f"{key} guard before the pool")
        assert_bits_equal(buf[(P + 2) * row:], before[(P + 2) * row:], f"{key} guard after the pool")
        pool_now, pool_before = buf[2 * row:(P + 2) * row].view(-1, row), before[2 * row:(P + 2) * row].view(-1, row)
        changed = {int(r) for r in (pool_now != pool_before).any(1).nonzero().flatten().tolist()}
        assert changed <= {5}, (key, changed)  # lane 7 reads row 0 and writes row 5; lane 5's dst is padding


def test_batch_zero_launches_nothing():
    inputs = make_inputs(0, 5, **SHAPE, seed=1, device=DEV)
    before = clone_inputs(inputs)
    out = mamba3_step_fn(**inputs, state_batch_indices=torch.empty(0, dtype=torch.int32, device=DEV))
    assert out.shape[0] == 0
    for key in ("state", "Bstate", "Xstate"):
        assert_bits_equal(inputs[key], before[key], key)


def test_batch_and_pool_size_changes_do_not_recompile():
    from mamba3_step import compile_cache

    inputs = make_inputs(3, 7, **SHAPE, seed=2, device=DEV)
    mamba3_step_fn(**inputs, state_batch_indices=torch.tensor([0, 1, -1], dtype=torch.int32, device=DEV))
    before = compile_cache.stats()["compiles"]
    for B, P in [(1, 7), (17, 40), (64, 500)]:
        inputs = make_inputs(B, P, **SHAPE, seed=B, device=DEV)
        idx = torch.arange(B, dtype=torch.int32, device=DEV) % P
        idx[-1] = -1
        mamba3_step_fn(**inputs, state_batch_indices=idx)
    assert compile_cache.stats()["compiles"] == before


def test_cuda_graph_replay_with_new_indices_and_inputs_equals_eager():
    """Capture a padded step, then replay it with new indices and inputs copied into the
    static buffers; compare with eager calls on identical copies, bit for bit."""
    B, P = 16, 40
    static = make_inputs(B, P, **SHAPE, seed=30, device=DEV)
    idx = torch.full((B,), -1, dtype=torch.int32, device=DEV)
    out = torch.empty(B, SHAPE["H"], SHAPE["D"], dtype=static["x"].dtype, device=DEV)
    kwargs = dict(state_batch_indices=idx, null_slot_id=0, update_kv_state=True)
    mamba3_step_fn(**clone_inputs(static), out=out.clone(), **kwargs)  # compile + warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mamba3_step_fn(**static, out=out, **kwargs)
    for step in range(3):
        fresh = make_inputs(B, P, **SHAPE, seed=100 + step, device=DEV)
        src, _, kinds = make_pool_indices(B, P, n_pad=5, layout="trailing", null_slot_id=0, seed=step, device=DEV)
        eager = clone_inputs(static)
        for key in ("A", "B", "C", "x", "dt", "trap", "z"):
            static[key].copy_(fresh[key])
            eager[key].copy_(fresh[key])
        idx.copy_(src)
        graph.replay()
        eager_out = mamba3_step_fn(**eager, state_batch_indices=src.clone(), null_slot_id=0, update_kv_state=True)
        torch.cuda.synchronize()
        assert_bits_equal(out, eager_out, f"out, replay {step}")
        for key in ("state", "Bstate", "Xstate"):
            assert_bits_equal(static[key], eager[key], f"{key}, replay {step}")
        pad = torch.tensor([k in PAD_KINDS for k in kinds], device=DEV)
        assert_bits_equal(out[pad], torch.zeros_like(out[pad]), "padded lanes' out")


# --------------------------------------------------------------------------- multi-token steps
TOKEN_FORMS = ["accepted+per-token", "accepted+final", "plain+per-token", "plain+final"]


def _token_indices(B, P, T, form, layout, seed):
    """speculative_indices in one of the index forms: (B, K) + counts or (B,), (B, T) or (B,) dst."""
    sbi, nat, dst, kinds = speculative_indices(B, P, T, null_slot_id=0, layout=layout, seed=seed, device=DEV)
    accepted, target = form.split("+")
    if accepted == "plain":
        sbi, nat = source_rows(sbi, nat).to(torch.int32), None
        kinds = ["negative" if k in ("count_zero", "count_over") else k for k in kinds]
    if target == "final":
        dst = dst[:, -1].contiguous()
    return sbi, nat, dst, kinds


@pytest.mark.parametrize("layout", ["shared", "separate"])
@pytest.mark.parametrize("form", TOKEN_FORMS)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 6, 8])
def test_multi_token_parity_against_t_dense_steps(T, form, layout):
    """A T-token kernel step is bit-identical to T one-token dense kernel steps on the gathered rows."""
    B = 11
    P = B * 2 * T + 3
    inputs = make_inputs(B, P, **SHAPE, tokens=T, seed=T * 10 + len(form), device=DEV)
    sbi, nat, dst, kinds = _token_indices(B, P, T, form, layout, seed=T)
    check_pool_parity(inputs, sbi, dst, kinds, num_accepted_tokens=nat, null_slot_id=0, update_kv_state=True,
                      seed=T)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("T", [2, 4, 8])
def test_multi_token_accuracy(T, state_dtype):
    """Error vs the float64 reference <= 2x PyTorch-float32's + a small atol, every token."""
    B, P = 6, 100
    inputs = make_inputs(B, P, H=3, D=64, N=128, R=4, dtypes=dict(state_dtype=state_dtype), tokens=T, seed=T,
                         device=DEV)
    sbi, nat, dst, _ = _token_indices(B, P, T, "accepted+per-token", "separate", seed=T)
    idx = dict(state_batch_indices=sbi, num_accepted_tokens=nat, dst_state_batch_indices=dst, null_slot_id=0)
    (run, out), (ref64, out64), (t32, out32) = _kernel_and_references(inputs, idx)
    for what, got, want, fp32 in (("out", out, out64, out32), ("state", run["state"], ref64["state"], t32["state"])):
        assert_accurate(what, got, want, fp32, want.abs().max().item())


def test_multi_token_cuda_graph_replay_equals_eager():
    """A captured speculative step (T = 4, (B, K) sources, (B, T) destinations) replayed with new
    indices, counts and inputs equals eager calls, bit for bit."""
    B, T = 8, 4
    P = B * 2 * T + 3
    static = make_inputs(B, P, **SHAPE, tokens=T, seed=40, device=DEV)
    sbi = torch.full((B, T), -1, dtype=torch.int32, device=DEV)
    nat = torch.ones(B, dtype=torch.int32, device=DEV)
    dst = torch.full((B, T), -1, dtype=torch.int32, device=DEV)
    out = torch.empty(B, T, SHAPE["H"], SHAPE["D"], dtype=static["x"].dtype, device=DEV)
    kwargs = dict(state_batch_indices=sbi, num_accepted_tokens=nat, dst_state_batch_indices=dst, null_slot_id=0,
                  update_kv_state=True)
    mamba3_step_fn(**clone_inputs(static), out=out.clone(), **kwargs)  # compile + warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mamba3_step_fn(**static, out=out, **kwargs)
    for step in range(3):
        fresh = make_inputs(B, P, **SHAPE, tokens=T, seed=200 + step, device=DEV)
        s, n, d, _ = speculative_indices(B, P, T, null_slot_id=0, seed=step, device=DEV)
        eager = clone_inputs(static)
        for key in ("A", "B", "C", "x", "dt", "trap", "z"):
            static[key].copy_(fresh[key])
            eager[key].copy_(fresh[key])
        sbi.copy_(s)
        nat.copy_(n)
        dst.copy_(d)
        graph.replay()
        eager_out = mamba3_step_fn(**eager, state_batch_indices=s, num_accepted_tokens=n, dst_state_batch_indices=d,
                                   null_slot_id=0, update_kv_state=True)
        torch.cuda.synchronize()
        assert_bits_equal(out, eager_out, f"out, replay {step}")
        for key in ("state", "Bstate", "Xstate"):
            assert_bits_equal(static[key], eager[key], f"{key}, replay {step}")
