"""mamba3_step.tools.bytes_model against independent counts: explicit arithmetic for the flagship,
and for every other configuration the sizes of the tensors a step touches, built on the
``meta`` device with the shapes of docs/contract.md and summed with ``Tensor.nbytes``; for
rotary steps also the bytes the kernel's PTX touched when executed on the CPU (PTX tier), and
upstream's rotary pipeline (``upstream_pipeline_bytes``) entry by entry."""

from __future__ import annotations

import itertools

import pytest
import torch

from mamba3_step.api import prepare_step
from mamba3_step.tools.bytes_model import (HBM_BANDWIDTH, MODES, bc_load_bytes, bytes_per_step, predicted_seconds, predicted_speedup, replay_bytes, token_saving, upstream_pipeline_bytes)
from ptx_executor import analysis
from mamba3_step.tools.ptx_tier import run_step_ptx
from mamba3_step.spec import FLAGSHIP_HEADS, flagship_rotary_spec, flagship_spec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import make_inputs, with_rotary

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
    N, D, R, H, Bn, S = spec.dstate, spec.headdim, spec.mimo, heads, batch, spec.rope_angles
    sd, kd, xd, pd = (DT[spec.state_dtype], DT[spec.kv_dtype], DT[spec.x_dtype], DT[spec.proj_dtype])

    def t(shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta").nbytes

    rows = {"state": t((Bn, H, D, N), sd), "Bstate": t((Bn, R, H, N), kd), "Xstate": t((Bn, H, D), xd),
            "angle_state": t((Bn, H, S), torch.int64)}
    reads = sum(rows.values())
    reads += 2 * t((Bn, R, 1 if spec.shared_bc else H, N), kd)  # B, C
    reads += t((Bn, H, D), xd) * (2 if spec.has_z else 1)  # x, z
    reads += 3 * t((Bn, H), torch.float32)  # A, dt, trap
    reads += t((H,), torch.float32)  # D
    reads += t((R, H, D), pd) * (1 + spec.has_z + spec.has_outproj)  # projections
    reads += t((Bn, H, S), torch.float32)  # angle_proj
    reads += 2 * t((R, H, N), torch.float32) * spec.has_bc_bias  # B_bias, C_bias
    writes = rows["state"] + rows["angle_state"] + t((Bn, H, D) if spec.has_outproj else (Bn, R, H, D), xd)
    if spec.update_kv_state:
        writes += rows["Bstate"] + rows["Xstate"]
    kernel = reads + writes
    if mode == "dense":
        return kernel
    if mode == "pool":
        return kernel + t((Bn,), torch.int32) * (1 + spec.has_dst)
    gathered = ["state", "Bstate", "Xstate"] + (["angle_state"] if S else [])
    scattered = ["state"] + (["Bstate", "Xstate"] if spec.update_kv_state else []) + gathered[3:]
    moves = sum(2 * rows[k] for k in gathered) + sum(2 * rows[k] for k in scattered)
    return kernel + moves + t((Bn,), torch.int32) * (len(gathered) + len(scattered))


CONFIGS = [
    dict(),
    dict(state_dtype="bfloat16"),
    dict(state_dtype="float16", kv_dtype="float32", x_dtype="float16", proj_dtype="float32"),
    dict(dstate=32, headdim=32, mimo=1, has_z=False, has_outproj=False),
    dict(dstate=256, headdim=128, mimo=8, update_kv_state=False, has_dst=True),
    dict(dstate=64, mimo=2, has_outproj=False, has_dst=True),
    dict(rope_angles=32, has_bc_bias=True, shared_bc=True),  # flagship_rotary_spec
    dict(rope_angles=16, rotate_pairwise=True, update_kv_state=False),
    dict(dstate=64, mimo=1, rope_angles=32, has_bc_bias=True, state_dtype="bfloat16", has_dst=True),
    dict(shared_bc=True),  # B/C shared by the heads without rotary
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


# ----------------------------------------------------------------------------- rotary
def test_flagship_rotary_pool_by_hand():
    """flagship_rotary_spec (S=32 angles, biases, B/C shared by the heads), pool mode, B=3, H=5:
    the angle row (int64) read and written like the state's, angle_proj per lane and head, the
    fp32 biases once per step, one B/C row per lane (DRAM: the other heads hit L2)."""
    b = bytes_per_step(flagship_rotary_spec(), batch=3, heads=5)
    plain = bytes_per_step(flagship_spec(), batch=3, heads=5)
    assert b["angle_state"] == 2 * 3 * 5 * 32 * 8
    assert b["angle_proj"] == 3 * 5 * 32 * 4
    assert b["B_bias"] == b["C_bias"] == 4 * 5 * 128 * 4
    assert b["B"] == b["C"] == 3 * 4 * 1 * 128 * 2  # head axis 1
    assert b["Bstate"] == plain["Bstate"] == 2 * 3 * 4 * 5 * 128 * 2  # B~ stored per head
    rotary = {"angle_state", "angle_proj", "B_bias", "C_bias", "B", "C", "total"}
    assert all(b[k] == plain[k] for k in b if k not in rotary)
    assert b["total"] == (plain["total"] - 2 * 3 * 4 * 4 * 128 * 2 + 2 * 3 * 5 * 32 * 8 + 3 * 5 * 32 * 4
                          + 2 * 4 * 5 * 128 * 4)
    assert all(plain[k] == 0 for k in ("angle_state", "angle_proj", "B_bias", "C_bias"))


def test_rotary_gather_scatter_moves_the_angle_rows_too():
    B, H = 2, 3
    spec = flagship_rotary_spec(update_kv_state=False)
    b = bytes_per_step(spec, batch=B, heads=H, mode="gather_scatter")
    angle = B * H * 32 * 8
    assert b["gather:angle_state"] == b["scatter:angle_state"] == 2 * angle  # always written
    assert b["kernel:angle_state"] == 2 * angle
    assert b["scatter:Bstate"] == b["scatter:Xstate"] == 0
    assert b["gather/scatter indices"] == (4 + 2) * B * 4  # 4 gathers, 2 scatters (state, angle)
    assert bytes_per_step(flagship_spec(), B, H, mode="gather_scatter")["gather:angle_state"] == 0


def test_rotary_speculative_step_writes_an_angle_row_per_token():
    spec = flagship_rotary_spec(tokens=3, has_dst=True, dst_per_token=True, num_accepted=True)
    b = bytes_per_step(spec, batch=2, heads=5)
    assert b["angle_state"] == (1 + 3) * 2 * 5 * 32 * 8  # read once, written per token
    assert b["angle_proj"] == 3 * 2 * 5 * 32 * 4 and b["B"] == 3 * 2 * 4 * 128 * 2
    assert b["B_bias"] == 4 * 5 * 128 * 4  # weights: once per step
    final = bytes_per_step(flagship_rotary_spec(tokens=3, has_dst=True), batch=2, heads=5)
    assert final["angle_state"] == 2 * 2 * 5 * 32 * 8


def test_bc_load_bytes_against_the_dram_count():
    """What the CTAs load of B and C against what DRAM serves: H x with B/C shared by the heads,
    the same without; ceil(D / tile_D) CTAs per head each load the row; padding lanes load none."""
    shared = flagship_rotary_spec()
    dram = bytes_per_step(shared, 8, 48)
    loads = bc_load_bytes(shared, 8, 48)
    assert loads["B"] == loads["C"] == 48 * dram["B"] == 8 * 48 * 4 * 128 * 2
    own = flagship_spec()
    assert bc_load_bytes(own, 8, 48)["B"] == bytes_per_step(own, 8, 48)["B"]
    split = flagship_spec(update_kv_state=False, shared_bc=True, tile_D=32)
    assert bc_load_bytes(split, 8, 48, live_lanes=3)["C"] == 3 * 48 * 2 * 4 * 128 * 2
    assert bc_load_bytes(flagship_spec(tokens=4, has_dst=True), 2, 3)["B"] == 4 * bytes_per_step(
        flagship_spec(has_dst=True), 2, 3)["B"]


def test_upstream_pipeline_by_hand():
    """Upstream's rotary decode (Mamba3.step) with pools, flagship rotary, B=2, H=3, every entry:
    gather 4 rows (angle fp32), the rotary launch, the dense step without kv update, three
    copies, the scatter of 4 tensors."""
    B, H, R, N, D, S = 2, 3, 4, 128, 64, 32
    u = upstream_pipeline_bytes(flagship_rotary_spec(), B, H)
    rows = {"state": B * H * D * N * 4, "Bstate": B * R * H * N * 2, "Xstate": B * H * D * 2,
            "angle_state": B * H * S * 4}
    for t, n in rows.items():
        assert u[f"gather:{t}"] == u[f"scatter:{t}"] == 2 * n, t
    bias = R * H * N * 4
    assert u["rotary:B"] == u["rotary:C"] == B * R * N * 2  # a stride-0 expand: DRAM once per lane
    assert u["rotary:bias relayout"] == 2 * 2 * bias  # .contiguous() of the rearranged biases
    assert u["rotary:B_bias"] == u["rotary:C_bias"] == bias
    assert u["rotary:angle_state"] == u["rotary:new angle"] == B * H * S * 4
    assert u["rotary:angle_proj"] == B * S * 2 and u["rotary:dt"] == B * H * 4
    assert u["rotary:B~"] == u["rotary:C~"] == B * R * H * N * 2  # full heads, input dtype
    step = bytes_per_step(flagship_spec(pool=False, update_kv_state=False), B, H, mode="dense")
    assert sum(v for k, v in u.items() if k.startswith("step:")) == step["total"]
    assert u["step:Bstate"] == rows["Bstate"] and u["step:state"] == 2 * rows["state"]  # k read, not written
    assert u["copy:angle_state"] == 2 * rows["angle_state"]
    assert u["copy:Bstate"] == 2 * rows["Bstate"] and u["copy:Xstate"] == 2 * rows["Xstate"]
    assert u["gather/scatter indices"] == 8 * B * 4
    assert u["total"] == sum(v for k, v in u.items() if k != "total")
    dense = upstream_pipeline_bytes(flagship_rotary_spec(), B, H, pools=False)
    assert u["total"] - dense["total"] == 4 * sum(rows.values()) + 8 * B * 4
    assert upstream_pipeline_bytes(flagship_rotary_spec(mimo=1), B, H)["rotary:bias relayout"] == 0


def test_fused_against_upstream_at_the_flagship():
    """The fused pool step moves about a third of upstream's pipeline with pools (the state read
    and written once instead of three times); without pools upstream moves ~7% more than fused."""
    spec = flagship_rotary_spec()
    for B in (64, 256):
        fused = bytes_per_step(spec, B, FLAGSHIP_HEADS)["total"]
        assert 3.0 < upstream_pipeline_bytes(spec, B, FLAGSHIP_HEADS)["total"] / fused < 3.1
        assert 1.05 < upstream_pipeline_bytes(spec, B, FLAGSHIP_HEADS, pools=False)["total"] / fused < 1.1


@pytest.mark.parametrize("changes, message", [
    (dict(rope_angles=0, has_bc_bias=False, shared_bc=False), "needs rope_angles > 0"),
    (dict(tokens=2, has_dst=True), "tokens == 1"),
])
def test_upstream_pipeline_refuses(changes, message):
    with pytest.raises(ValueError, match=message):
        upstream_pipeline_bytes(flagship_rotary_spec().replace(**changes), 4, 2)
    with pytest.raises(TypeError, match="spec must be a StepSpec"):
        upstream_pipeline_bytes("flagship", 4, 2)


# ----------------------------------------------------------------------------- executed (PTX tier)
def _executed(spec_changes: dict, B: int, H: int, T: int, pool: bool):
    """Run a small rotary step's PTX on the CPU (every lane live, a row per token); return the spec,
    the unique bytes per tensor and the bytes of B / C all threads loaded (repeats kept)."""
    c = dict(spec_changes)
    S, shared, bias, kv = c.pop("S"), c.pop("shared_bc"), c.pop("bias"), c.pop("kv")
    P = B * (T + 1) if pool else None
    inputs = with_rotary(make_inputs(B, P, H=H, D=32, N=32, R=2, tokens=T, seed=1), S, shared_bc=shared,
                         bias=bias, seed=2)
    kw = {}
    if pool:
        rows = torch.arange(P, dtype=torch.int32).view(B, T + 1)
        kw = dict(state_batch_indices=rows[:, 0].contiguous(),
                  dst_state_batch_indices=rows[:, 1:].contiguous() if c.get("dst_per_token") else
                  rows[:, T].contiguous())
    s, tensors, _ = prepare_step(StepTensors(**inputs, **kw), update_kv_state=kv)
    res = run_step_ptx(s, tensors)
    log = res.log.arrays()
    loads = {}
    for r in res.extra["memory"].regions:
        sel = (log["addr"] >= r.start) & (log["addr"] < r.end) & ~log["write"].astype(bool)
        loads[r.name] = int(log["width"][sel].sum())
    return s, analysis.bytes_touched(res, res.extra["memory"]), loads


@pytest.mark.parametrize("case", [
    dict(S=8, shared_bc=True, bias=True, kv=True, T=1, pool=True),
    dict(S=8, shared_bc=True, bias=True, kv=True, T=2, pool=True, dst_per_token=True),
    dict(S=16, shared_bc=False, bias=False, kv=True, T=3, pool=True),
    dict(S=8, shared_bc=False, bias=True, kv=False, T=1, pool=False),
], ids=["pool-shared", "pool-shared-T2-per-token", "pool-own-T3-final", "dense-own"])
def test_executed_rotary_bytes_equal_the_model(case):
    """The executed kernel's unique bytes per tensor (angle_state, angle_proj, biases, B/C shared
    or not included) equal bytes_per_step; the B and C bytes its threads load, repeats counted,
    equal bc_load_bytes (H x the unique count when shared)."""
    case = dict(case)
    B, H, T, pool = 3, 2, case.pop("T"), case.pop("pool")
    s, touched, loads = _executed(case, B, H, T, pool)
    assert s.rope_angles == case["S"] and s.shared_bc == case["shared_bc"] and s.tokens == T
    model = bytes_per_step(s, B, H)
    assert set(touched) <= set(model)
    for key, n in touched.items():
        assert n["read"] + n["written"] == model[key], f"{key}: executed {n}, model {model[key]}"
    assert model["angle_state"] > 0 and model["angle_proj"] > 0
    want = bc_load_bytes(s, B, H)
    assert loads["B"] == want["B"] and loads["C"] == want["C"]
    assert (want["B"] == H * model["B"]) == case["shared_bc"]


def test_replay_bytes_by_hand():
    """Replay's bytes (docs/design/replay.md) against a hand count, flagship, B = 3, H = 2, K = 4:
    an append step at ring position m reads the state, Bstate and Xstate rows and m entries, writes
    one entry; a flush reads K - 1 entries and writes the three rows; each reads and writes its
    ring length (one per head); the step's inputs, out, weights and indices are the stepwise step's."""
    spec, B, H, K = flagship_spec(), 3, 2, 4
    N, D, R = spec.dstate, spec.headdim, spec.mimo
    rows = B * (H * D * N * 4 + R * H * N * 2 + H * D * 2)  # state fp32, Bstate, Xstate bf16
    entry = B * H * (R * N * 2 + D * 2 + 12)
    stepwise = bytes_per_step(spec, B, H)["total"]
    with_kv = 2 * rows  # the stepwise step reads and writes the three rows
    rest = stepwise - with_kv
    for m in range(K - 1):
        assert replay_bytes(spec, K, B, H, m)["total"] == rest + rows + (m + 1) * entry + 8 * B * H
    assert replay_bytes(spec, K, B, H, K - 1)["total"] == rest + 2 * rows + (K - 1) * entry + 8 * B * H
    average = replay_bytes(spec, K, B, H)["total"]
    assert average == pytest.approx(sum(replay_bytes(spec, K, B, H, m)["total"] for m in range(K)) / K)
    assert replay_bytes(spec, K, 256, FLAGSHIP_HEADS)["total"] / bytes_per_step(spec, 256, FLAGSHIP_HEADS)["total"] < 0.7
    verify = flagship_spec(tokens=4, has_dst=True, dst_per_token=True, num_accepted=True)
    v = replay_bytes(verify, 8, B, H, 2)  # a flush every 8 tokens, 4 accepted a round: half a row write
    assert v["state"] == B * H * D * N * 4 * 1.5 and v["ring"] == (2 + 4) * entry
    with pytest.raises(ValueError, match="flush_length must be"):
        replay_bytes(spec, 1, B, H)
    with pytest.raises(ValueError, match="position"):
        replay_bytes(spec, K, B, H, K)
