"""The validation cache (host overhead): a repeated call signature is validated once, and
afterwards only its addresses are checked; nothing the full validation refuses is ever admitted,
and every refusal is the full validation's own named error.

* hit/miss: the second call of a signature runs no full validation (counted), a new signature does;
* every property validation reads, changed between two calls (shape, strides, dtype, device,
  requires_grad, inference tensors, options, and, with an identical signature, aliasing and
  misalignment), is refused with exactly the full validation's exception, and the refused
  ``mamba3_step_fn`` call changes no byte of any input;
* a fuzz (hypothesis): random calls and random changes give the same StepSpec or the same
  exception type and message through the cache as through ``check_step_inputs``, with torch's C++
  guard and with the plain-Python guard;
* the cache is bounded, and threads sharing it get the full validation's answers.

Letters (docs/contract.md): B lanes, T tokens, P pool rows, H heads, D head dim, N state size,
R MIMO rank, K candidate source rows.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import clone_inputs, count_calls, make_inputs, run_threads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mamba3_step.signature import VALIDATED_OPTIONS, StepOptions
from mamba3_step import mamba3_step_fn
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import speculative_indices
from mamba3_step.validation import ValidationCache, cache, check_step_inputs

NB, P, H, DH, N, R = 3, 6, 2, 32, 32, 2
OPTION_NAMES = ("update_kv_state", "tile_D", "num_warps", "validate_indices")


@pytest.fixture
def fresh_cache(monkeypatch) -> ValidationCache:
    """A new process-wide cache for this test (mamba3_step_fn goes through it)."""
    c = ValidationCache()
    monkeypatch.setattr(cache, "VALIDATION_CACHE", c)
    return c


@pytest.fixture
def full_calls(monkeypatch) -> list:
    """Records every full validation the cache runs (one entry per call of check_step_inputs)."""
    return count_calls(monkeypatch, cache, "check_step_inputs")


def pool_call(seed=0, **overrides) -> dict:
    kw = make_inputs(NB, P, H, DH, N, R, seed=seed)
    kw["out"] = torch.zeros(NB, H, DH, dtype=torch.bfloat16)
    kw["state_batch_indices"] = torch.tensor([0, 4, -1], dtype=torch.int32)
    kw["dst_state_batch_indices"] = torch.tensor([1, 5, -1], dtype=torch.int32)
    kw["null_slot_id"] = 3
    kw["update_kv_state"] = True
    kw.update(overrides)
    return kw


def tensors_and_options(kw: dict) -> tuple[StepTensors, dict]:
    opts = {k: kw[k] for k in ("update_kv_state", "tile_D", "num_warps") if k in kw}
    return StepTensors(**{k: v for k, v in kw.items() if k not in OPTION_NAMES}), opts


def outcome(fn, kw: dict):
    """``("ok", spec)`` or ``(exception type, message)`` of ``fn(tensors, **options)``."""
    t, opts = tensors_and_options(kw)
    try:
        return "ok", fn(t, **opts)
    except (TypeError, ValueError) as e:
        return type(e), str(e)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def carve(buf: torch.Tensor, byte_offset: int, like: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``like`` living in ``buf`` from ``byte_offset`` on (same shape, strides, dtype)."""
    nbytes = like.numel() * like.element_size()
    t = buf[byte_offset:byte_offset + nbytes].view(like.dtype).view(like.shape)
    return t.copy_(like)


# --------------------------------------------------------------------------- hits and misses
def test_a_repeated_signature_is_validated_once(fresh_cache, full_calls):
    first = pool_call(seed=1)
    out1 = mamba3_step_fn(**first)
    assert len(full_calls) == 1 and len(fresh_cache) == 1
    for seed in (2, 3, 4):  # new tensors, new data, new addresses: the same signature
        mamba3_step_fn(**pool_call(seed=seed))
    assert len(full_calls) == 1, "a repeated signature ran the full validation again"
    again = pool_call(seed=1)
    assert torch.equal(raw(mamba3_step_fn(**again)), raw(out1)), "a cached call computed something else"
    mamba3_step_fn(**pool_call(seed=5, update_kv_state=False))  # another option: another signature
    assert len(full_calls) == 2 and len(fresh_cache) == 2
    kw = pool_call(seed=6)
    kw["xproj"] = kw["xproj"].clone().requires_grad_(True)  # read-only: valid, but another signature
    mamba3_step_fn(**kw)
    assert len(full_calls) == 3 and len(fresh_cache) == 3


def test_the_cached_answer_is_the_full_validations_spec(fresh_cache):
    t, opts = tensors_and_options(pool_call())
    expected = check_step_inputs(t, **opts)
    assert fresh_cache.check(t, **opts) == expected
    t2, _ = tensors_and_options(pool_call(seed=9))
    assert fresh_cache.check(t2, **opts) is fresh_cache.check(t, **opts)  # one object per spec
    assert fresh_cache.full_validations == 1


def test_calls_with_unusual_option_types_are_validated_every_time(fresh_cache, full_calls):
    np = pytest.importorskip("numpy")
    for _ in range(3):
        mamba3_step_fn(**pool_call(null_slot_id=np.int64(3)))
    assert len(full_calls) == 3 and len(fresh_cache) == 0


def test_failures_are_not_cached(fresh_cache, full_calls):
    kw = pool_call()
    kw["A"] = kw["A"].double()
    for _ in range(2):
        with pytest.raises(TypeError, match="^A: expected dtype float32"):
            mamba3_step_fn(**kw)
    assert len(full_calls) == 2 and len(fresh_cache) == 0


# --------------------------------------------------------------------------- changed properties
def _misaligned_state(kw):
    s = kw["state"]
    buf = torch.empty(s.numel() + 1)
    kw["state"] = buf[1:].view(s.shape).copy_(s)  # the same shape, strides and dtype; 4 bytes off


def _out_inside_x(kw):
    buf = torch.zeros(4096, dtype=torch.uint8)
    kw["x"] = carve(buf, 0, kw["x"])
    kw["out"] = carve(buf, 64, kw["out"])  # the same signature; out overlaps x by all but 64 bytes


def _xstate_inside_bstate(kw):
    buf = torch.zeros(kw["Bstate"].numel() * 2 + 4096, dtype=torch.uint8)
    kw["Bstate"] = carve(buf, 0, kw["Bstate"])
    kw["Xstate"] = carve(buf, 16, kw["Xstate"])


def _pool_over_indices(kw):
    s, idx = kw["state"], kw["state_batch_indices"]
    buf = torch.zeros(s.numel() * 4 + 64, dtype=torch.uint8)
    kw["state"] = carve(buf, 0, s)
    kw["state_batch_indices"] = carve(buf, s.numel() * 4 - 16, idx)  # shares the pool's last 16 bytes


def _out_requires_grad(kw):
    kw["out"] = kw["out"].clone().requires_grad_(True)


def _inference_state(kw):
    with torch.inference_mode():
        kw["state"] = kw["state"].clone()


def _x_strided(kw):
    wide = torch.zeros(kw["x"].shape[:-1] + (2 * DH,), dtype=kw["x"].dtype)
    kw["x"] = wide[..., ::2].copy_(kw["x"])


def _state_row_padding(kw):
    s = kw["state"]
    kw["state"] = torch.zeros(s.shape[:-1] + (N + 1,))[..., :N].copy_(s)


def _z_on_meta(kw):
    kw["z"] = kw["z"].to("meta")


CHANGES = {
    # the same signature, new addresses that break a rule: the guard admits, the address check refuses
    "misaligned state": (_misaligned_state, ValueError, "state: expected a data pointer aligned to 16 bytes", True),
    "out overlapping x": (_out_inside_x, ValueError, "out: expected memory disjoint from x", True),
    "Xstate inside Bstate": (_xstate_inside_bstate, ValueError, "Bstate: expected memory disjoint from Xstate",
                             True),
    "pool over the indices": (_pool_over_indices, ValueError, "state: expected memory disjoint from "
                              "state_batch_indices", True),
    # another signature: the guard refuses, the full validation names the problem
    "out requires grad": (_out_requires_grad, ValueError, "out: expected a tensor that does not require grad", False),
    "inference state": (_inference_state, ValueError, "state: expected a tensor that can be written here", False),
    "x strided": (_x_strided, ValueError, "x: expected innermost stride 1", False),
    "state rows not 16-byte multiples": (_state_row_padding, ValueError, "state: expected every stride except", False),
    "A in float64": (lambda kw: kw.update(A=kw["A"].double()), TypeError, "A: expected dtype float32", False),
    "C shorter": (lambda kw: kw.update(C=kw["C"][:2]), ValueError, "C: expected shape", False),
    "z on another device": (_z_on_meta, ValueError, "z: expected a tensor on cpu", False),
    "zproj missing": (lambda kw: kw.update(zproj=None), ValueError, "zproj: expected a tensor because z is given",
                      False),
    "D not a tensor": (lambda kw: kw.update(D=[1.0, 2.0]), TypeError, "D: expected a torch.Tensor", False),
    "tile_D too small for update_kv_state": (lambda kw: kw.update(tile_D=2), ValueError,
                                             "tile_D: update_kv_state=True with tile_D < headdim", False),
    "update_kv_state not a bool": (lambda kw: kw.update(update_kv_state=1), TypeError,
                                   "update_kv_state: expected a bool", False),
    "null_slot_id beyond int32": (lambda kw: kw.update(null_slot_id=2**31), ValueError,
                                  "null_slot_id: expected an int32 value", False),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_between_two_calls_is_refused_with_the_full_validations_error(change, fresh_cache):
    mutate, exc, start, same_signature = CHANGES[change]
    mamba3_step_fn(**pool_call(seed=1))  # the signature is cached now
    kw = pool_call(seed=2)
    mutate(kw)
    expected = outcome(check_step_inputs, kw)
    assert expected[0] is exc and expected[1].startswith(start), expected
    before_entries, before_full = len(fresh_cache), fresh_cache.full_validations
    t, opts = tensors_and_options(kw)
    key = cache.call_key(t, *[opts.get(k, StepOptions._field_defaults[k]) for k in VALIDATED_OPTIONS])
    sigs = fresh_cache._entries.get(key, ())
    verdicts = [s.admits(t) for s in sigs]
    if same_signature:  # the guard matched: only the address or mode check tells
        assert verdicts == [cache.RECHECK], verdicts
    else:
        assert cache.RECHECK not in verdicts and cache.ADMIT not in verdicts, verdicts
    snapshot = [raw(v) for v in kw.values() if isinstance(v, torch.Tensor) and v.device.type != "meta"]
    with pytest.raises(exc) as info:
        mamba3_step_fn(**kw)
    assert (type(info.value), str(info.value)) == expected
    after = [raw(v) for v in kw.values() if isinstance(v, torch.Tensor) and v.device.type != "meta"]
    assert all(torch.equal(a, b) for a, b in zip(snapshot, after)), "a refused call changed an input"
    assert len(fresh_cache) == before_entries, "a refused call was cached"
    assert fresh_cache.full_validations == before_full + 1


def test_aliasing_without_a_shared_byte_is_admitted_from_the_cache(fresh_cache, full_calls):
    """Both tensors carved out of one buffer, touching but disjoint: valid, and the same signature."""
    mamba3_step_fn(**pool_call(seed=1))
    kw = pool_call(seed=2)
    nbytes = kw["x"].numel() * kw["x"].element_size()
    buf = torch.zeros(nbytes + kw["out"].numel() * 2, dtype=torch.uint8)
    kw["x"] = carve(buf, 0, kw["x"])
    kw["out"] = carve(buf, nbytes, kw["out"])  # starts where x ends
    mamba3_step_fn(**kw)
    assert len(full_calls) == 1


def test_an_inference_tensor_is_refused_even_where_dispatch_keys_cannot_tell(fresh_cache):
    """Below autograd (as inside the custom op's implementation) an inference tensor's dispatch keys
    look like a normal tensor's to torch's guard; the cache checks written tensors itself."""
    with torch._C._AutoDispatchBelowAutograd():
        mamba3_step_fn(**pool_call(seed=1))
        kw = pool_call(seed=2)
        with torch.inference_mode():
            kw["out"] = kw["out"].clone()
        expected = outcome(check_step_inputs, kw)
        assert expected[0] is ValueError and expected[1].startswith("out: expected a tensor that can be written")
        with pytest.raises(ValueError) as info:
            mamba3_step_fn(**kw)
        assert str(info.value) == expected[1]


def test_inference_mode_is_part_of_the_signature(fresh_cache, full_calls):
    mamba3_step_fn(**pool_call(seed=1))
    with torch.inference_mode():
        kw = pool_call(seed=2)  # inference tensors, written inside inference mode: valid
        mamba3_step_fn(**kw)
        mamba3_step_fn(**pool_call(seed=3))
    assert len(full_calls) == 2
    with pytest.raises(ValueError, match="can be written here"):
        mamba3_step_fn(**kw)  # the same inference tensors outside inference mode


# --------------------------------------------------------------------------- fuzz: cache == full validation
def _base(draw) -> dict:
    mode = draw(st.sampled_from(["pool", "dense", "dense_so", "tokens", "speculative"]))
    B, Hh, Rr = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    T = draw(st.integers(1, 3)) if mode in ("tokens", "speculative") else None
    Pp = 12 if mode in ("pool", "tokens", "speculative") else None
    kw = make_inputs(B, Pp, Hh, DH, N, Rr, has_z=draw(st.booleans()), has_outproj=draw(st.booleans()), tokens=T,
                     seed=draw(st.integers(0, 99)))
    if draw(st.booleans()):
        lead = (B,) if T is None else (B, T)
        kw["out"] = torch.zeros(lead + ((Hh, DH) if kw["outproj"] is not None else (Rr, Hh, DH)),
                                dtype=kw["x"].dtype)
    if mode == "pool" or mode == "tokens":
        kw["state_batch_indices"] = torch.tensor([b if b % 2 == 0 else -1 for b in range(B)], dtype=torch.int32)
        kw["null_slot_id"] = draw(st.sampled_from([None, 11]))
    if mode == "speculative":
        sbi, nat, dst, _ = speculative_indices(B, Pp, T, null_slot_id=11, seed=1)
        kw.update(state_batch_indices=sbi, num_accepted_tokens=nat, dst_state_batch_indices=dst, null_slot_id=11)
    if mode == "dense_so":
        kw["state_out"] = torch.zeros_like(kw["state"])
    kw["update_kv_state"] = draw(st.booleans())
    return kw


def _fresh_copy(kw: dict) -> dict:
    """The same call with new tensors (new addresses): the same signature."""
    return {k: (v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v)
            for k, v in kw.items()}


def _mutate(draw, kw: dict) -> None:
    names = [k for k, v in kw.items() if isinstance(v, torch.Tensor) and not v.is_meta]  # tensors holding data
    if len(names) < 2:
        return
    kind = draw(st.sampled_from(["none", "requires_grad", "inference", "dtype", "narrow", "stride", "drop", "option",
                                 "meta", "not_a_tensor"] + ["alias", "misalign"] * 4))  # the address checks: often
    name = draw(st.sampled_from(names))
    t = kw[name]
    if kind == "alias":
        other = draw(st.sampled_from([n for n in names if n != name]))
        o, nb = kw[other], t.numel() * t.element_size()
        ob = o.numel() * o.element_size()
        start = draw(st.integers(0, ob // 16 if draw(st.booleans()) else (ob + nb) // 16 + 1)) * 16  # mostly inside
        buf = torch.zeros(start + ob + nb + 16, dtype=torch.uint8)
        kw[other] = carve(buf, 0, o.detach())
        kw[name] = carve(buf, start, t.detach())
    elif kind == "misalign":  # a base 1..7 elements past a 16-byte boundary (the same strides)
        aligned = [n for n in ("state", "state_out") if n in names]
        if aligned and draw(st.booleans()):  # mostly the tensors that must be aligned
            name = aligned[-1]
            t = kw[name]
        shift = draw(st.integers(1, 7))
        buf = torch.zeros(t.numel() + 8, dtype=t.dtype)
        kw[name] = buf[shift:shift + t.numel()].view(t.shape).copy_(t.detach())
    elif kind == "requires_grad" and t.is_floating_point():
        kw[name] = t.detach().clone().requires_grad_(True)
    elif kind == "inference":
        with torch.inference_mode():
            kw[name] = t.detach().clone()
    elif kind == "dtype":
        kw[name] = t.detach().to(draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32])))
    elif kind == "narrow" and t.dim() and t.shape[0] > 1:
        kw[name] = t.detach()[:-1]
    elif kind == "stride" and t.dim():
        pad = draw(st.integers(1, 8))
        wide = torch.zeros(t.shape[:-1] + (t.shape[-1] + pad,), dtype=t.dtype)
        kw[name] = wide[..., :t.shape[-1]].copy_(t.detach()) if draw(st.booleans()) else \
            torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)[..., ::2].copy_(t.detach())
    elif kind == "drop":
        kw[name] = None
    elif kind == "option":
        opt = draw(st.sampled_from(["update_kv_state", "tile_D", "num_warps", "null_slot_id"]))
        kw[opt] = draw({"update_kv_state": st.sampled_from([True, False, 1]),
                        "tile_D": st.sampled_from([None, 8, 16, 32, 0]),
                        "num_warps": st.sampled_from([None, 1, 4, 3]),
                        "null_slot_id": st.sampled_from([None, 0, 11, -5, 2**31, True, np.int64(11)])}[opt])
    elif kind == "meta":
        kw[name] = t.detach().to("meta")
    elif kind == "not_a_tensor":
        kw[name] = 1.5


@st.composite
def call_pairs(draw):
    base = _base(draw)
    later = _fresh_copy(base)
    for _ in range(draw(st.integers(0, 2))):
        _mutate(draw, later)
    return base, later


#: the ways a signature can check a call: (C check or Python, torch's C++ guard or the Python
#: guard, torch's C data-pointer function or data_ptr() calls); every one must answer alike
BACKENDS = {
    "c+torch-data-ptr-fn": (True, True, True),
    "c+data_ptr-calls": (True, True, False),
    "c+python-guard": (True, False, True),
    "python": (False, True, False),
    "python+python-guard": (False, False, False),
}


@pytest.fixture(params=list(BACKENDS))
def backend_cache(request, monkeypatch) -> ValidationCache:
    native, prefer_cpp, data_ptr_fn = BACKENDS[request.param]
    if native and cache._Admitter is None:
        require_native()
        pytest.skip("the C admission check is not built here (no C compiler or Python headers at install)")
    if native and data_ptr_fn and not cache._DATA_PTR_FN:
        pytest.skip("this torch has no C data-pointer function that passes the probe")
    if not data_ptr_fn:
        monkeypatch.setattr(cache, "_DATA_PTR_FN", 0)
    return ValidationCache(prefer_cpp=prefer_cpp, prefer_native=native)


def require_native() -> None:
    """CI sets MAMBA3_STEP_REQUIRE_NATIVE=1: there, a missing C module fails instead of skipping."""
    if os.environ.get("MAMBA3_STEP_REQUIRE_NATIVE") == "1":
        pytest.fail("MAMBA3_STEP_REQUIRE_NATIVE=1 but mamba3_step.validation._admit is not built "
                    "(pip install -e . with a C compiler and Python's headers builds it)")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(pair=call_pairs())
def test_the_cache_answers_what_the_full_validation_answers(backend_cache, pair):
    base, later = pair
    c = backend_cache
    c.clear()
    assert outcome(c.check, base) == outcome(check_step_inputs, base) and outcome(c.check, base)[0] == "ok"
    for _ in range(2):  # the second time, the later call may be cached too
        assert outcome(c.check, later) == outcome(check_step_inputs, later)
    assert outcome(c.check, _fresh_copy(base)) == outcome(check_step_inputs, base)
    # verdict by verdict, the signature's check (C or Python) is the Python definition
    for sigs in c._entries.values():
        for s in sigs:
            assert s.native == (c.prefer_native and cache._Admitter is not None)
            for kw in (base, later):
                t = tensors_and_options(kw)[0]
                assert s.admits(t) == s.admits_python(t) == s.admits_python(tuple(t))


def test_null_slot_id_must_be_the_planned_value_of_the_planned_type(backend_cache):
    """3, np.int64(3) and True compare equal to 3 or 1 but are other signatures (the kernel's
    scalar is built from the planned value)."""
    kw = pool_call(seed=1)
    t = tensors_and_options(kw)[0]
    backend_cache.check(t, update_kv_state=True)
    (sig,) = [s for sigs in backend_cache._entries.values() for s in sigs]
    verdicts = {repr(v): sig.admits(t._replace(null_slot_id=v)) for v in (3, np.int64(3), 3.0, 4, None, True)}
    assert verdicts == {"3": cache.ADMIT, "np.int64(3)": cache.MISS, "3.0": cache.MISS, "4": cache.MISS,
                        "None": cache.MISS, "True": cache.MISS}
    assert {repr(v): sig.admits_python(t._replace(null_slot_id=v)) for v in (3, np.int64(3), 3.0, 4, None, True)} \
        == verdicts


def test_tensor_subclasses_and_parameters_are_checked_alike(backend_cache):
    """nn.Parameter weights (the C check reads their pointers with torch's C function) and a
    Python tensor subclass (it calls data_ptr() on signatures holding one): the same verdicts."""

    class Tagged(torch.Tensor):
        pass

    kw = pool_call(seed=1)
    kw["xproj"] = torch.nn.Parameter(kw["xproj"], requires_grad=False)
    kw["z"] = kw["z"].as_subclass(Tagged)
    t = tensors_and_options(kw)[0]
    backend_cache.check(t, update_kv_state=True)
    (sig,) = [s for sigs in backend_cache._entries.values() for s in sigs]
    later = pool_call(seed=2)
    later["xproj"] = torch.nn.Parameter(later["xproj"], requires_grad=False)
    later["z"] = later["z"].as_subclass(Tagged)
    _out_inside_x(bad := dict(later))
    for call, want in ((later, cache.ADMIT), (bad, cache.RECHECK), (pool_call(seed=3), cache.MISS)):
        tt = tensors_and_options(call)[0]
        assert sig.admits(tt) == sig.admits_python(tt) == want


def test_the_c_check_is_what_new_signatures_use_where_it_is_built():
    if cache._Admitter is None:
        require_native()
        pytest.skip("the C admission check is not built here")
    kw = pool_call(seed=1)
    t = tensors_and_options(kw)[0]
    spec = check_step_inputs(t, update_kv_state=True)
    assert cache.CheckedSignature.from_call(spec, t).native is cache.NATIVE
    assert cache.CheckedSignature.from_call(spec, t, prefer_native=False).native is False
    assert cache.CheckedSignature.from_call(spec, t, prefer_native=True).native is True


def test_the_c_check_refuses_misuse_of_its_type():
    if cache._Admitter is None:
        require_native()
        pytest.skip("the C admission check is not built here")
    blank = cache._Admitter.__new__(cache._Admitter)
    with pytest.raises(TypeError, match="not initialised"):
        blank.admits((None,) * 20)
    args = dict(n_fields=20, present=(0,), absent=(), null_pos=18, null_slot_id=None, guard=lambda *a: True,
                check_inference=True, written=(), addr=(0,), extents=(4,), aligned=(), written_addr=(),
                vector_bytes=16, data_ptr=torch.Tensor.data_ptr, is_inference=torch.Tensor.is_inference)
    adm = cache._Admitter(**args)
    with pytest.raises(TypeError, match="already initialised"):
        adm.__init__(**args)
    with pytest.raises(ValueError, match="call has 3 fields, expected 20"):
        adm.admits((1, 2, 3))
    for bad in (dict(null_pos=20), dict(present=(20,)), dict(addr=(1,)), dict(extents=()), dict(vector_bytes=0)):
        with pytest.raises(ValueError):
            cache._Admitter(**{**args, **bad})
    assert adm.admits((torch.zeros(1),) + (None,) * 19) == cache.ADMIT


def test_a_refused_initialisation_leaves_the_c_check_as_it_was():
    """A second __init__ (refused) or a first one refused half-way must change nothing: before, the
    second one stored its data_ptr_fn before refusing, and the next call jumped to that address.
    Run in a subprocess: the defect killed the interpreter."""
    if cache._Admitter is None:
        require_native()
        pytest.skip("the C admission check is not built here")
    code = """if True:
        import torch
        from mamba3_step.validation import cache
        args = dict(n_fields=20, present=(0,), absent=(), null_pos=18, null_slot_id=None, guard=lambda *a: True,
                    check_inference=True, written=(), addr=(0,), extents=(4,), aligned=(), written_addr=(),
                    vector_bytes=16, data_ptr=torch.Tensor.data_ptr, is_inference=torch.Tensor.is_inference)
        adm = cache._Admitter(**args)
        try:
            adm.__init__(**args, data_ptr_fn=8)  # a bogus function address
        except TypeError as e:
            print("refused:", e)
        blank = cache._Admitter.__new__(cache._Admitter)
        try:
            blank.__init__(**{**args, "data_ptr_fn": 8, "extents": ()})  # refused after the indices
        except ValueError as e:
            print("refused:", e)
        try:
            blank.admits((torch.zeros(1),) + (None,) * 19)
        except TypeError as e:
            print("blank:", e)
        print("admits:", adm.admits((torch.zeros(1),) + (None,) * 19) == cache.ADMIT)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.splitlines() == ["refused: Admitter: already initialised",
                                     "refused: Admitter: one extent per addr entry",
                                     "blank: Admitter: not initialised", "admits: True"]


def test_the_c_check_can_be_switched_off_by_environment(tmp_path):
    """MAMBA3_STEP_NATIVE=0: new signatures use the Python check (a fresh interpreter reads it)."""
    code = "from mamba3_step.validation import cache; print(cache.NATIVE, cache._Admitter is not None)"
    env = dict(os.environ, MAMBA3_STEP_NATIVE="0")
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    on = subprocess.run([sys.executable, "-c", code], env={**env, "MAMBA3_STEP_NATIVE": "1"}, capture_output=True,
                        text=True, check=True)
    built = cache._Admitter is not None
    assert off.stdout.split() == ["False", str(built)]
    assert on.stdout.split() == [str(built), str(built)]


# --------------------------------------------------------------------------- bound and threads
def test_the_cache_is_bounded_and_forgets_the_oldest_key(full_calls):
    c = ValidationCache(max_keys=3, per_key=2)
    calls = []
    for B in (1, 2, 3, 4):
        kw = make_inputs(B, P, H, DH, N, R)
        kw["state_batch_indices"] = torch.full((B,), -1, dtype=torch.int32)
        calls.append(kw)
        c.check(*tensors_and_options(kw)[:1])
    assert len(c._entries) == 3 and len(full_calls) == 4
    c.check(*tensors_and_options(_fresh_copy(calls[-1]))[:1])
    assert len(full_calls) == 4  # B = 4 is still there
    c.check(*tensors_and_options(_fresh_copy(calls[0]))[:1])
    assert len(full_calls) == 5  # B = 1 was evicted first
    for seed in range(4):  # one key, several signatures: at most per_key of them
        kw = make_inputs(2, P, H, DH, N, R, seed=seed)
        kw["state_batch_indices"] = torch.full((2,), -1, dtype=torch.int32)
        kw["xproj"] = kw["xproj"].requires_grad_(seed % 2 == 0)
        kw["D"] = kw["D"].requires_grad_(seed >= 2)
        c.check(*tensors_and_options(kw)[:1])
    assert max(len(v) for v in c._entries.values()) == 2


def test_threads_sharing_a_small_cache_get_the_full_validations_answers():
    c = ValidationCache(max_keys=2, per_key=1)  # small: constant eviction while the threads read
    cases = [pool_call(seed=1), pool_call(seed=2, update_kv_state=False)]
    bad = pool_call(seed=3)
    _out_inside_x(bad)
    cases.append(bad)
    cases.append(_fresh_copy(cases[0]))
    k = dict(make_inputs(2, P, H, DH, N, R, seed=4), state_batch_indices=torch.tensor([0, -1], dtype=torch.int32))
    cases.append(k)
    expected = [outcome(check_step_inputs, kw) for kw in cases]
    assert [e[0] for e in expected] == ["ok", "ok", ValueError, "ok", "ok"]
    errors = []

    def work(offset):
        try:
            for i in range(300):
                j = (i + offset) % len(cases)
                got = outcome(c.check, cases[j])
                if got != expected[j]:
                    errors.append((j, got, expected[j]))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    run_threads([functools.partial(work, n) for n in range(4)])
    assert not errors, errors[:3]
    assert len(c._entries) <= 2


def test_a_cached_call_changes_the_same_bytes_as_an_uncached_one(fresh_cache):
    kw = pool_call(seed=7)
    mamba3_step_fn(**pool_call(seed=1))  # cached signature
    a, b = clone_inputs(kw), clone_inputs(kw)
    mamba3_step_fn(**a)
    fresh_cache.clear()
    mamba3_step_fn(**b)
    for name, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(raw(v), raw(b[name])), name
