"""The kernel's own @cute.jit stages, run on the CPU by the host driver, against PyTorch.

No GPU runs here. These tests execute the very methods the @cute.kernel calls (row
selection, padding predicates, tile addressing with the 16-byte TiledCopy, operand staging,
update_kv_state stores, the per-thread state update and the epilogue) on CPU tensors; only
the barrier, the warp-shuffle reduction and shared memory are replaced (host_driver.py).

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest
import torch
from helpers import (PAD_KINDS, assert_bits_equal, build_pool_indices, check_pool_parity, clone_inputs,
                      make_inputs, make_pool_indices)
from cutlass import Int32
from cutlass.cute.runtime import from_dlpack

from mamba3_step.host_driver import HostStages, host_step_fn, run_on_host
from mamba3_step.reference import mamba3_step_reference
from mamba3_step.spec import StepSpec
from mamba3_step.tiling import thread_layout

# Host runs JIT-compile the driver for every call (~1 s): keep the shapes small and the cases few,
# each one at a regime edge.
PARITY_CASES = [
    # (shape kwargs, dtypes, tile/warps, why)
    pytest.param(dict(H=2, D=32, N=32, R=2), dict(), dict(),
                 id="small-bf16kv"),  # smallest N/D: TPR=8 lanes per row, 4 rows per warp
    pytest.param(dict(H=1, D=32, N=64, R=1), dict(state_dtype="bfloat16", kv_dtype="float16", x_dtype="float16",
                                                   proj_dtype="float32"), dict(),
                 id="bf16-state-R1"),  # 16-bit state: VN=8 elements per 16-byte vector
    pytest.param(dict(H=1, D=64, N=32, R=4), dict(kv_dtype="float32", x_dtype="float32", proj_dtype="float32"),
                 dict(tile_D=32, num_warps=2),
                 id="two-dtiles"),  # tile_D < D: two CTAs per (lane, head), D-tile addressing
    pytest.param(dict(H=1, D=32, N=256, R=8), dict(state_dtype="float16"), dict(),
                 id="N256-R8-fenced"),  # largest N and R: several vectors per thread, fenced rows
]


def _pool_case(B, P, n_pad, layout, with_dst, null_slot_id, seed):
    return make_pool_indices(B, P, n_pad=n_pad, layout=layout, with_dst=with_dst,
                             null_slot_id=null_slot_id, seed=seed)


@pytest.mark.parametrize("shape,dtypes,tiling", PARITY_CASES)
def test_host_pool_parity_with_every_padding_kind(shape, dtypes, tiling):
    """Pool mode == gather -> dense -> scatter bit for bit, through the kernel's stages.

    Interleaved padding of all three kinds (negative, >= P, null_slot_id), a separate
    destination with padded destinations, poisoned unread rows, update_kv_state on whenever
    its precondition (tile_D >= D) holds.
    """
    inputs = make_inputs(7, 13, **shape, **dtypes, seed=11)
    src, dst, kinds = _pool_case(7, 13, n_pad=3, layout="interleaved", with_dst=True, null_slot_id=5, seed=3)
    assert {"negative", "oob", "null"} <= set(kinds)
    update_kv = tiling.get("tile_D", shape["D"]) >= shape["D"]

    def step(*args, **kwargs):
        return host_step_fn(*args, **kwargs, **tiling)

    check_pool_parity(inputs, src, dst, kinds, null_slot_id=5, update_kv_state=update_kv, step_fn=step)


def test_host_trailing_padding_without_dst_in_place():
    """A padded CUDA-graph batch: live lanes first, then padding; in-place updates (dst = src)."""
    inputs = make_inputs(6, 9, H=2, D=32, N=32, R=2, seed=4)
    src, dst, kinds = make_pool_indices(6, 9, n_pad=2, layout="trailing", pad_kinds=("negative", "oob"), seed=8)
    check_pool_parity(inputs, src, dst, kinds, update_kv_state=True, step_fn=host_step_fn)


def _torch_error_budget(inputs, pool_kwargs, out_ref64, state_ref64):
    """Max error of the same computation done by PyTorch in float32, for out and the state."""
    t32 = clone_inputs(inputs)
    out32 = mamba3_step_reference(**t32, **pool_kwargs, compute_dtype=torch.float32)
    return ((out32.double() - out_ref64).abs().max().item(),
            (t32["state"].double() - state_ref64).abs().max().item())


@pytest.mark.parametrize("dtypes", [
    dict(kv_dtype="float32", x_dtype="float32", proj_dtype="float32"),  # sharp: nothing rounds to 16 bits
    dict(),  # the flagship's bf16 B/x/z/projections
])
def test_host_accuracy_against_float64(dtypes):
    """Error vs the float64 reference <= 2x PyTorch-float32's error + a small atol."""
    inputs = make_inputs(5, 8, H=2, D=64, N=128, R=4, seed=21, **dtypes)
    src = torch.tensor([6, -1, 0, 3, 7], dtype=torch.int32)
    pool = dict(state_batch_indices=src)
    ref64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    out64 = mamba3_step_reference(**ref64, **pool, compute_dtype=torch.float64)
    state64 = ref64["state"]
    budget_out, budget_state = _torch_error_budget(inputs, pool, out64, state64)

    run = clone_inputs(inputs)
    out = host_step_fn(**run, **pool)
    err_out = (out.double() - out64).abs().max().item()
    err_state = (run["state"].double() - state64).abs().max().item()
    scale = out64.abs().max().item()
    assert err_out <= 2 * budget_out + 1e-6 * scale, (err_out, budget_out)
    assert err_state <= 2 * budget_state + 1e-6, (err_state, budget_state)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_host_rows_read_and_written():
    """The driver hands exactly the live lanes' src rows to the loads and dst rows to the stores."""
    P, null = 10, 0
    kinds = ["live", "negative", "live_nodst", "oob", "live", "null", "live"]
    src, dst, kinds = build_pool_indices(kinds, P, null_slot_id=null, with_dst=True, seed=2)
    inputs = make_inputs(len(kinds), P, H=1, D=32, N=32, R=1, seed=5)
    spec = StepSpec(32, 32, 1, pool=True, has_dst=True, update_kv_state=True).with_default_tiling()
    out = torch.empty(len(kinds), 1, 32, dtype=torch.bfloat16)
    info = run_on_host(spec, **inputs, out=out, state_batch_indices=src, dst_state_batch_indices=dst,
                       null_slot_id=null)
    exp_read = [s if k in ("live", "live_nodst") else -1 for k, s in zip(kinds, src.tolist())]
    exp_written = [d if k == "live" else -1 for k, d in zip(kinds, dst.tolist())]
    assert info["rows_read"].tolist() == exp_read
    assert info["rows_written"].tolist() == exp_written


# ---------------------------------------------------------------------------- row selection
class _SelectProbe:
    def __init__(self, spec):
        self.k = HostStages(spec)

    @cute.jit
    def __call__(self, mSrc: cute.Tensor, mDst: cute.Tensor, mRes: cute.Tensor, num_rows: Int32, null_slot: Int32):
        for b in cutlass.range(mSrc.shape[0]):
            src, dst, src_live, dst_live = self.k.select_rows(mSrc, mDst, null_slot, num_rows, b)
            mRes[b, 0] = src
            mRes[b, 1] = dst
            mRes[b, 2] = Int32(src_live)
            mRes[b, 3] = Int32(dst_live)


@pytest.mark.parametrize("has_dst", [False, True])
def test_select_rows_padding_predicate(has_dst):
    """Every kind of index: negative, 0..P-1, P, huge, INT32 min/max, == null_slot."""
    P, null = 6, 2
    values = [-(2**31), -7, -1, 0, 1, 2, 5, 6, 7, 2**31 - 1]
    src = torch.tensor(values, dtype=torch.int32)
    dst = torch.tensor(values[::-1], dtype=torch.int32)
    res = torch.full((len(values), 4), 99, dtype=torch.int32)
    spec = StepSpec(32, 32, 1, pool=True, has_dst=has_dst).with_default_tiling()
    _SelectProbe(spec)(from_dlpack(src), from_dlpack(dst), from_dlpack(res), Int32(P), Int32(null))

    def live(v):
        return 0 <= v < P and v != null

    for b, s in enumerate(values):
        d = values[::-1][b] if has_dst else s
        assert res[b].tolist() == [s, d, int(live(s)), int(live(s) and live(d))], (b, s, d)


# ---------------------------------------------------------------------------- tile addressing
class _AddressProbe:
    def __init__(self, spec):
        self.k = HostStages(spec)
        self.nt = self.k.num_threads
        self.groups = self.k.layout.row_groups

    @cute.jit
    def __call__(self, mState: cute.Tensor, mSeen: cute.Tensor, mOwner: cute.Tensor, mCount: cute.Tensor,
                 dtile: Int32):
        for g in cutlass.range_constexpr(self.groups):
            for tidx in cutlass.range(self.nt):
                tiled_copy = self.k.state_tiled_copy()
                tSgS, tScS = self.k.partition_state(tiled_copy, mState, Int32(1), Int32(0), dtile, g, tidx)
                tSrS = cute.make_fragment_like(tSgS)
                cute.copy(tiled_copy, tSgS, tSrS)
                for i in cutlass.range_constexpr(cute.size(tSrS)):
                    d, n = tScS[i]
                    mSeen[d, n] = tSrS[i]
                    mOwner[d, n] = tidx
                    mCount[d, n] = mCount[d, n] + 1


@pytest.mark.parametrize("N,D,tile_D,num_warps,dtype", [
    (32, 32, 32, 4, "float32"),  # TPR=8: four rows per warp
    (256, 64, 32, 4, "float32"),  # CPT=2: two vectors per thread per row, D-tile 1 of 2, two row groups
    (64, 32, 32, 2, "float16"),  # 16-bit: VN=8
    (256, 128, 128, 16, "float32"),  # 512 threads, 64 state words: two row groups
])
def test_tile_addressing_is_the_documented_bijection(N, D, tile_D, num_warps, dtype):
    """Each thread's 16-byte fragment holds the elements its coordinates name; the slab is covered
    exactly once; thread t owns rows t // TPR + k * rows_per_pass and vectors (c * TPR + t % TPR)."""
    torch_dtype = getattr(torch, dtype)
    lay = thread_layout(N, tile_D, num_warps, dtype, 1)
    assert lay.row_groups == (2 if lay.state_words_per_thread == 64 else 1)  # both paths covered
    n_ids = D * N
    ids = (torch.arange(n_ids, dtype=torch.float32) % 2048).reshape(D, N)  # exact in fp16 too
    pool = torch.full((2, 1, D, N), float("nan"), dtype=torch_dtype)
    pool[1, 0] = ids.to(torch_dtype)
    dtile = D // tile_D - 1  # the last D-tile
    seen = torch.full((tile_D, N), float("nan"), dtype=torch_dtype)
    owner = torch.full((tile_D, N), -1, dtype=torch.int32)
    count = torch.zeros((tile_D, N), dtype=torch.int32)
    spec = StepSpec(N, D, 1, state_dtype=dtype, tile_D=tile_D, num_warps=num_warps)
    _AddressProbe(spec)(from_dlpack(pool, assumed_align=16), from_dlpack(seen), from_dlpack(owner),
                        from_dlpack(count), Int32(dtile))
    assert torch.equal(count, torch.ones_like(count)), "every element of the slab exactly once"
    assert_bits_equal(seen, pool[1, 0, dtile * tile_D:(dtile + 1) * tile_D], "fragment values vs coordinates")
    d = torch.arange(tile_D)[:, None]
    n = torch.arange(N)[None, :]
    expected_owner = (d % lay.rows_per_pass) * lay.TPR + (n // lay.VN) % lay.TPR
    assert torch.equal(owner, expected_owner.to(torch.int32))
