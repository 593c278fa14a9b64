"""Plan once, run many, in the replay mode (``plan_step`` with ``replay_ring``): the plan validates a
replay call signature once; ``StepPlan.run`` checks only what can change between steps, then does
exactly what ``mamba3_step_fn`` does.

* ``run`` equals ``mamba3_step_fn`` bit for bit on CPU tensors (outs, rows, every ring tensor) over
  decodes crossing flushes, one-token and verify steps with ``num_accepted_tokens``, with fresh lane
  tensors every step;
* on the kernel path (a stand-in kernel recording what it is given; the replay validation runs on
  any device) ``run`` passes what ``mamba3_step_fn`` passes and runs no full validation, for every
  layer of a pool whose rings share the signature;
* bad input gets ``mamba3_step_fn``'s exception and changes nothing, a ring sharing memory with an
  argument included; a valid call of another signature raises ``StepPlanMismatch`` naming what
  changed, and changes nothing;
* a ring tensor of another kind (nested, sparse, freed, meta) is refused by name on every replay
  path, the validation of a cached ring included, and the process survives.

Letters: B lanes, T tokens, P pool rows, H heads, D head dim, N state size, R MIMO rank, K the flush
length (``replay_flush_length``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import RecordingKernel, replay_call, replay_fn, replay_spec

import mamba3_step.api as api
import mamba3_step.plan as plan_module
from mamba3_step import StepPlan, StepPlanMismatch, new_ring, plan_step, replay
from mamba3_step.spec import flagship_spec
from mamba3_step.tensors import StepTensors, kernel_arguments
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, row_tensors

P, H, D, N, R, K = 7, 2, 64, 128, 4, 4
NULL = 6


class Layer:
    """One layer's rows and ring, and a generator for its lane inputs."""

    def __init__(self, seed: int, draft: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.rows = row_tensors(P, H, D, N, R, generator=self.g)
        self.w = layer_weights(H, D, R, generator=self.g)
        self.ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16, draft=draft)

    def clone(self) -> "Layer":
        other = object.__new__(Layer)
        other.g, other.w = self.g, self.w
        other.rows = {k: v.clone() for k, v in self.rows.items()}
        other.ring = type(self.ring)(*(None if v is None else v.clone() for v in self.ring))
        return other

    def call(self, lane: dict, index: torch.Tensor) -> StepTensors:
        r, w = self.rows, self.w
        return StepTensors(r["state"], r["Bstate"], r["Xstate"], lane["A"], lane["B"], lane["C"], w["D"], lane["x"],
                           lane["dt"], lane["trap"], w["xproj"], outproj=w["outproj"], z=lane["z"],
                           zproj=w["zproj"], state_batch_indices=index, null_slot_id=NULL)

    def lane(self, B: int, tokens=None) -> dict:
        return lane_inputs(B, H, D, N, R, tokens=tokens, generator=self.g)


INDEX = torch.tensor([3, -1, 0, NULL, 5], dtype=torch.int32)


def _plan(call: StepTensors, ring, **kwargs) -> StepPlan:
    """``plan_step`` in the replay mode, for calls like ``call`` with ``ring`` (:func:`helpers.replay_call`)."""
    tensors, options = replay_call(call, ring, K, **kwargs)
    return plan_step(**tensors._asdict(), **options._asdict())


def _run(plan: StepPlan, call: StepTensors, ring, accepted=None) -> torch.Tensor:
    """``plan.run`` of ``call`` with ``ring`` and ``num_accepted_tokens`` ``accepted``."""
    return plan.run(**call._replace(replay_ring=ring, num_accepted_tokens=accepted)._asdict())


def _same_layers(a: Layer, b: Layer, where: str) -> None:
    assert all(bits_equal(a.rows[k], b.rows[k]) for k in a.rows), f"{where}: rows"
    assert all(bits_equal(x, y) for x, y in zip(a.ring, b.ring) if x is not None), f"{where}: ring"


@pytest.mark.parametrize("verify", [False, True], ids=["one-token", "verify-T2"])
def test_run_equals_the_replay_mode_bit_for_bit_step_after_step(verify):
    fn = Layer(1, draft=2 if verify else 0)
    planned = fn.clone()
    B, T = len(INDEX), (2 if verify else None)
    accepted = torch.zeros(B, dtype=torch.int32) if verify else None
    plan = _plan(planned.call(planned.lane(B, T), INDEX), planned.ring, num_accepted_tokens=accepted)
    for step in range(2 * K + 1):
        lane = fn.lane(B, T)  # new values and addresses every step
        if verify and step:
            accepted = torch.randint(0, 3, (B,), generator=fn.g, dtype=torch.int32)
        want = replay_fn(fn.call(lane, INDEX), fn.ring, K, num_accepted_tokens=accepted)
        got = _run(plan, planned.call(lane, INDEX), planned.ring, accepted)
        assert bits_equal(got, want), f"step {step}: out"
        _same_layers(planned, fn, f"step {step}")
    assert int(fn.ring.length.max()) < K - 1 + (3 if verify else 1)  # rows flushed on the way


@pytest.fixture
def kernel_path(monkeypatch):
    """CPU tensors take the kernel path: one recorder stands for every compiled kernel."""
    recorder = RecordingKernel()
    for module in (plan_module, api):
        monkeypatch.setattr(module, "runs_kernel", lambda x: True)
    monkeypatch.setattr(plan_module, "kernel_for", lambda spec, x: recorder)
    monkeypatch.setattr(api, "launch_step", lambda spec, tensors: recorder(*kernel_arguments(tensors)))
    return recorder


def _same_launch(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_run_launches_what_the_replay_mode_launches_without_validating(kernel_path, monkeypatch):
    """Every layer of a pool (rings of one signature), one-token steps with destinations: the same
    launch arguments as mamba3_step_fn's, and no full validation after the plan."""
    layers = [Layer(2), Layer(3)]
    out = torch.empty(len(INDEX), H, D, dtype=torch.bfloat16)
    dst = torch.tensor([4, -1, 0, NULL, 5], dtype=torch.int32)
    lane = layers[0].lane(len(INDEX))
    plan = _plan(layers[0].call(lane, INDEX)._replace(out=out, dst_state_batch_indices=dst), layers[0].ring)
    assert plan.spec == flagship_spec(replay_ring=K, has_dst=True)
    validations = []
    monkeypatch.setattr(plan_module, "check_replay_inputs", lambda *a: validations.append(a))
    monkeypatch.setattr(plan_module, "check_step_inputs", lambda *a, **k: validations.append(a))
    for step in range(3):
        for layer in layers:
            call = layer.call(layer.lane(len(INDEX)), INDEX)._replace(out=out, dst_state_batch_indices=dst)
            assert _run(plan, call, layer.ring) is out
            replay_fn(call, layer.ring, K)
            assert _same_launch(kernel_path.calls[-2], kernel_path.calls[-1]), f"step {step}"
    assert validations == []


def test_bad_input_gets_the_replay_modes_error_and_changes_nothing(kernel_path):
    layer = Layer(4, draft=2)
    lane = layer.lane(len(INDEX), tokens=2)
    accepted = torch.ones(len(INDEX), dtype=torch.int32)
    plan = _plan(layer.call(lane, INDEX), layer.ring, num_accepted_tokens=accepted)
    good = layer.call(lane, INDEX)
    bad = {
        "accepted int64": (good, layer.ring, accepted.long()),
        "accepted a ring byte": (good, layer.ring, layer.ring.length.view(-1)[: len(INDEX)]),
        "x float32": (good._replace(x=good.x.float()), layer.ring, accepted),
        "ring.x float32": (good, layer.ring._replace(x=layer.ring.x.float()), accepted),
        "ring.x aliases ring.B": (good, layer.ring._replace(
            x=layer.ring.B.view(-1)[: layer.ring.x.numel()].view(layer.ring.x.shape)), accepted),
    }
    buf = torch.zeros(P * H + len(INDEX), dtype=torch.int32)  # a ring length whose last bytes are the index's
    shared = buf[P * H - 2: P * H - 2 + len(INDEX)]
    shared.copy_(INDEX)
    bad["ring.length shares the index's bytes"] = (good._replace(state_batch_indices=shared),
                                                   layer.ring._replace(length=buf[: P * H].view(P, H)), accepted)
    for name, (call, ring, acc) in bad.items():
        before = [t.clone() for t in (*call, *ring, acc) if isinstance(t, torch.Tensor)]
        with pytest.raises((TypeError, ValueError)) as want:
            replay_fn(call, ring, K, num_accepted_tokens=acc)
        with pytest.raises(type(want.value)) as got:
            _run(plan, call, ring, acc)
        assert str(got.value) == str(want.value), name
        assert not isinstance(got.value, StepPlanMismatch), name
        after = [t for t in (*call, *ring, acc) if isinstance(t, torch.Tensor)]
        assert all(bits_equal(a, b) for a, b in zip(after, before)), f"{name}: a refused call wrote"
    assert not kernel_path.calls


@pytest.mark.parametrize("change", ["batch", "ring entries", "accepted given", "null_slot_id", "inference mode"])
def test_a_valid_call_of_another_signature_is_refused_naming_what_changed(change, kernel_path):
    layer = Layer(5, draft=2)
    plan = _plan(layer.call(layer.lane(len(INDEX)), INDEX), layer.ring)
    call, ring, accepted = layer.call(layer.lane(len(INDEX)), INDEX), layer.ring, None
    expect = {"batch": "x: planned shape", "ring entries": "replay_ring.B: planned",
              "accepted given": "num_accepted_tokens: planned None",
              "null_slot_id": "null_slot_id: planned 6, got 2", "inference mode": "torch.inference_mode"}[change]
    if change == "batch":
        call = layer.call(layer.lane(2), INDEX[:2])
    elif change == "ring entries":
        ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
    elif change == "accepted given":
        accepted = torch.zeros(len(INDEX), dtype=torch.int32)
    elif change == "null_slot_id":
        call = call._replace(null_slot_id=2)
    before = [t.clone() for t in (*call, *ring) if isinstance(t, torch.Tensor)]
    with pytest.raises(StepPlanMismatch, match=expect):
        if change == "inference mode":
            with torch.inference_mode():
                _run(plan, call, ring, accepted)
        else:
            _run(plan, call, ring, accepted)
    after = [t for t in (*call, *ring) if isinstance(t, torch.Tensor)]
    assert all(bits_equal(a, b) for a, b in zip(after, before))
    assert not kernel_path.calls
    replay_fn(call, ring, K, num_accepted_tokens=accepted)  # valid: mamba3_step_fn runs it
    assert len(kernel_path.calls) == 1


def test_plan_step_refuses_what_the_replay_mode_refuses():
    layer = Layer(6)
    call = layer.call(layer.lane(len(INDEX)), INDEX)
    with pytest.raises(ValueError, match="^plan_step: replay_flush_length must be an int in"):
        _plan(call, layer.ring, replay_flush_length=1)
    with pytest.raises(ValueError, match="^update_kv_state: expected True with replay_ring"):
        _plan(call, layer.ring, update_kv_state=False)
    for ring, what in (("ring", "replay_ring must be a mamba3_step.Ring"), (tuple(layer.ring), "replay_ring must be"),
                       (layer.ring._replace(B=[0]), "replay_ring.B: expected a torch.Tensor, got list"),
                       (layer.ring._replace(angle=3), "replay_ring.angle: expected a torch.Tensor or None, got int")):
        for entry in (_plan, lambda c, r: replay_fn(c, r, K)):
            with pytest.raises(TypeError, match=what):
                entry(call, ring)
    with pytest.raises(ValueError, match="the ring holds 1 entries; replay_flush_length = 4"):
        _plan(call, new_ring(P, 2, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16))


def test_a_plan_says_what_it_is(kernel_path):
    layer = Layer(7)
    plan = _plan(layer.call(layer.lane(2), INDEX[:2]), layer.ring)
    assert isinstance(plan, StepPlan) and plan.options["replay_flush_length"] == K
    assert repr(plan).startswith("StepPlan(") and f"replay_flush_length={K}" in repr(plan)
    assert plan.options == dict(update_kv_state=True, tile_D=None, num_warps=None, rotate_pairwise=False,
                                stochastic_rounding=False, replay_flush_length=K, replay_from_checkpoint=False,
                                validate_indices=False)


def _odd(kind: str, t: torch.Tensor) -> torch.Tensor:
    if kind == "nested":
        return torch.nested.nested_tensor([t[0].float(), t[-1].float()])
    if kind == "sparse":
        return t.float().to_sparse()
    if kind == "freed":  # its storage freed under it: a kernel writing it would write memory it no longer owns
        u = t.clone()
        u.untyped_storage().resize_(0)
        return u
    if kind == "meta":
        return torch.empty_like(t, device="meta")
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["nested", "sparse", "freed", "meta"])
def test_every_ring_tensor_kind_is_refused_by_name_on_every_replay_path(kind, kernel_path):
    """A ring tensor of another kind, on the CPU path, the kernel's validation (cached ring or not)
    and a plan's run: a named TypeError/ValueError naming the ring field, nothing written. Before
    the ring's tensors were checked like every argument, a freed one passed the kernel's validation
    and nested or sparse ones raised torch's own errors."""
    layer = Layer(8)
    call = layer.call(layer.lane(len(INDEX)), INDEX)
    plan = _plan(call, layer.ring)
    replay_spec(call, layer.ring, K)  # this ring checked and kept: the cached path
    for field in ("B", "x", "coef", "length"):
        ring = layer.ring._replace(**{field: _odd(kind, getattr(layer.ring, field))})
        before = [t.clone() for t in (*call, *layer.ring) if isinstance(t, torch.Tensor)]
        paths = {"validation": lambda: replay_spec(call, ring, K),
                 "plan.run": lambda: _run(plan, call, ring),
                 "mamba3_step_fn": lambda: replay_fn(call, ring, K),
                 "cpu path": lambda: replay.replay_step(call, ring, K)}
        for path, run in paths.items():
            with pytest.raises((TypeError, ValueError), match=rf"ring[._]{field}"):
                run()
        after = [t for t in (*call, *layer.ring) if isinstance(t, torch.Tensor)]
        assert all(bits_equal(a, b) for a, b in zip(after, before)), f"{field}: a refused call wrote"
    assert not kernel_path.calls


def test_the_cpu_path_checks_the_step_then_accepted_by_name():
    """On the CPU path (``mamba3_step_fn``'s replay mode and ``replay_step``) a bad step tensor is named
    before the accepted counts are read, and bad counts by their name: a nested x with counts given
    must not reach their shape check through x (torch's own error)."""
    layer = Layer(9, draft=2)
    call = layer.call(layer.lane(len(INDEX), 2), INDEX)
    accepted = torch.zeros(len(INDEX), dtype=torch.int32)
    nested = call._replace(x=torch.nested.nested_tensor([call.x[0].float(), call.x[1].float()]))
    entries = ((lambda c, a: replay_fn(c, layer.ring, K, num_accepted_tokens=a), "num_accepted_tokens"),
               (lambda c, a: replay.replay_step(c, layer.ring, K, num_accepted_tokens=a), "num_accepted_tokens"))
    for entry, name in entries:
        with pytest.raises(TypeError, match="^x: expected a strided"):
            entry(nested, accepted)
        with pytest.raises(TypeError, match=f"^{name}: expected dtype int32, got int64"):
            entry(call, accepted.long())
        with pytest.raises(ValueError, match=rf"^{name}: expected shape \(B\)"):
            entry(call, accepted[:2])


def test_a_ring_given_to_a_stepwise_plan_or_left_out_of_a_replay_plan_is_a_mismatch():
    """The replay mode is part of a plan's signature: a stepwise plan's run given a ring, and a replay
    plan's run without one, raise StepPlanMismatch naming replay_ring, and write nothing."""
    layer = Layer(10)
    call = layer.call(layer.lane(len(INDEX)), INDEX)
    stepwise = plan_step(**call._asdict(), update_kv_state=True)
    replaying = _plan(call, layer.ring)
    before = [t.clone() for t in (*call, *layer.ring) if isinstance(t, torch.Tensor)]
    with pytest.raises(StepPlanMismatch, match="replay_ring: planned None, got Ring"):
        _run(stepwise, call, layer.ring)
    with pytest.raises(StepPlanMismatch, match="replay_ring: planned a Ring, got None"):
        replaying.run(**call._asdict())
    after = [t for t in (*call, *layer.ring) if isinstance(t, torch.Tensor)]
    assert all(bits_equal(a, b) for a, b in zip(after, before))
