"""The replay mode of ``mamba3_step_fn`` (``replay_ring``): the CPU route and the one validation.

* On CPU tensors the replay mode runs the CPU path with ``exact_outputs=True``: every ``out`` equals
  the stepwise step's bit for bit, flushes included, over a decode crossing several flushes.
* ``check_replay_inputs`` (what every device's path runs first, checked here on the CPU) returns the
  replay specialisation at its default tiling and refuses by name, before anything is written, what
  the kernel does not take and a ring that does not fit or shares memory; a repeated ring is checked
  in full once, and refused again by name wherever a later call changes what it must fit. The CPU
  path refuses the same calls with the same errors (``test_the_cpu_path_refuses_what_the_kernel_path_refuses``).

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank, K the flush length
(``replay_flush_length``).
"""

from __future__ import annotations

import pytest
import torch

from helpers import replay_call, replay_fn, replay_spec
from mamba3_step import mamba3_step_fn, new_ring, plan_step, replay_validation
from mamba3_step.reference import mamba3_step_reference
from mamba3_step.spec import flagship_spec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, row_tensors, with_rotary

P, H, D, N, R, K = 6, 2, 64, 128, 4, 4


def _call(pools: dict, lane: dict, weights: dict, index: torch.Tensor) -> StepTensors:
    return StepTensors(pools["state"], pools["Bstate"], pools["Xstate"], lane["A"], lane["B"], lane["C"], weights["D"],
                       lane["x"], lane["dt"], lane["trap"], weights["xproj"], outproj=weights["outproj"], z=lane["z"],
                       zproj=weights["zproj"], state_batch_indices=index, null_slot_id=5)


def _layer(seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = row_tensors(P, H, D, N, R, generator=g)
    return g, rows, layer_weights(H, D, R, generator=g)


def test_cpu_route_outputs_are_stepwise_bit_for_bit():
    g, rows, weights = _layer(1)
    replay, stepwise = {k: v.clone() for k, v in rows.items()}, {k: v.clone() for k, v in rows.items()}
    ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
    index = torch.tensor([3, -1, 0], dtype=torch.int32)
    for s in range(2 * K + 1):
        lane = lane_inputs(3, H, D, N, R, generator=g)
        got = replay_fn(_call(replay, lane, weights, index), ring, K)
        want = mamba3_step_reference(_call(stepwise, lane, weights, index), update_kv_state=True)
        assert bits_equal(got, want), f"step {s}"
        if int(ring.length[3, 0]) == 0:
            assert all(bits_equal(replay[k][3], stepwise[k][3]) for k in rows), f"step {s}: the flush"


def test_kernel_spec_is_the_replay_specialisation_at_its_default_tiling():
    g, rows, weights = _layer(2)
    ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
    call = _call(rows, lane_inputs(3, H, D, N, R, generator=g), weights, torch.tensor([0, 1, 2], dtype=torch.int32))
    assert replay_spec(call, ring, K) == flagship_spec(replay_ring=K)


def _refused(call, ring, message, **kw):
    before = [t.clone() for t in (*call, *ring) if isinstance(t, torch.Tensor)]
    with pytest.raises((ValueError, TypeError), match=message):
        replay_spec(call, ring, kw.pop("flush_length", K), **kw)
    after = [t for t in (*call, *ring) if isinstance(t, torch.Tensor)]
    assert all(bits_equal(a, b) for a, b in zip(after, before)), "a refused call wrote"


def test_kernel_spec_refuses_what_the_kernel_does_not_take_by_name():
    g, rows, weights = _layer(3)
    ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16, draft=2)
    index = torch.tensor([0, 1], dtype=torch.int32)
    call = _call(rows, lane_inputs(2, H, D, N, R, generator=g), weights, index)
    accepted = torch.zeros(2, dtype=torch.int32)
    _refused(call, ring, "replay_from_checkpoint takes no num_accepted", num_accepted_tokens=accepted, replay_from_checkpoint=True)
    assert replay_spec(call, ring, K, num_accepted_tokens=accepted) == flagship_spec(replay_ring=K, num_accepted=True,
                                                                                  replay_draft=2)  # the ring's room
    drafts = _call(rows, lane_inputs(2, H, D, N, R, tokens=2, generator=g), weights, index)
    assert replay_spec(drafts, ring, K, num_accepted_tokens=accepted, replay_from_checkpoint=True) == flagship_spec(
        replay_ring=K, tokens=2, num_accepted=True, replay_from_checkpoint=True)  # the drafts from the state
    _refused(drafts, ring, r"^num_accepted_tokens: expected dtype int32, got int64", num_accepted_tokens=accepted.long())
    _refused(drafts, ring, r"^num_accepted_tokens: expected shape \(B\) = \(2,\), got \(3,\)", num_accepted_tokens=torch.zeros(3, dtype=torch.int32))
    _refused(drafts, ring, r"^num_accepted_tokens: expected innermost stride 1", num_accepted_tokens=torch.zeros(4, dtype=torch.int32)[::2])
    _refused(drafts, ring, "accepted", num_accepted_tokens=ring.length.view(-1)[:2])  # a ring byte: written by the step
    assert replay_spec(drafts, ring, K, num_accepted_tokens=accepted) == flagship_spec(replay_ring=K, tokens=2,
                                                                                  num_accepted=True)
    assert replay_spec(drafts, ring, K) == flagship_spec(replay_ring=K, tokens=2)
    moved = index.flip(0).contiguous()  # one-token steps take destinations; a verify step refuses them
    assert replay_spec(call._replace(dst_state_batch_indices=moved), ring, K) == flagship_spec(
        replay_ring=K, has_dst=True)
    _refused(drafts._replace(dst_state_batch_indices=moved), ring, "dst_state_batch_indices with a verify step")
    rotary = StepTensors(**with_rotary({**call._asdict(), "state": rows["state"]}, 16, seed=4))
    rotary_ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16, rope_angles=16)
    assert replay_spec(rotary, rotary_ring, K) == flagship_spec(replay_ring=K, rope_angles=16, has_bc_bias=True)
    assert replay_spec(rotary, rotary_ring, K, replay_from_checkpoint=True) == flagship_spec(
        replay_ring=K, rope_angles=16, has_bc_bias=True, replay_from_checkpoint=True)
    rotary_drafts = StepTensors(**with_rotary({**drafts._asdict(), "state": rows["state"]}, 16, seed=5))
    draft_ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16, rope_angles=16, draft=2)
    assert replay_spec(rotary_drafts, draft_ring, K) == flagship_spec(replay_ring=K, tokens=2, rope_angles=16,
                                                                             has_bc_bias=True)
    _refused(rotary_drafts, draft_ring, "verify step .* takes no rope_angles", replay_from_checkpoint=True)
    _refused(rotary, rotary_ring._replace(angle=rotary.angle_state.view(P, 1, H, 16).expand(-1, K - 1, -1, -1)),
             "ring_angle: expected a tensor whose elements do not overlap")  # the kernel writes it
    shared = torch.zeros(rotary_ring.angle.numel(), dtype=torch.int64)
    _refused(rotary._replace(angle_state=shared[:P * H * 16].view(P, H, 16)),
             rotary_ring._replace(angle=shared.view(rotary_ring.angle.shape)),
             "ring_angle: expected memory disjoint from angle_state")
    eight = row_tensors(P, H, D, N, R, state_dtype="int8", generator=g)  # 8-bit: always rounded stochastically
    rounded = call._replace(state=eight["state"], state_scale=eight["state_scale"], rand_seed=torch.tensor([7, 3]))
    rounded_ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16, stochastic=True)
    assert replay_spec(rounded, rounded_ring, K) == flagship_spec(replay_ring=K, state_dtype="int8",
                                                                          stochastic_rounding=True)
    assert replay_spec(rounded, rounded_ring, K, replay_from_checkpoint=True) == flagship_spec(
        replay_ring=K, state_dtype="int8", stochastic_rounding=True, replay_from_checkpoint=True)
    _refused(rounded, rounded_ring._replace(offset=rounded_ring.offset[:, :, :1].clone()), r"ring.offset must be "
             r"torch.int64 of shape \(6, 3, 2\)")  # one per (row, entry, head): each kernel CTA owns its head's
    _refused(rounded, rounded_ring._replace(drawn_for=rounded.state_batch_indices.view(1, 1, 2).expand(P, K - 1, -1)),
             "ring_drawn_for: expected a tensor whose elements do not overlap")
    _refused(call, ring, "replay_flush_length must be an int in", flush_length=1)
    _refused(call, ring, "tile_D >= headdim", tile_D=32)
    assert replay_spec(call, ring, K) == flagship_spec(replay_ring=K)  # this ring checked and kept
    with pytest.raises(TypeError, match="tile_D: expected an int or None, got list"):
        replay_spec(call, ring, K, tile_D=[64])
    with pytest.raises(TypeError, match="num_warps: expected an int or None, got dict"):
        replay_spec(call, ring, K, num_warps={})
    _refused(call, ring, "num_warps: expected a positive int or None", num_warps=0)
    _refused(call, ring, r"^replay_flush_length: expected an int or None, got list", flush_length=[4])


def test_kernel_spec_refuses_a_ring_that_does_not_fit_or_shares_memory():
    g, rows, weights = _layer(4)
    ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
    call = _call(rows, lane_inputs(2, H, D, N, R, generator=g), weights, torch.tensor([0, 1], dtype=torch.int32))
    _refused(call, ring._replace(length=ring.length[:, :1].clone()), r"ring.length must be torch.int32 of shape \(6, 2\)")
    _refused(call, ring._replace(x=ring.x.float()), "ring.x must be torch.bfloat16")
    short = new_ring(P, 2, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
    _refused(call, short, "the ring holds 1 entries; replay_flush_length = 4")
    shared = ring._replace(x=ring.B.view(-1)[: ring.x.numel()].view(ring.x.shape))
    _refused(call, shared, "ring_B: expected memory disjoint from ring_x")
    broadcast = ring._replace(coef=ring.coef[:, :, :1].expand(-1, -1, H, -1))
    _refused(call, broadcast, "ring_coef: expected a tensor whose elements do not overlap")


def test_a_repeated_ring_is_checked_once_and_its_addresses_every_call(monkeypatch):
    """A server's ring (same tensors every step, new lane inputs) costs the full ring check once; the
    ring-vs-argument disjointness is still decided on every call."""
    g, rows, weights = _layer(5)
    ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
    index = torch.tensor([0, 1], dtype=torch.int32)
    full, check = [], replay_validation.checked_replay_spec
    monkeypatch.setattr(replay_validation, "_RING_CHECKS", {})  # no entry of an earlier test at a reused address
    monkeypatch.setattr(replay_validation, "checked_replay_spec", lambda *a: full.append(1) or check(*a))
    specs = [replay_spec(_call(rows, lane_inputs(2, H, D, N, R, generator=g), weights, index), ring, K)
             for _ in range(3)]
    assert specs == [flagship_spec(replay_ring=K)] * 3 and len(full) == 1
    lane = lane_inputs(2, H, D, N, R, generator=g)
    aliased = ring.x.view(-1)[: lane["x"].numel()].view(lane["x"].shape)  # x read from the ring's own bytes
    _refused(_call(rows, {**lane, "x": aliased}, weights, index), ring, "ring_x: expected memory disjoint from x")
    assert len(full) == 2


def test_a_checked_ring_is_refused_again_where_the_call_changes_what_it_must_fit():
    """After a ring passed with one call, a call it does not fit (another pool size, an inference
    ring outside inference mode, another K, rotary) is refused by name as on a first call."""
    g, rows, weights = _layer(6)
    index = torch.tensor([0, 1], dtype=torch.int32)
    with torch.inference_mode():
        ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
        lane = lane_inputs(2, H, D, N, R, generator=g)
        assert replay_spec(_call(rows, lane, weights, index), ring, K) == flagship_spec(replay_ring=K)
    lane = lane_inputs(2, H, D, N, R, generator=g)
    _refused(_call(rows, lane, weights, index), ring, "ring_B: expected a tensor that can be written here")
    ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
    assert replay_spec(_call(rows, lane, weights, index), ring, K) == flagship_spec(replay_ring=K)
    bigger = row_tensors(P + 1, H, D, N, R, generator=g)
    _refused(_call(bigger, lane, weights, index), ring, r"ring.B must be torch.bfloat16 of shape \(7,")
    _refused(_call(rows, lane, weights, index), ring, "the ring holds 3 entries; replay_flush_length = 5", flush_length=5)
    rotary = with_rotary({**_call(rows, lane, weights, index)._asdict()}, 16, seed=7)
    _refused(StepTensors(**rotary), ring, "ring.angle must be")



def _freed(t: torch.Tensor) -> torch.Tensor:
    u = t.clone()
    u.untyped_storage().resize_(0)
    return u


def test_odd_scalars_and_bundles_are_refused_by_name_on_every_replay_entry():
    """What the replay surface's fuzz harness found (tests/fuzz_replay_surface.py): an ``x`` that is
    no tensor (on ``mamba3_step_fn``'s replay mode, and ``decode_step`` on a replay pool), a plan's run
    given no ring or no tensors, a freed tensor as the flush length (its repr must not read the
    values), a tensor as ``replay_from_checkpoint`` (no ambiguous-truth error on the CPU path): each a
    named error, and nothing is written."""
    g, rows, weights = _layer(6)
    ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
    call = _call(rows, lane_inputs(2, H, D, N, R, generator=g), weights, torch.tensor([0, 1], dtype=torch.int32))
    bundle, options = replay_call(call, ring, K)
    plan = plan_step(**bundle._asdict(), **options._asdict())
    before = [t.clone() for t in (*call, *ring) if isinstance(t, torch.Tensor)]
    cases = [
        (lambda: replay_fn(call._replace(x=7), ring, K), TypeError, r"^x: expected a torch.Tensor, got int"),
        (lambda: plan.run(**bundle._replace(state=True)._asdict()), TypeError, r"^state: expected a torch.Tensor"),
        (lambda: plan.run(**bundle._replace(replay_ring="ring")._asdict()), TypeError,
         r"^mamba3_step_fn: replay_ring must be a mamba3_step.Ring"),
        (lambda: replay_spec(call, ring, _freed(torch.zeros(3, dtype=torch.int32))), TypeError,
         r"^replay_flush_length: expected an int or None, got Tensor"),
        (lambda: replay_fn(call, ring, K, replay_from_checkpoint=torch.ones(2)), TypeError,
         r"^replay_from_checkpoint: expected a bool, got torch.Tensor"),
        (lambda: plan_step(**bundle._asdict(), **options._replace(replay_from_checkpoint=1)._asdict()), TypeError,
         r"^replay_from_checkpoint: expected a bool"),
        (lambda: mamba3_step_fn(**call._asdict(), update_kv_state=True, replay_flush_length=K), ValueError,
         r"^replay_flush_length: expected None without replay_ring"),
        (lambda: replay_fn(call, ring, K, update_kv_state=False), ValueError,
         r"^update_kv_state: expected True with replay_ring"),
    ]
    for run, exc, message in cases:
        with pytest.raises(exc, match=message):
            run()
    after = [t for t in (*call, *ring) if isinstance(t, torch.Tensor)]
    assert all(bits_equal(a, b) for a, b in zip(after, before)), "a refused call wrote"


@pytest.mark.parametrize("kind", ["nested", "sparse", "freed", "quantized", "complex"])
def test_a_replay_pools_materialize_refuses_odd_weights_by_name(kind):
    """``ReplayStatePool.materialize`` checks each weight by the step's table (it checked shape and
    device only: a nested, freed, sparse or quantized weight raised torch's own errors, and a complex
    one was silently cast)."""
    from mamba3_step.serving import ReplayStatePool

    pool = ReplayStatePool(1, 4, H, 32, 32, 2, replay_ring=3)
    slots = pool.alloc(2).tolist()
    w = layer_weights(H, 32, 2, generator=torch.Generator().manual_seed(7))
    odd = {"nested": lambda t: torch.nested.nested_tensor([t.reshape(-1)[:2], t.reshape(-1)[:3]]),
           "sparse": lambda t: t.to_sparse(), "freed": _freed,
           "quantized": lambda t: torch.quantize_per_tensor(t.float(), 0.1, 0, torch.qint8),
           "complex": lambda t: t.to(torch.complex64)}[kind]
    for name in ("xproj", "D", "zproj", "outproj"):
        kw = dict(w, **{name: odd(w[name])})
        with pytest.raises((TypeError, ValueError), match=rf"^{name}: expected"):
            pool.materialize(0, slots, **kw)
    assert pool.materialize(0, slots, **w).state.shape == (2, H, 32, 32)


def _cpu_case(kind: str):
    """A replay call on CPU tensors that the kernel path refuses: ``(call, ring, options, exception, message)``.
    The ring and rows hold random values, so a write anywhere shows."""
    g, rows, weights = _layer(11)
    rows["Xstate"] = None
    L = K - 1
    ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
    for t in ring[:3]:
        t.copy_(torch.randn(t.shape, generator=g))
    ring.length.fill_(1)
    carrier = torch.randn(P, L, H, D, generator=g).to(torch.bfloat16)
    rows["Xstate"] = carrier[:, 0] if kind == "ring aliases Xstate" else carrier[:, 0].clone()
    call = _call(rows, lane_inputs(2, H, D, N, R, generator=g), weights, torch.tensor([0, 1], dtype=torch.int32))
    options = {}
    if kind == "ring aliases Xstate":
        return call, ring._replace(x=carrier), options, ValueError, "ring_x: expected memory disjoint from Xstate"
    if kind == "stride-0 ring length":
        return (call, ring._replace(length=ring.length[:1].expand(P, H)), options, ValueError,
                "ring_length: expected a tensor whose elements do not overlap")
    if kind == "inference ring":
        with torch.inference_mode():
            made = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
            for t, v in zip(made, ring):
                if t is not None:
                    t.copy_(v)
        return call, made, options, ValueError, "ring_B: expected a tensor that can be written here"
    option, value, exc, message = {
        "tile_D='abc'": ("tile_D", "abc", TypeError, "tile_D: expected an int or None, got str"),
        "tile_D=True": ("tile_D", True, TypeError, "tile_D: expected an int or None, got bool"),
        "num_warps=-1": ("num_warps", -1, ValueError, "num_warps: expected a positive int or None"),
        "tile_D below the head dim": ("tile_D", D // 2, ValueError, "replay_ring needs tile_D >= headdim"),
    }[kind]
    return call, ring, {option: value}, exc, message


def _reachable(call: StepTensors, ring) -> list:
    return [t for t in (*call, *ring) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("kind", ["ring aliases Xstate", "stride-0 ring length", "tile_D='abc'", "tile_D=True",
                                  "num_warps=-1", "tile_D below the head dim", "inference ring"])
def test_the_cpu_path_refuses_what_the_kernel_path_refuses(kind, monkeypatch):
    """One validation for every device: a replay call on CPU tensors that the kernel path refuses is
    refused on the CPU path with the same named error, before anything is written (every tensor reachable
    from the arguments unchanged, byte for byte); the kernel path (CUDA routing forced, nothing launched)
    raises the same error from the same check."""
    from mamba3_step import api

    call, ring, options, exc, message = _cpu_case(kind)
    before = [t.clone() for t in _reachable(call, ring)]
    errors = []
    with pytest.raises(exc, match=message) as cpu:
        replay_fn(call, ring, K, **options)
    errors.append(cpu.value)
    with pytest.raises(exc, match=message) as checked:
        replay_spec(call, ring, K, **options)  # what every path calls first
    errors.append(checked.value)
    launched = []
    monkeypatch.setattr(api, "runs_kernel", lambda x: True)
    monkeypatch.setattr(api, "launch_step", lambda spec, tensors: launched.append(spec))
    with pytest.raises(exc, match=message) as kernel:
        replay_fn(call, ring, K, **options)
    errors.append(kernel.value)
    assert not launched
    assert len({(type(e), str(e)) for e in errors}) == 1, errors
    after = _reachable(call, ring)
    assert all(bits_equal(a, b) for a, b in zip(after, before)), "a refused call wrote"


def test_both_paths_run_the_call_the_validation_admits(monkeypatch):
    """The spec the kernel path launches is the one validation's (the CPU path runs the same call)."""
    from mamba3_step import api

    g, rows, weights = _layer(12)
    ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
    call = _call(rows, lane_inputs(2, H, D, N, R, generator=g), weights, torch.tensor([0, 1], dtype=torch.int32))
    launched = []
    monkeypatch.setattr(api, "runs_kernel", lambda x: True)
    monkeypatch.setattr(api, "launch_step", lambda spec, tensors: launched.append((spec, tensors.replay_ring)))
    replay_fn(call, ring, K)
    assert launched == [(flagship_spec(replay_ring=K), ring)] and launched[0][0] == replay_spec(call, ring, K)
