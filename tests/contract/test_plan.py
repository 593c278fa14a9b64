"""Plan once, run many: ``plan_step`` validates a call signature once; ``StepPlan.run``
checks only what can change between steps and then does exactly what ``mamba3_step_fn`` does.

* ``run`` equals ``mamba3_step_fn`` bit for bit on CPU tensors (every byte of every argument and
  the result) in dense mode, dense mode with ``state_out``, pool mode with every padding kind and
  a null slot, multi-token steps ((B, K) sources with accepted counts, (B, T) destinations, a
  one-token axis), with and without ``out`` and ``update_kv_state``, step after step;
* bad input gets ``mamba3_step_fn``'s exception (type and message) and changes nothing; a valid
  call of another signature raises ``StepPlanMismatch`` naming what changed, and changes nothing;
* ``run`` runs no full validation; on the kernel path (a stand-in kernel recording its
  arguments) it passes what ``launch_step`` passes and allocates nothing but ``out``.

Letters (docs/contract.md): B lanes, T tokens, K candidate source rows, P pool rows, H heads,
D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import pytest
import torch
from helpers import RecordingKernel, clone_inputs, count_calls, make_inputs, run_threads

import mamba3_step.plan as plan_module
from mamba3_step import StepPlan, StepPlanMismatch, api, compile_cache, launch, mamba3_step_fn, plan_step
from mamba3_step.build import KernelBuilder
from mamba3_step.contract import new_out
from mamba3_step.tensors import KERNEL_ARGUMENT_NAMES, StepTensors, kernel_arguments
from mamba3_step.testing import padded_indices, speculative_indices
from mamba3_step.validation import cache as validation_cache

H, DH, N, R = 2, 32, 32, 2
NULL = 5
OPTIONS = ("update_kv_state", "tile_D", "num_warps", "validate_indices")


def _lane_seed(kw: dict, seed: int) -> dict:
    """``kw`` with new per-step tensors (A, B, C, x, dt, trap, z: new values, new addresses)."""
    B = kw["x"].shape[0]
    T = kw["x"].shape[1] if kw["x"].dim() == 4 else None
    fresh = make_inputs(B, kw["state"].shape[0], H, DH, N, R, has_z=kw["z"] is not None, tokens=T, seed=seed)
    return dict(kw, **{k: fresh[k] for k in ("A", "B", "C", "x", "dt", "trap", "z")})


def case(name: str) -> dict:
    """A valid call of kind ``name`` (mamba3_step_fn's keyword arguments, options included)."""
    if name == "dense":
        return dict(make_inputs(3, None, H, DH, N, R, seed=1), update_kv_state=True)
    if name == "dense state_out, no z, no outproj":
        kw = make_inputs(3, None, H, DH, N, R, has_z=False, has_outproj=False, seed=2)
        return dict(kw, state_out=torch.zeros_like(kw["state"]))
    if name in ("pool padded", "pool padded, out given, validate_indices"):
        kw = make_inputs(8, 24, H, DH, N, R, seed=3)
        src, dst, _ = padded_indices(8, 24, null_slot_id=NULL, with_dst=True, seed=3)
        kw.update(state_batch_indices=src, dst_state_batch_indices=dst, null_slot_id=NULL, update_kv_state=True)
        if "out given" in name:  # validate_indices refuses indices >= P: that padding becomes -1
            src, dst = (torch.where((t >= 24) & (t != NULL), -1, t) for t in (src, dst))
            kw.update(state_batch_indices=src, dst_state_batch_indices=dst, validate_indices=True,
                      out=torch.zeros(8, H, DH, dtype=torch.bfloat16))
        return kw
    if name == "pool in place, no update_kv_state":
        kw = make_inputs(6, 10, H, DH, N, R, seed=4)
        src, _, _ = padded_indices(6, 10, null_slot_id=NULL, seed=4)
        return dict(kw, state_batch_indices=src, null_slot_id=NULL)
    if name == "speculative (B, K) + (B, T)":
        kw = make_inputs(4, 40, H, DH, N, R, tokens=3, seed=5)
        sbi, nat, dst, _ = speculative_indices(4, 40, 3, null_slot_id=NULL, seed=5)
        return dict(kw, state_batch_indices=sbi, num_accepted_tokens=nat, dst_state_batch_indices=dst,
                    null_slot_id=NULL, update_kv_state=True)
    if name == "tokens, final destination":
        kw = make_inputs(5, 16, H, DH, N, R, tokens=2, seed=6)
        src, dst, _ = padded_indices(5, 16, null_slot_id=NULL, with_dst=True, seed=6)
        return dict(kw, state_batch_indices=src, dst_state_batch_indices=dst, null_slot_id=NULL,
                    update_kv_state=True)
    if name == "one-token axis":
        kw = make_inputs(4, 12, H, DH, N, R, tokens=1, seed=7)
        src, dst, _ = padded_indices(4, 12, null_slot_id=NULL, with_dst=True, seed=7)
        return dict(kw, state_batch_indices=src, dst_state_batch_indices=dst[:, None], null_slot_id=NULL,
                    out=torch.zeros(4, 1, H, DH, dtype=torch.bfloat16), update_kv_state=True)
    raise AssertionError(name)


CASES = ["dense", "dense state_out, no z, no outproj", "pool padded", "pool padded, out given, validate_indices",
         "pool in place, no update_kv_state", "speculative (B, K) + (B, T)", "tokens, final destination",
         "one-token axis"]


def split(kw: dict) -> tuple[dict, dict]:
    return {k: v for k, v in kw.items() if k not in OPTIONS}, {k: v for k, v in kw.items() if k in OPTIONS}


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def snapshot(kw: dict) -> dict:
    return {k: raw(v) for k, v in kw.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}


def assert_same_bytes(a: dict, b: dict, what: str) -> None:
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(raw(v), raw(b[k])), f"{what}: {k} differs"


@pytest.fixture
def counted_full_validations(monkeypatch) -> list:
    """Records every full validation a plan runs (one entry per call of check_step_inputs)."""
    return count_calls(monkeypatch, plan_module, "check_step_inputs")


# --------------------------------------------------------------------------- bit for bit
@pytest.mark.parametrize("name", CASES)
def test_run_equals_mamba3_step_fn_bit_for_bit_step_after_step(name, counted_full_validations):
    kw = case(name)
    tensors, options = split(kw)
    plan = plan_step(**tensors, **options)
    assert len(counted_full_validations) == 1
    planned, eager = clone_inputs(kw), clone_inputs(kw)
    for step in range(3):
        if step:  # the next step: new per-lane tensors; the pool and weights carry over
            new = _lane_seed(kw, seed=100 + step)
            for k in ("A", "B", "C", "x", "dt", "trap", "z"):
                planned[k] = None if new[k] is None else new[k].clone()
                eager[k] = None if new[k] is None else new[k].clone()
        got = plan.run(**split(planned)[0])
        want = mamba3_step_fn(**eager)
        assert got.shape == want.shape and torch.equal(raw(got), raw(want)), f"{name}: out differs at step {step}"
        assert_same_bytes(planned, eager, f"{name}, step {step}")
        if kw.get("out") is not None:
            assert got is planned["out"]
    assert len(counted_full_validations) == 1, "run validated in full"


def test_a_plan_is_one_signature_for_every_layer(counted_full_validations):
    """Two layers (their own pools and weights) of one model share a signature, hence a plan."""
    layers = [case("pool padded") for _ in range(2)]
    for i, layer in enumerate(layers):
        layer.update({k: v.clone() for k, v in make_inputs(8, 24, H, DH, N, R, seed=40 + i).items()
                      if k in ("state", "Bstate", "Xstate", "D", "xproj", "zproj", "outproj")})
    tensors, options = split(layers[0])
    plan = plan_step(**tensors, **options)
    for layer in layers:
        eager = clone_inputs(layer)
        assert torch.equal(raw(plan(**split(layer)[0])), raw(mamba3_step_fn(**eager)))
        assert_same_bytes(layer, eager, "layer")
    assert len(counted_full_validations) == 1


# --------------------------------------------------------------------------- refusals
def _misaligned_state(kw):
    s = kw["state"]
    kw["state"] = torch.zeros(s.numel() + 1)[1:].view(s.shape).copy_(s)


def _out_over_z(kw):
    z, out = kw["z"], kw["out"]
    buf = torch.zeros(z.numel() + out.numel() + 8, dtype=z.dtype)
    kw["z"] = buf[: z.numel()].view(z.shape).copy_(z)
    kw["out"] = buf[8: 8 + out.numel()].view(out.shape)


def _inference_out(kw):
    with torch.inference_mode():
        kw["out"] = kw["out"].clone()


BAD = {
    "misaligned state": _misaligned_state,
    "out overlapping z": _out_over_z,
    "inference out": _inference_out,
    "out requires grad": lambda kw: kw.update(out=kw["out"].clone().requires_grad_(True)),
    "x in float32": lambda kw: kw.update(x=kw["x"].float()),
    "B narrower": lambda kw: kw.update(B=kw["B"][..., :16]),
    "trap not a tensor": lambda kw: kw.update(trap=0.5),
    "z without zproj": lambda kw: kw.update(zproj=None),
    "indices in int64": lambda kw: kw.update(state_batch_indices=kw["state_batch_indices"].long()),
    "dst without src": lambda kw: kw.update(state_batch_indices=None),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_input_gets_mamba3_step_fns_error_and_changes_nothing(bad):
    kw = case("pool padded, out given, validate_indices")
    tensors, options = split(kw)
    plan = plan_step(**tensors, **options)
    broken = clone_inputs(kw)
    BAD[bad](broken)
    before = snapshot(broken)
    with pytest.raises((TypeError, ValueError)) as want:
        mamba3_step_fn(**broken)  # refused: changes nothing either
    with pytest.raises((TypeError, ValueError)) as got:
        plan.run(**split(broken)[0])
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    assert not isinstance(got.value, StepPlanMismatch)
    after = snapshot(broken)
    assert all(torch.equal(before[k], after[k]) for k in before), f"{bad}: a refused run changed an input"


def _other_strides(kw):  # a valid pool with 16-byte padded rows: other strides, same shape
    s = kw["state"]
    kw["state"] = torch.zeros(s.shape[:-1] + (N + 4,))[..., :N].copy_(s)


MISMATCHES = {
    "another batch size": (lambda kw: kw.update(**{k: kw[k][:-1] for k in ("A", "B", "C", "x", "dt", "trap", "z",
                                                                          "out", "state_batch_indices",
                                                                          "dst_state_batch_indices")}),
                           ["x: planned shape (8, 2, 32), got (7, 2, 32)", "out: planned shape"]),
    "state with padded rows": (_other_strides, ["state: planned strides (2048, 1024, 32, 1), got (2304, 1152, 36, 1)"]),
    "a weight requiring grad": (lambda kw: kw.update(xproj=kw["xproj"].clone().requires_grad_(True)),
                                ["xproj: planned requires_grad False, got True"]),
    "another null slot": (lambda kw: kw.update(null_slot_id=24), ["null_slot_id: planned 5, got 24"]),
    "out left to the step": (lambda kw: kw.update(out=None), ["out: planned a tensor, got None"]),
    "a parameter for a tensor": (lambda kw: kw.update(D=torch.nn.Parameter(kw["D"], requires_grad=False)),
                                 ["D: planned type Tensor, got Parameter"]),
}


@pytest.mark.parametrize("change", list(MISMATCHES))
def test_a_valid_call_of_another_signature_is_refused_naming_what_changed(change):
    kw = dict(case("pool padded, out given, validate_indices"), validate_indices=False)
    tensors, options = split(kw)
    plan = plan_step(**tensors, **options)
    other = clone_inputs(kw)
    mutate, phrases = MISMATCHES[change]
    mutate(other)
    mamba3_step_fn(**clone_inputs(other))  # valid
    before = snapshot(other)
    with pytest.raises(StepPlanMismatch) as info:
        plan.run(**split(other)[0])
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and msg.startswith("plan: this call is valid but is not the planned")
    for phrase in phrases:
        assert phrase in msg, f"{phrase!r} not in {msg}"
    after = snapshot(other)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_inference_mode_is_part_of_the_plan():
    kw = case("pool padded")
    tensors, options = split(kw)
    plan = plan_step(**tensors, **options)
    with torch.inference_mode(), pytest.raises(StepPlanMismatch, match="torch.inference_mode: planned off, got on"):
        plan.run(**split(clone_inputs(kw))[0])
    with torch.inference_mode():
        inside = plan_step(**split(clone_inputs(kw))[0], **options)
        a, b = clone_inputs(kw), clone_inputs(kw)
        assert torch.equal(raw(inside.run(**split(a)[0])), raw(mamba3_step_fn(**b)))
        assert_same_bytes(a, b, "inside inference mode")


@pytest.mark.parametrize("guard", ["cpp", "python"])
def test_inference_tensors_planned_inside_inference_mode_are_refused_outside_it(guard, monkeypatch):
    """Inside inference mode written inference tensors are fine; outside they are not, although
    neither these tensors' signature nor (with the plain-Python guard) anything else about them
    changes: the plan compares the mode itself."""
    if guard == "python":
        monkeypatch.setattr(validation_cache, "_TensorGuards", None)
    with torch.inference_mode():
        kw = case("pool padded")
        tensors, options = split(kw)
        plan = plan_step(**tensors, **options)
        plan.run(**tensors)
    with pytest.raises(ValueError) as want:
        mamba3_step_fn(**kw)
    with pytest.raises(ValueError) as got:
        plan.run(**tensors)
    assert str(got.value) == str(want.value) and "can be written here" in str(got.value)


def test_plan_step_refuses_what_mamba3_step_fn_refuses():
    kw = case("pool padded")
    kw["dt"] = kw["dt"].half()
    with pytest.raises(TypeError) as want:
        mamba3_step_fn(**clone_inputs(kw))
    with pytest.raises(TypeError) as got:
        plan_step(**kw)
    assert str(got.value) == str(want.value)
    with pytest.raises(TypeError, match="validate_indices: expected a bool"):
        plan_step(**dict(case("pool padded"), validate_indices="yes"))
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in case("pool padded").items()}
    with pytest.raises(ValueError, match="validate_indices: expected index tensors holding values"):
        plan_step(**meta, validate_indices=True)
    meta_plan = plan_step(**meta)  # meta tensors: validated, shapes only
    out = meta_plan.run(**split(meta)[0])
    assert out.device.type == "meta" and tuple(out.shape) == (8, H, DH)


# --------------------------------------------------------------------------- the kernel path
@pytest.fixture
def kernel_path(monkeypatch) -> RecordingKernel:
    """CPU tensors take the CUDA path with a stand-in kernel (as bench/bench_host.py does)."""
    kernel = RecordingKernel()
    monkeypatch.setattr(api, "runs_kernel", lambda x: x.is_cpu)
    monkeypatch.setattr(plan_module, "runs_kernel", lambda x: x.is_cpu)
    monkeypatch.setattr(launch, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(launch, "_ARCH_BY_INDEX", {})
    compile_cache.set_builder(KernelBuilder(name="recording", compile=lambda spec, arch: kernel, sources=(),
                                            exportable=False))
    yield kernel
    compile_cache.set_builder(None)


@pytest.mark.parametrize("name", CASES)
def test_run_launches_what_mamba3_step_fn_launches(name, kernel_path, monkeypatch):
    kw = case(name)
    tensors, options = split(kw)
    plan = plan_step(**tensors, **options)
    call = clone_inputs(kw)
    out = plan.run(**split(call)[0])
    mamba3_step_fn(**call)
    assert len(kernel_path.calls) == 2
    planned, eager = kernel_path.calls
    assert len(planned) == len(eager) == len(KERNEL_ARGUMENT_NAMES)
    for i, (a, b) in enumerate(zip(planned, eager)):
        if i == KERNEL_ARGUMENT_NAMES.index("out") and kw.get("out") is None:  # each call allocated its own out
            assert a.shape == b.shape and a.dtype == b.dtype
        elif isinstance(a, torch.Tensor):
            assert a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride(), i
        else:
            assert a == b, i
    if kw.get("out") is not None:
        assert out is call["out"]
    spec, prepared, _ = api.prepare_step(StepTensors(**split(call)[0]), **options)
    assert planned[-1] == kernel_arguments(prepared)[-1] == (NULL if "null_slot_id" in kw else -1)


def test_run_with_out_allocates_nothing_and_without_out_only_out(kernel_path, monkeypatch):
    kw = case("pool padded, out given, validate_indices")
    kw["validate_indices"] = False
    tensors, options = split(kw)
    plan = plan_step(**tensors, **options)
    no_out = plan_step(**dict(tensors, out=None), **options)
    allocations = []

    def counting(name):
        real = getattr(torch, name)

        def allocate(*args, **kwargs):
            allocations.append(name)
            return real(*args, **kwargs)

        return allocate

    for name in ("empty", "empty_like", "empty_strided", "zeros", "zeros_like"):
        monkeypatch.setattr(torch, name, counting(name))
    for _ in range(3):
        plan.run(**tensors)
    assert allocations == []
    out = no_out.run(**dict(tensors, out=None))
    assert len(allocations) == 1 and tuple(out.shape) == (8, H, DH) and out.dtype == torch.bfloat16
    assert out.is_contiguous() and out.device == tensors["x"].device and not out.requires_grad
    assert len(kernel_path.calls) == 4


class _Tagged(torch.Tensor):
    pass


@pytest.mark.parametrize("layout", ["contiguous", "permuted", "row-padded", "subclass", "other shape"])
def test_a_new_out_is_a_plain_contiguous_tensor_of_the_asked_shape(layout):
    """The allocation of run(out=None) and mamba3_step_fn(out=None): empty_like(x) where it can,
    torch.empty elsewhere, the same kind of tensor either way."""
    x = torch.randn(3, 2, 8).to(torch.bfloat16)
    shape = x.shape
    if layout == "permuted":
        x = torch.randn(2, 3, 8).to(torch.bfloat16).transpose(0, 1)
    elif layout == "row-padded":
        x = torch.randn(3, 2, 16).to(torch.bfloat16)[..., :8]
    elif layout == "subclass":
        x = x.as_subclass(_Tagged)
    elif layout == "other shape":
        shape = torch.Size((3, 4, 2, 8))
    x.requires_grad_(False)
    out = new_out(x, shape)
    assert type(out) is torch.Tensor and out.shape == shape and out.is_contiguous()
    assert out.dtype == x.dtype and out.device == x.device and not out.requires_grad
    assert out.data_ptr() != x.data_ptr()


def test_threads_share_a_plan(kernel_path):
    kw = case("pool padded")
    tensors, options = split(kw)
    plan = plan_step(**tensors, **options)
    bad = clone_inputs(kw)
    _misaligned_state(bad)
    errors = []

    def work():
        try:
            for i in range(200):
                if i % 10 == 3:
                    try:
                        plan.run(**split(bad)[0])
                        errors.append("a misaligned state was accepted")
                    except ValueError as e:
                        if not str(e).startswith("state: expected a data pointer aligned"):
                            errors.append(str(e))
                else:
                    plan.run(**tensors)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    run_threads([work] * 4)
    assert not errors, errors[:3]
    assert len(kernel_path.calls) == 4 * 180


def test_a_plan_says_what_it_is():
    kw = case("dense")
    plan = plan_step(**split(kw)[0], **split(kw)[1])
    assert isinstance(plan, StepPlan) and plan.spec.update_kv_state and not plan.spec.pool
    assert plan.options == dict(update_kv_state=True, tile_D=None, num_warps=None, rotate_pairwise=False,
                                stochastic_rounding=False, replay_flush_length=None, replay_from_checkpoint=False,
                                validate_indices=False)
    assert "out (3, 2, 32)" in repr(plan)
