"""mamba3_step.bytes_model against independent counts: explicit arithmetic for the flagship,
and for every other configuration the sizes of the tensors a step touches, built on the
``meta`` device with the shapes of docs/contract.md and summed with ``Tensor.nbytes``."""

from __future__ import annotations

import itertools

import pytest
import torch

from mamba3_step.bytes_model import (
    HBM_BANDWIDTH,
    MODES,
    bytes_per_step,
    predicted_seconds,
    predicted_speedup,
    token_saving,
)
from mamba3_step.spec import FLAGSHIP_HEADS, flagship_spec

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def test_flagship_pool_by_hand():
    """Flagship (N=128, D=64, R=4, fp32 state, bf16 B/x/z/proj, z, outproj, update_kv_state),
    pool mode, B=3 lanes, H=5 heads: every figure written out."""
    b = bytes_per_step(flagship_spec(), batch=3, heads=5)
    assert b["state"] == 2 * 3 * 5 * 64 * 128 * 4  # read + write, fp32
    assert b["Bstate"] == 2 * 3 * 4 * 5 * 128 * 2  # read + write (update_kv_state), bf16
    assert b["Xstate"] == 2 * 3 * 5 * 64 * 2
    assert b["B"] == b["C"] == 3 * 4 * 5 * 128 * 2
    assert b["x"] == b["z"] == b["out"] == 3 * 5 * 64 * 2
    assert b["A"] == b["dt"] == b["trap"] == 3 * 5 * 4
    assert b["D"] == 5 * 4
    assert b["xproj"] == b["zproj"] == b["outproj"] == 4 * 5 * 64 * 2
    assert b["state_batch_indices"] == 3 * 4
    assert b["dst_state_batch_indices"] == 0
    hand = (2 * 3 * 5 * 64 * 128 * 4 + 2 * 3 * 4 * 5 * 128 * 2 + 2 * 3 * 5 * 64 * 2
            + 2 * 3 * 4 * 5 * 128 * 2 + 3 * 3 * 5 * 64 * 2 + 3 * 3 * 5 * 4 + 5 * 4
            + 3 * 4 * 5 * 64 * 2 + 3 * 4)
    assert b["total"] == hand == 1_061_972


def test_flagship_state_is_one_and_a_half_mib_per_request_layer():
    # docs/contract.md: 48 heads x 64 x 128 x 4 B = 1.5 MB per layer per request (read once, written once)
    b = bytes_per_step(flagship_spec(), batch=1, heads=FLAGSHIP_HEADS)
    assert b["state"] == 2 * 1.5 * 2**20


def test_flagship_gather_scatter_by_hand():
    B, H = 2, 3
    b = bytes_per_step(flagship_spec(), batch=B, heads=H, mode="gather_scatter")
    state, bst, xst = B * H * 64 * 128 * 4, B * 4 * H * 128 * 2, B * H * 64 * 2
    assert b["gather:state"] == b["scatter:state"] == 2 * state  # pool -> dense copy, and back
    assert b["gather:Bstate"] == b["scatter:Bstate"] == 2 * bst
    assert b["gather:Xstate"] == b["scatter:Xstate"] == 2 * xst
    assert b["kernel:state"] == 2 * state
    assert b["kernel:state_batch_indices"] == 0  # the dense kernel reads no indices
    assert b["gather/scatter indices"] == 6 * B * 4  # 3 gathers + 3 scatters
    dense = bytes_per_step(flagship_spec(), batch=B, heads=H, mode="dense")
    assert b["total"] == dense["total"] + 4 * (state + bst + xst) + 6 * B * 4
    # the state, the largest tensor, moves three times (gather, kernel, scatter), each read + write
    assert b["gather:state"] + b["kernel:state"] + b["scatter:state"] == 3 * 2 * state


def test_gather_scatter_without_update_kv_state_scatters_only_the_state():
    spec = flagship_spec(update_kv_state=False)
    b = bytes_per_step(spec, batch=4, heads=2, mode="gather_scatter")
    assert b["scatter:Bstate"] == b["scatter:Xstate"] == 0
    assert b["scatter:state"] == 2 * 4 * 2 * 64 * 128 * 4
    assert b["gather/scatter indices"] == 4 * 4 * 4  # 3 gathers + 1 scatter


def test_padding_lanes_move_only_their_index_and_zero_output():
    spec = flagship_spec(has_dst=True)
    full = bytes_per_step(spec, batch=4, heads=2, live_lanes=4)
    part = bytes_per_step(spec, batch=4, heads=2, live_lanes=1)
    none = bytes_per_step(spec, batch=4, heads=2, live_lanes=0)
    assert part["state"] * 4 == full["state"]
    assert part["B"] * 4 == full["B"] and part["Xstate"] * 4 == full["Xstate"]
    assert part["out"] == full["out"] == 4 * 2 * 64 * 2  # padding lanes write zeros to out
    assert part["state_batch_indices"] == part["dst_state_batch_indices"] == 4 * 4
    # with no live lane: out, indices and the per-step tensors only
    assert none["total"] == 4 * 2 * 64 * 2 + 2 * 4 * 4 + 2 * 4 + 3 * (4 * 2 * 64 * 2)


# ----------------------------------------------------------------------------- meta-tensor count
def _meta_count(spec, batch, heads, mode):
    """Independent count: allocate (on the meta device) the tensors a step reads and writes,
    with docs/contract.md's shapes, and add up their sizes."""
    N, D, R, H, Bn = spec.dstate, spec.headdim, spec.mimo, heads, batch
    sd, kd, xd, pd = (DT[spec.state_dtype], DT[spec.kv_dtype], DT[spec.x_dtype], DT[spec.proj_dtype])

    def t(shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta").nbytes

    rows = {"state": t((Bn, H, D, N), sd), "Bstate": t((Bn, R, H, N), kd), "Xstate": t((Bn, H, D), xd)}
    reads = rows["state"] + rows["Bstate"] + rows["Xstate"]
    reads += 2 * t((Bn, R, H, N), kd)  # B, C
    reads += t((Bn, H, D), xd) * (2 if spec.has_z else 1)  # x, z
    reads += 3 * t((Bn, H), torch.float32)  # A, dt, trap
    reads += t((H,), torch.float32)  # D
    reads += t((R, H, D), pd) * (1 + spec.has_z + spec.has_outproj)  # projections
    writes = rows["state"] + t((Bn, H, D) if spec.has_outproj else (Bn, R, H, D), xd)
    if spec.update_kv_state:
        writes += rows["Bstate"] + rows["Xstate"]
    kernel = reads + writes
    if mode == "dense":
        return kernel
    if mode == "pool":
        return kernel + t((Bn,), torch.int32) * (1 + spec.has_dst)
    scattered = ["state"] + (["Bstate", "Xstate"] if spec.update_kv_state else [])
    moves = sum(2 * rows[k] for k in rows) + sum(2 * rows[k] for k in scattered)
    return kernel + moves + t((Bn,), torch.int32) * (3 + len(scattered))


CONFIGS = [
    dict(),
    dict(state_dtype="bfloat16"),
    dict(state_dtype="float16", kv_dtype="float32", x_dtype="float16", proj_dtype="float32"),
    dict(dstate=32, headdim=32, mimo=1, has_z=False, has_outproj=False),
    dict(dstate=256, headdim=128, mimo=8, update_kv_state=False, has_dst=True),
    dict(dstate=64, mimo=2, has_outproj=False, has_dst=True),
]


@pytest.mark.parametrize("changes", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "flagship")
@pytest.mark.parametrize("mode", MODES)
def test_totals_equal_meta_tensor_count(changes, mode):
    spec = flagship_spec(**changes)
    for batch, heads in itertools.product((1, 7, 512), (1, 48)):
        b = bytes_per_step(spec, batch, heads, mode=mode)
        assert b["total"] == _meta_count(spec, batch, heads, mode), (batch, heads)
        assert b["total"] == sum(v for k, v in b.items() if k != "total")
        assert all(isinstance(v, int) and v >= 0 for v in b.values())


def test_default_mode_follows_the_spec():
    pool = flagship_spec()
    dense = flagship_spec(pool=False)
    assert bytes_per_step(pool, 8, 4) == bytes_per_step(pool, 8, 4, mode="pool")
    assert bytes_per_step(dense, 8, 4) == bytes_per_step(pool, 8, 4, mode="dense")
    assert bytes_per_step(pool, 0, 4)["state"] == 0


def test_predicted_time_and_speedup():
    total = bytes_per_step(flagship_spec(), 256, 48)["total"]
    assert predicted_seconds(total, "H100") == total / 3.35e12
    assert predicted_seconds(total, "H200") == total / 4.8e12
    assert predicted_seconds(total, "GH200") == total / 4.0e12
    assert set(HBM_BANDWIDTH) == {"H100", "H200", "GH200"}
    gs = bytes_per_step(flagship_spec(), 256, 48, mode="gather_scatter")["total"]
    s = predicted_speedup(flagship_spec(), 256, 48)
    assert s == gs / total
    assert 2.9 < s < 3.0  # the state dominates: 6 moves of it against 2


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(mode="paged"), ValueError, "mode must be one of"),
    (dict(batch=-1), ValueError, "batch must be a non-negative int"),
    (dict(heads=2.5), ValueError, "heads must be a non-negative int"),
    (dict(live_lanes=9), ValueError, r"live_lanes must be an int in \[0, batch=8\]"),
    (dict(live_lanes=4, mode="dense"), ValueError, "padding lanes"),
    (dict(spec="flagship"), TypeError, "spec must be a StepSpec"),
])
def test_bad_arguments(kwargs, exc, message):
    args = dict(spec=flagship_spec(), batch=8, heads=4)
    args.update(kwargs)
    with pytest.raises(exc, match=message):
        bytes_per_step(**args)
    with pytest.raises(ValueError, match="gpu must be one of"):
        predicted_seconds(1, "A100")


def test_speculative_step_by_hand():
    """T = 3 tokens, (B, K) sources with accepted counts, a row per token: the state and the B/x
    rows are read once and written three times; per-lane inputs and out three times."""
    spec = flagship_spec(tokens=3, has_dst=True, dst_per_token=True, num_accepted=True)
    b = bytes_per_step(spec, batch=3, heads=5)
    one = bytes_per_step(flagship_spec(has_dst=True), batch=3, heads=5)
    assert b["state"] == (1 + 3) * 3 * 5 * 64 * 128 * 4
    assert b["Bstate"] == (1 + 3) * 3 * 4 * 5 * 128 * 2 and b["Xstate"] == (1 + 3) * 3 * 5 * 64 * 2
    for key in ("B", "C", "x", "z", "out", "A", "dt", "trap"):
        assert b[key] == 3 * one[key], key
    for key in ("D", "xproj", "zproj", "outproj", "state_batch_indices"):
        assert b[key] == one[key], key
    assert b["dst_state_batch_indices"] == 3 * 3 * 4 and b["num_accepted_tokens"] == 3 * 4
    final = bytes_per_step(flagship_spec(tokens=3, has_dst=True), batch=3, heads=5)
    assert final["state"] == 2 * 3 * 5 * 64 * 128 * 4  # a final destination: written once


def test_token_saving_against_one_token_steps():
    spec = flagship_spec(tokens=4, has_dst=True, dst_per_token=True, num_accepted=True)
    s = token_saving(spec, 64, FLAGSHIP_HEADS)
    one = flagship_spec(has_dst=True, num_accepted=True)
    assert s["one_token_steps_bytes"] == 4 * bytes_per_step(one, 64, FLAGSHIP_HEADS)["total"]
    assert s["t_token_bytes"] == bytes_per_step(spec, 64, FLAGSHIP_HEADS)["total"]
    assert 1.5 < s["ratio"] < 1.6  # the state is read once instead of four times
    assert token_saving(flagship_spec(), 64, FLAGSHIP_HEADS)["ratio"] == 1.0
    with pytest.raises(ValueError, match="gather_scatter"):
        bytes_per_step(spec, 4, 2, mode="gather_scatter")
