"""``Mamba3DecodeLayer``: its float64 decode over pools against a transcription of upstream's
``Mamba3.step`` (state-spaces/mamba at commit e9594ce, dense per-request states, the angle in unreduced
radians), its fp32 decode against the same transcription and against its float64 decode, and its shape
(one step call, no pool row touched outside it).

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank,
S rotary angles per head, G heads of B/C.

The transcription below was made from upstream's source at e9594ce and uses only torch (no
``mamba3_step`` code). It composes ``Mamba3.step`` (mamba_ssm/modules/mamba3.py: the in_proj split,
``_preprocess``, the bias layout, the unit projections of SISO, z gating without ``is_outproj_norm``,
out_proj) on upstream's reference functions: ``rms_norm_ref`` (ops/triton/layernorm_gated.py) for the
B/C norms, ``apply_rotary_qk_inference_reference`` (ops/triton/mamba3/mamba3_mimo_rotary_step.py) for
the angle, biases and rotation, and ``selective_state_update_fused_ref_v2``
(ops/cute/mamba3/mamba3_step_fn.py) for the recurrence, the skip, the gate and the MIMO projections.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import mamba3_step.api as api
import mamba3_step.layer as layer_mod
from mamba3_step.layer import LayerDtypes, LayerPools, Mamba3DecodeLayer
from mamba3_step.rotary import angle_from_radians

D_MODEL, HEADDIM, N, R = 32, 32, 32, 2  # d_inner 64: H = 2 heads
P = 7  # slot 6 is never used: it must keep its bits
FP32 = LayerDtypes(torch.float32, torch.float32, torch.float32, torch.float32)

#: the decode, step by step: who joins (slot, how), who leaves, and the lanes (None: padding, slot -1)
PLAN = [
    dict(join={0: (0, "fresh"), 1: (1, "fresh"), 2: (2, "prefill")}, lanes=[0, None, 1, 2]),
    dict(join={3: (3, "fresh")}, lanes=[2, 0, 3, None, 1]),
    # r0 leaves, its row kept as a cached prefix; r1 leaves; r4 forks r0's row into r1's old slot
    dict(leave=[0, 1], join={4: (1, ("fork", 0)), 5: (4, "fresh")}, lanes=[None, 4, 3, 5, 2]),
    dict(join={6: (0, "fresh")}, lanes=[6, 2, None, None, 4, 5, 3]),  # slot 0 reused
    dict(leave=[2, 3], join={7: (2, "fresh")}, lanes=[5, 7, None, 4, 6]),  # slot 2 reused
    dict(lanes=[4, 6, 7, 5, None]),
]

CONFIGS = list(itertools.product([True, False], [0.5, 1.0], ["one", "all"]))  # is_mimo, rope_fraction, B/C heads


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The layers here are tiny: one intra-op thread runs their matmuls ~100x faster than waking a pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(is_mimo: bool, rope_fraction: float, bc_heads: str) -> dict:
    """The transcription's sizes, worked out from upstream's rules (not read from the layer)."""
    H = 2 * D_MODEL // HEADDIM
    S = int(N * rope_fraction)
    return dict(H=H, D=HEADDIM, N=N, R=R if is_mimo else 1, G=1 if bc_heads == "one" else H,
                S=(S - S % 2) // 2, A_floor=A_FLOOR, mimo=is_mimo, pairwise=not is_mimo,
                rope_fraction=rope_fraction)


#: upstream's default is 1e-4; at 0.8 the clamp bites for dd_A < -0.25, so the draws (dd_A about
#: N(0, 0.5)) reach both branches of the heavy-tail activation and the clamp (asserted below)
A_FLOOR = 0.8


def make_layer(cfg: dict, dtypes=None, seed=0) -> Mamba3DecodeLayer:
    torch.manual_seed(seed)
    layer = Mamba3DecodeLayer(D_MODEL, d_state=N, expand=2, headdim=HEADDIM, ngroups=cfg["G"],
                              rope_fraction=cfg["rope_fraction"], is_mimo=cfg["mimo"], mimo_rank=R,
                              A_floor=cfg["A_floor"], dtypes=dtypes)
    return layer.randomize_(torch.Generator().manual_seed(seed + 1))


# ---- the transcription of upstream's Mamba3.step at e9594ce (float64, one request at a time) --------------
def up_heavy_tail(v: torch.Tensor) -> torch.Tensor:
    """Upstream's ``heavy_tail_activation``: 1 + v for v >= 0, 1 / (1 - v) for v < 0."""
    return v.clamp(min=0) + torch.reciprocal(1 - v.clamp(max=0))


def up_rms_norm(v: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Upstream's ``rms_norm_ref`` without z, bias or groups: over the last axis."""
    return v * (1 / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)) * weight


def up_rotary_qk(q, k, angle_state, angle_proj, dt, bias_q, bias_k, pairwise: bool):
    """Upstream's ``apply_rotary_qk_inference_reference`` (conjugate False): q, k (b, R, H, N); angle_state,
    angle_proj (b, H, S); dt (b, H); biases (R, H, N). Returns rotated q, k and the new angle state."""
    n, S = q.shape[-1], angle_state.shape[-1]
    angle = angle_state + torch.tanh(angle_proj) * dt[..., None] * math.pi  # (b, H, S)
    cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]  # (b, 1, H, S): the same for every rank

    def turn(v):
        if pairwise:  # pairs (2i, 2i + 1) of the first 2S entries; the rest pass through
            even, odd = v[..., 0:2 * S:2], v[..., 1:2 * S:2]
            turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
            return torch.cat((turned, v[..., 2 * S:]), dim=-1)
        pad = n // 2 - S  # pairs (i, i + N/2); pairs past S turn by angle 0
        c = torch.cat((cos, torch.ones(*cos.shape[:-1], pad, dtype=cos.dtype)), dim=-1)
        s_ = torch.cat((sin, torch.zeros(*sin.shape[:-1], pad, dtype=sin.dtype)), dim=-1)
        lo, hi = v[..., :n // 2], v[..., n // 2:]
        return torch.cat((lo * c - hi * s_, lo * s_ + hi * c), dim=-1)

    return turn(q + bias_q), turn(k + bias_k), angle


def up_step_update(state, A, B, C, xproj, x, zproj, z, dt, Bstate, Xstate, trap, D, outproj):
    """Upstream's ``selective_state_update_fused_ref_v2``: state (b, H, D, N), A/dt/trap (b, H), B/C/Bstate
    (b, R, H, N), x/z/Xstate (b, H, D), projections (R, H, D), D (H,). Returns (out (b, H, D), new state)."""
    alpha = torch.exp(A * dt)
    beta = (1 - trap) * dt * alpha
    gamma = trap * dt
    xv = x[:, None] * xproj  # (b, R, H, D)
    xsv = Xstate[:, None] * xproj
    new = (state * alpha[..., None, None]
           + torch.einsum("brhd,brhn->bhdn", xv * gamma[:, None, :, None], B)
           + torch.einsum("brhd,brhn->bhdn", xsv * beta[:, None, :, None], Bstate))
    y = torch.einsum("bhdn,brhn->brhd", new, C) + xv * D[:, None]
    zv = z[:, None] * zproj
    y = y * (zv * torch.sigmoid(zv))
    return torch.einsum("brhd,rhd->bhd", y, outproj), new


def transcribe_step(w: dict, cfg: dict, u: torch.Tensor, st: dict) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """Upstream's ``Mamba3.step`` for one request: ``u`` (d_model,), ``st`` its state (``ssm`` (H, D, N), ``k``
    (R, H, N) rotated B, ``v`` (H, D) x, ``angle`` (H, S) radians, never reduced). Returns (out (d_model,),
    the new st, dd_A (H,))."""
    H, Dh, Nn, Rr, G, S = (cfg[k] for k in ("H", "D", "N", "R", "G", "S"))
    d_inner = H * Dh
    sizes = [d_inner, d_inner, Rr * G * Nn, Rr * G * Nn, H, H, H, S]
    zxbc = u[None] @ w["in_proj.weight"].T  # a batch of one, as upstream's step sees it
    z, x, B, C, dd_dt, dd_A, trap, angle_proj = torch.split(zxbc, sizes, dim=-1)
    # _preprocess
    A = torch.clamp(-up_heavy_tail(dd_A), max=-cfg["A_floor"])
    DT = F.softplus(dd_dt + w["dt_bias"])
    trap = torch.sigmoid(trap)
    B = up_rms_norm(B.reshape(1, Rr, G, Nn), w["B_norm.weight"]).expand(-1, -1, H, -1)
    C = up_rms_norm(C.reshape(1, Rr, G, Nn), w["C_norm.weight"]).expand(-1, -1, H, -1)
    x, z = x.reshape(1, H, Dh), z.reshape(1, H, Dh)
    angle_proj = angle_proj[:, None, :].expand(-1, H, -1)
    # the rotary step: C as q, B as k; the biases (H, R, N) as (R, H, N)
    C, B, angle = up_rotary_qk(C, B, st["angle"][None], angle_proj, DT, w["C_bias"].permute(1, 0, 2),
                               w["B_bias"].permute(1, 0, 2), cfg["pairwise"])
    if cfg["mimo"]:
        xpj, zpj, opj = (w[k].permute(1, 0, 2) for k in ("mimo_x", "mimo_z", "mimo_o"))
    else:
        xpj = zpj = opj = torch.ones(1, H, Dh, dtype=u.dtype)
    y, ssm = up_step_update(st["ssm"][None], A, B, C, xpj, x, zpj, z, DT, st["k"][None], st["v"][None], trap,
                            w["D"], opj)
    out = y.reshape(1, d_inner) @ w["out_proj.weight"].T
    return out[0], dict(ssm=ssm[0], k=B[0], v=x[0], angle=angle[0]), dd_A[0]


# ---- the scenario, drawn once per seed --------------------------------------------------------------------
def draws(cfg: dict, seed: int) -> tuple[list, dict]:
    """Per step the lanes' hidden states (float64), and the prefilled request's state (a large angle)."""
    g = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(len(p["lanes"]), D_MODEL, generator=g, dtype=torch.float64) for p in PLAN]
    H, S = cfg["H"], cfg["S"]
    prefill = dict(ssm=0.3 * torch.randn(H, HEADDIM, N, generator=g, dtype=torch.float64),
                   k=torch.randn(cfg["R"], H, N, generator=g, dtype=torch.float64),
                   v=torch.randn(H, HEADDIM, generator=g, dtype=torch.float64),
                   angle=200 + 300 * torch.rand(H, S, generator=g, dtype=torch.float64))  # unreduced radians
    return hidden, prefill


def poisoned(pools: LayerPools, seed: int) -> LayerPools:
    g = torch.Generator().manual_seed(seed)
    for t in pools[:3]:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    pools.angle_state.copy_(torch.randint(-2**62, 2**62, pools.angle_state.shape, generator=g))
    return pools


def run_transcription(layer: Mamba3DecodeLayer, cfg: dict, seed: int, dd_A: list = None):
    """Yield, per step, the live lanes' outputs {lane: out} and the requests' dense states; each lane's
    ``dd_A`` is appended to ``dd_A`` when given."""
    w = {k: v.detach().double() for k, v in layer.state_dict().items()}
    assert all(v.ne(0).all() for v in w.values()), "a zero weight would hide a term"
    hidden, prefill = draws(cfg, seed)
    states, slot_of = {}, {}
    zero = dict(ssm=torch.zeros(cfg["H"], HEADDIM, N, dtype=torch.float64),
                k=torch.zeros(cfg["R"], cfg["H"], N, dtype=torch.float64),
                v=torch.zeros(cfg["H"], HEADDIM, dtype=torch.float64),
                angle=torch.zeros(cfg["H"], cfg["S"], dtype=torch.float64))
    for k, plan in enumerate(PLAN):
        for req, (slot, how) in plan.get("join", {}).items():
            src = {"fresh": zero, "prefill": prefill}.get(how) if isinstance(how, str) else states[how[1]]
            states[req], slot_of[req] = dict(src), slot
        outs = {}
        for lane, req in enumerate(plan["lanes"]):
            if req is not None:
                outs[lane], states[req], pre_A = transcribe_step(w, cfg, hidden[k][lane], states[req])
                if dd_A is not None:
                    dd_A.append(pre_A)
        yield outs, states, slot_of


def run_layer(layer: Mamba3DecodeLayer, pools: LayerPools, cfg: dict, seed: int, *, reference: bool):
    """Yield, per step, the layer's outputs (B, d_model), the lanes' src/dst and the pools before the step."""
    hidden, prefill = draws(cfg, seed)
    slot_of = {}
    for k, plan in enumerate(PLAN):
        src_of = {}
        for req, (slot, how) in plan.get("join", {}).items():
            slot_of[req] = slot
            if how == "fresh":
                pools.zero_rows_(slot)
            elif how == "prefill":  # what a server does with a prefill's final states
                for t, v in zip(pools[:3], (prefill["ssm"], prefill["k"], prefill["v"])):
                    t[slot] = v.to(t.dtype)
                pools.angle_state[slot] = angle_from_radians(prefill["angle"])
            else:  # a fork: read the cached prefix's row, write the request's own
                src_of[req] = slot_of[how[1]]
        dst = torch.tensor([-1 if r is None else slot_of[r] for r in plan["lanes"]], dtype=torch.int32)
        src = torch.tensor([-1 if r is None else src_of.get(r, slot_of[r]) for r in plan["lanes"]],
                           dtype=torch.int32)
        before = pools.clone()
        h = hidden[k] if reference else hidden[k].float()
        decode = layer.decode_reference if reference else layer.decode
        yield decode(h, pools, src, dst), src, dst, before


#: float64 rounding: the prefilled request's angle runs unreduced at 200-500 rad in the transcription,
#: where one float64 ulp is 1.1e-13 rad; the layer reduces it to fixed-point turns. Observed: <= 1.2e-13.
TOL64 = 1e-12


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def wrapped(theta: torch.Tensor) -> torch.Tensor:
    return torch.remainder(theta + math.pi, 2 * math.pi) - math.pi


# ---- tests -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("is_mimo,rope_fraction,bc_heads", CONFIGS)
def test_float64_decode_over_pools_matches_upstream_step(is_mimo, rope_fraction, bc_heads):
    cfg = config(is_mimo, rope_fraction, bc_heads)
    layer = make_layer(cfg, seed=3)
    pools = poisoned(layer.new_pools(P, reference=True), seed=4)
    dd_A = []
    steps = zip(run_layer(layer, pools, cfg, seed=5, reference=True), run_transcription(layer, cfg, seed=5, dd_A=dd_A))
    for k, ((out, src, dst, before), (want, states, slot_of)) in enumerate(steps):
        live = src >= 0
        assert rel_err(out[live], torch.stack([want[lane] for lane in sorted(want)])) < TOL64, k
        assert out[live].abs().max() > 0.1 and not out[~live].any()  # padding lanes: exact zeros
        for req in {r for r in PLAN[k]["lanes"] if r is not None}:  # the rows hold the requests' states
            row, st = slot_of[req], states[req]
            assert rel_err(pools.state[row], st["ssm"]) < TOL64
            assert rel_err(pools.Bstate[row], st["k"]) < TOL64
            assert rel_err(pools.Xstate[row], st["v"]) < 1e-14  # x: in_proj's rows, summed in another order
            theta = pools.angle_state[row].double() * (2 * math.pi / 2.0**64)
            assert (wrapped(theta - st["angle"])).abs().max() < TOL64
        written = set(dst[dst >= 0].tolist())
        for t, b in zip(pools, before):
            untouched = [r for r in range(P) if r not in written]
            assert torch.equal(t[untouched], b[untouched]), "a row no live lane writes changed"
    dd_A = torch.cat(dd_A)  # the draws reach both branches of the heavy-tail activation, and the clamp
    assert (dd_A >= 0).any() and ((dd_A < 0) & (dd_A > 1 - 1 / A_FLOOR)).any() and (dd_A < 1 - 1 / A_FLOOR).any()


@pytest.mark.parametrize("is_mimo,rope_fraction,bc_heads", CONFIGS)
def test_fp32_decode_matches_upstream_step(is_mimo, rope_fraction, bc_heads):
    """What runs (``decode``: fp32 storage, the step's fp32 CPU path) against the float64 transcription:
    fp32 rounding only (observed <= 5.2e-7 relative; 5e-6 is about 80 fp32 roundings of the largest value)."""
    cfg = config(is_mimo, rope_fraction, bc_heads)
    layer = make_layer(cfg, dtypes=FP32, seed=3)
    pools = poisoned(layer.new_pools(P), seed=4)
    steps = zip(run_layer(layer, pools, cfg, seed=5, reference=False), run_transcription(layer, cfg, seed=5))
    for k, ((out, src, _, _), (want, states, slot_of)) in enumerate(steps):
        assert out.dtype == torch.float32
        assert rel_err(out[src >= 0], torch.stack([want[lane] for lane in sorted(want)])) < 5e-6, k
        for req in {r for r in PLAN[k]["lanes"] if r is not None}:
            assert rel_err(pools.state[slot_of[req]], states[req]["ssm"]) < 5e-6, k


@pytest.mark.parametrize("is_mimo,rope_fraction,bc_heads", [CONFIGS[0], CONFIGS[7]])
@pytest.mark.parametrize("dtypes,tol", [(FP32, 5e-6), (LayerDtypes(), 3e-2)])
def test_fp32_decode_is_near_the_float64_decode(is_mimo, rope_fraction, bc_heads, dtypes, tol):
    """The CPU path (fp32 arithmetic; fp32 or bf16 storage of B and x) over the same scenario."""
    cfg = config(is_mimo, rope_fraction, bc_heads)
    layer = make_layer(cfg, dtypes=dtypes, seed=6)
    pools = poisoned(layer.new_pools(P), seed=7)
    pools64 = pools.reference()
    fast = run_layer(layer, pools, cfg, seed=8, reference=False)
    slow = run_layer(layer, pools64, cfg, seed=8, reference=True)
    errs = []
    for (out, src, _, _), (out64, _, _, _) in zip(fast, slow):
        assert out.dtype == torch.float32
        errs.append(rel_err(out, out64))
        assert torch.equal(out[src < 0], torch.zeros_like(out[src < 0]))
    assert max(errs) < tol and max(errs) > 0, errs  # > 0: the two paths really are different computations
    assert rel_err(pools.state, pools64.state) < tol
    assert torch.equal(pools.angle_state[6], pools64.angle_state[6])  # the never-used row, as poisoned


class PoolWatch(TorchDispatchMode):
    """Records every op outside the step that reads or writes memory of the pools."""

    def __init__(self, pools: LayerPools):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in pools}
        self.inside_step, self.touches = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.inside_step:
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages:
                    self.touches.append(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize("bc_heads", ["one", "all"])
def test_decode_is_one_step_call_and_touches_no_row_itself(monkeypatch, bc_heads):
    layer = make_layer(config(True, 0.5, bc_heads), seed=9)
    pools = poisoned(layer.new_pools(P), seed=10)
    calls, host_steps, watch = [], [], PoolWatch(pools)
    real_fn, real_host = layer_mod.mamba3_step_fn, api.host_step

    def counted(*args, **kwargs):
        calls.append(kwargs)
        watch.inside_step = True
        try:
            return real_fn(*args, **kwargs)
        finally:
            watch.inside_step = False

    monkeypatch.setattr(layer_mod, "mamba3_step_fn", counted)
    monkeypatch.setattr(api, "host_step", lambda *a: host_steps.append(1) or real_host(*a))
    slots = torch.tensor([3, -1, 0, 5], dtype=torch.int32)
    before = pools.clone()
    with watch:
        out = layer.decode(torch.randn(4, D_MODEL), pools, slots)
    assert len(calls) == 1 and len(host_steps) == 1 and watch.touches == []
    call = calls[0]
    assert call["update_kv_state"] is True and call["state_batch_indices"] is slots
    assert all(call[name] is t for name, t in zip(LayerPools._fields, pools))
    assert call["angle_proj"].stride(1) == 0 and call["B"].shape[2] == layer.num_bc_heads
    assert out.abs().max() > 0 and torch.equal(out[1], torch.zeros(D_MODEL))
    for t, b in zip(pools, before):  # the step did write the live lanes' rows
        assert not torch.equal(t[[3, 0, 5]], b[[3, 0, 5]]) and torch.equal(t[[1, 2, 4, 6]], b[[1, 2, 4, 6]])


def test_parameters_are_upstreams():
    """Names and shapes of upstream's Mamba3 (is_outproj_norm=False), so its weights load."""
    layer = Mamba3DecodeLayer(64, d_state=64, expand=2, headdim=32, ngroups=4, rope_fraction=0.5, mimo_rank=4)
    H, Dh, Nn, Rr, G, S = 4, 32, 64, 4, 4, 16
    want = {"in_proj.weight": (2 * 128 + 2 * Nn * G * Rr + 3 * H + S, 64), "dt_bias": (H,), "B_bias": (H, Rr, Nn),
            "C_bias": (H, Rr, Nn), "B_norm.weight": (Nn,), "C_norm.weight": (Nn,), "mimo_x": (H, Rr, Dh),
            "mimo_z": (H, Rr, Dh), "mimo_o": (H, Rr, Dh), "D": (H,), "out_proj.weight": (64, 128)}
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items()} == want
    siso = Mamba3DecodeLayer(64, d_state=64, headdim=32, is_mimo=False, rope_fraction=1.0)
    assert "mimo_x" not in siso.state_dict() and siso.B_bias.shape == (4, 1, 64) and siso.rotate_pairwise
    assert siso.num_rope_angles == 32 and layer.num_rope_angles == S
    with pytest.raises(ValueError, match="ngroups"):
        Mamba3DecodeLayer(64, d_state=64, headdim=32, ngroups=2)
