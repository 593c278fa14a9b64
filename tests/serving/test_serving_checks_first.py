"""Serving refuses a step before it writes anything, and its graph runner takes what decode_step takes.

* ``decode_step`` with a ``rand_seed`` made under ``torch.inference_mode()``, called outside it, is refused
  naming ``rand_seed`` before any pool row is stepped or the offset advanced (a retry then steps once).
* The graph runner runs every check of the step (the pool's included) before it copies a byte into its
  static buffers: a refused step leaves the buffers, the pool and the seed as they were.
* A runner built ``with_dst=True`` steps a replay pool's verify rounds as ``decode_step`` does (no
  destination for a verify step), bit for bit.

Each refusal is checked against a snapshot of every tensor reachable from the call (the pool's row
allocations, the seed, the runner's buffers) taken before it, byte for byte.
"""

from __future__ import annotations

import pytest
import torch

from mamba3_step.serving import CudaGraphStepRunner, ReplayStatePool, StatePool, StepForm, decode_step
from mamba3_step.testing import lane_inputs, layer_weights

H, D, N, R, P = 2, 32, 64, 2, 6


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().contiguous().view(torch.uint8) if t.dtype != torch.bool else t.clone()


def _snapshot(*groups) -> list:
    """Every tensor of ``groups`` (tensors, pools, dicts of buffers), as bytes."""
    out = []
    for g in groups:
        if isinstance(g, StatePool):
            out += [_bytes(t) for t in g._pools()]
        elif isinstance(g, dict):
            out += [_bytes(t) for _, t in sorted(g.items())]
        else:
            out.append(_bytes(g))
    return out


def _same(before: list, after: list) -> None:
    assert len(before) == len(after)
    for i, (a, b) in enumerate(zip(before, after)):
        assert torch.equal(a, b), f"tensor {i} changed"


def _filled_pool(cls=StatePool, seed=0, **kw):
    pool = cls(1, P, H, D, N, R, **kw)
    slots = pool.alloc(3)
    g = torch.Generator().manual_seed(seed)
    pool.state(0)[slots.long()] = torch.randn(3, H, D, N, generator=g).to(pool.state_dtype)
    return pool, slots


@pytest.mark.parametrize("state_dtype, replay", [(torch.bfloat16, False), (torch.int8, False), (torch.int8, True)])
def test_decode_step_refuses_an_inference_seed_before_stepping(state_dtype, replay):
    kw = dict(state_dtype=state_dtype, **(dict(replay_ring=2) if replay else {}))
    pool, slots = _filled_pool(ReplayStatePool if replay else StatePool, **kw)
    twin, _ = _filled_pool(ReplayStatePool if replay else StatePool, **kw)
    g = torch.Generator().manual_seed(1)
    w, lane = layer_weights(H, D, R, generator=g), lane_inputs(3, H, D, N, R, generator=g)
    with torch.inference_mode():
        seed = torch.tensor([7, 3], dtype=torch.int64)
    before = _snapshot(pool, seed)
    with pytest.raises(ValueError, match=r"^rand_seed: expected a tensor that can be written here, got an inference "
                                         r"tensor"):
        decode_step(pool, 0, slots, **lane, **w, stochastic_rounding=True, rand_seed=seed)
    _same(before, _snapshot(pool, seed))
    # the retry with a usable seed steps once: equal to a twin pool that was never refused
    out = decode_step(pool, 0, slots, **lane, **w, stochastic_rounding=True, rand_seed=seed.clone())
    want = decode_step(twin, 0, slots, **lane, **w, stochastic_rounding=True, rand_seed=torch.tensor([7, 3]))
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    _same(_snapshot(twin), _snapshot(pool))


def _runner_refusals():
    """(pool kwargs, runner kwargs, step kwargs, form to capture first, message) of steps the pool refuses."""
    with torch.inference_mode():
        seed = torch.tensor([5, 0], dtype=torch.int64)
    g = torch.Generator().manual_seed(2)
    two = lane_inputs(3, H, D, N, R, tokens=2, generator=g)
    return [
        (dict(state_dtype=torch.bfloat16), dict(stochastic_rounding=True, rand_seed=seed),
         lane_inputs(3, H, D, N, R, generator=g), StepForm(), r"^rand_seed: expected a tensor that can be written"),
        (dict(replay_ring=2), {}, two, StepForm(2), r"^x: a verify step of 2 tokens needs a ring with room"),
        (dict(replay_ring=2, replay_draft=2), dict(with_dst=True), dict(two, dst_slots="slots"), None,
         r"^dst_slots: expected None with a replay pool's verify step"),
        (dict(replay_ring=2, state_dtype=torch.bfloat16),
         dict(stochastic_rounding=True, rand_seed=torch.tensor([5, 0])),
         lane_inputs(3, H, D, N, R, generator=g), StepForm(), r"^stochastic_rounding: a replay pool with a bfloat16"),
    ]


@pytest.mark.parametrize("case", range(4))
def test_graph_runner_refuses_before_copying_into_its_buffers(case):
    pool_kw, runner_kw, step_kw, form, match = _runner_refusals()[case]
    cls = ReplayStatePool if "replay_ring" in pool_kw else StatePool
    pool, slots = _filled_pool(cls, **pool_kw)
    w = layer_weights(H, D, R, generator=torch.Generator().manual_seed(3))
    runner = CudaGraphStepRunner(pool, 0, buckets=(4,), **w, **runner_kw)
    if form is not None:
        runner.capture([4], form)
        for t in runner.buffers(4, form).values():  # a previous step's contents: visible if overwritten
            t.copy_(torch.full(t.shape, 3).to(t.dtype))
    step_kw = {k: (slots if v == "slots" else v) for k, v in step_kw.items()}
    reachable = (pool, *[t for t in step_kw.values() if isinstance(t, torch.Tensor)],
                 *[t for t in runner_kw.values() if isinstance(t, torch.Tensor)], slots)
    before = _snapshot(*reachable, *[runner.buffers(4, f) for _, f in runner.captured])
    with pytest.raises(ValueError, match=match):
        runner.step(slots, **step_kw)
    _same(before, _snapshot(*reachable, *[runner.buffers(4, f) for _, f in runner.captured]))


@pytest.mark.parametrize("tokens", [2, 1])
def test_runner_with_destinations_steps_replay_verify_rounds_as_decode_step(tokens):
    """with_dst=True: one-token steps take their default destination, verify steps none (their drafts stay
    in the ring), as decode_step takes them; every out and pool byte equal to decode_step's on a twin."""
    g = torch.Generator().manual_seed(6)
    a, slots = _filled_pool(ReplayStatePool, replay_ring=2, replay_draft=2)
    b, _ = _filled_pool(ReplayStatePool, replay_ring=2, replay_draft=2)
    w = layer_weights(H, D, R, generator=g)
    runner = CudaGraphStepRunner(a, 0, buckets=(4,), with_dst=True, **w)
    accepted = None
    for step in range(4):
        verify = step % 2 == 0
        lane = lane_inputs(3, H, D, N, R, tokens=tokens if verify else None, generator=g)
        got = runner.step(slots, **lane, num_accepted_tokens=accepted)
        want = decode_step(b, 0, slots, **lane, **w, num_accepted_tokens=accepted)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), step
        accepted = torch.randint(0, tokens + 1, (3,), generator=g, dtype=torch.int32) if verify else None
    _same(_snapshot(b), _snapshot(a))


@pytest.mark.parametrize("buckets, error, match", [
    (4, TypeError, r"^buckets: expected a sequence of this runner's buckets \(2, 4\) or None, got 4"),
    ("24", TypeError, r"^buckets: expected a sequence"),
    ([2, 3], ValueError, r"^buckets: 3 is not one of this runner's buckets \(2, 4\)"),
    ([2, True], ValueError, r"^buckets: True is not one of"),
])
def test_capture_checks_every_bucket_before_capturing_any(buckets, error, match):
    pool, _ = _filled_pool()
    runner = CudaGraphStepRunner(pool, 0, buckets=(2, 4), **layer_weights(H, D, R))
    with pytest.raises(error, match=match):
        runner.capture(buckets)
    assert runner.captured == ()


@pytest.mark.parametrize("method", ["alloc", "alloc_spec"])
@pytest.mark.parametrize("zero", [None, "no", 1, 0.0])
def test_alloc_zero_must_be_a_bool_and_a_refusal_allocates_nothing(method, zero):
    pool, _ = _filled_pool()
    free, before = pool.num_free, _snapshot(pool)
    args = (1,) if method == "alloc" else (1, 1)
    with pytest.raises(TypeError, match=r"^zero: expected a bool"):
        getattr(pool, method)(*args, zero=zero)
    assert pool.num_free == free
    _same(before, _snapshot(pool))


@pytest.mark.parametrize("name, value, match", [
    ("num_slots", 2**31, r"^num_slots: expected a positive int of at most 2147483647, got 2147483648"),
    ("nheads", 65536, r"^nheads: expected a positive int of at most 65535"),
])
def test_pool_sizes_past_the_steps_limits_are_refused_before_allocating(name, value, match):
    """Slot ids are int32 and the step takes at most 65535 heads: larger pools are refused by name, not by
    an allocation failure."""
    kw = dict(dict(num_layers=1, num_slots=P, nheads=H, headdim=D, dstate=N, mimo=R), **{name: value})
    with pytest.raises(ValueError, match=match):
        StatePool(**kw)
