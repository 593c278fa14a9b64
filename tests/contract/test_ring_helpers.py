"""The ring's helpers: ``new_ring`` and ``fork_row`` refuse every bad argument by name, before anything
is allocated or written (docs/contract.md, "Replay").

Each refused ``fork_row`` is checked against a snapshot of every row tensor taken before the call,
byte for byte; a good one against the rows it was asked to copy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mamba3_step.replay import Ring, fork_row, new_ring
from mamba3_step.tensors import StepTensors

P, K, R, H, N, D, S = 5, 3, 2, 2, 32, 32, 4


def _rows(null_slot_id=None, ring_rows=P, stochastic=True, seed=0):
    """Random row pools of P rows (an 8-bit state with scales, angles) and a ring of ``ring_rows`` rows, every
    entry filled: a copy and a stray write are both visible."""
    g = torch.Generator().manual_seed(seed)
    t = StepTensors(state=torch.randint(-127, 128, (P, H, D, N), generator=g, dtype=torch.int8),
                    Bstate=torch.randn(P, R, H, N, generator=g).bfloat16(), Xstate=torch.randn(P, H, D, generator=g),
                    A=None, B=None, C=None, D=None, x=None, dt=None, trap=None, xproj=None,
                    null_slot_id=null_slot_id, angle_state=torch.randint(-2**62, 2**62, (P, H, S), generator=g),
                    state_scale=torch.rand(P, H, D, generator=g))
    ring = new_ring(ring_rows, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.float32, draft=1,
                    stochastic=stochastic, rope_angles=S)
    for field in ring:
        if field is not None:
            field.copy_(torch.randint(0, 100, field.shape, generator=g).to(field.dtype))
    return t, ring


def _snapshot(t: StepTensors, ring: Ring) -> list:
    return [v.view(torch.uint8).clone() if v.dtype.is_floating_point and v.element_size() == 1 else v.clone()
            for v in (*t, *ring) if isinstance(v, torch.Tensor)]


def _unchanged(before: list, t: StepTensors, ring: Ring) -> None:
    after = _snapshot(t, ring)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                           b.view(torch.uint8) if b.dtype != torch.uint8 else b)


def test_fork_row_copies_every_row_tensor_and_nothing_else():
    t, ring = _rows()
    before = _snapshot(t, ring)
    fork_row(t, ring, 1, np.int64(3))
    for old, new in zip(before, _snapshot(t, ring)):
        assert torch.equal(new[3], old[1])
        keep = [r for r in range(P) if r != 3]
        assert torch.equal(new[keep], old[keep])


@pytest.mark.parametrize("src, dst, null, match", [
    (-1, 2, None, r"src: expected a real row in \[0, 5\), got -1"),
    (1, -1, None, r"dst: expected a real row in \[0, 5\), got -1"),
    (1, P, None, r"dst: expected a real row in \[0, 5\), got 5"),
    (0, 2, 0, r"src: expected a real row in \[0, 5\) other than the null slot 0, got 0"),
    (2, 0, 0, r"dst: .* other than the null slot 0, got 0"),
])
def test_fork_row_refuses_a_padding_id_and_writes_nothing(src, dst, null, match):
    t, ring = _rows(null_slot_id=null)
    before = _snapshot(t, ring)
    with pytest.raises(ValueError, match=match):
        fork_row(t, ring, src, dst)
    _unchanged(before, t, ring)


def test_fork_row_refuses_a_ring_of_other_rows_before_writing_a_state_row():
    t, ring = _rows(ring_rows=P - 2)
    before = _snapshot(t, ring)
    with pytest.raises(ValueError, match=r"ring.B: expected a tensor of P = 5 rows \(state's\)"):
        fork_row(t, ring, 0, P - 1)
    _unchanged(before, t, ring)


@pytest.mark.parametrize("change, error, match", [
    (lambda t, r: (t, r, 1.0, 2), TypeError, "src: expected an int"),
    (lambda t, r: (t, r, 1, True), TypeError, "dst: expected an int"),
    (lambda t, r: (t, r, 1, torch.tensor(2)), TypeError, "dst: expected an int"),
    (lambda t, r: (t._asdict(), r, 1, 2), TypeError, "tensors: expected a mamba3_step.tensors.StepTensors"),
    (lambda t, r: (t, tuple(r), 1, 2), TypeError, "ring: expected a mamba3_step.Ring"),
    (lambda t, r: (t, r._replace(length=None), 1, 2), TypeError, "ring.length"),
    (lambda t, r: (t._replace(Xstate=t.Xstate[:3]), r, 1, 2), ValueError, "Xstate: expected a tensor of P = 5 rows"),
    (lambda t, r: (t._replace(angle_state=t.angle_state.to("meta")), r, 1, 2), ValueError, "angle_state"),
    (lambda t, r: (t._replace(Bstate=t.Bstate.float().requires_grad_()), r, 1, 2), ValueError,
     "Bstate: expected a tensor that does not require grad"),
])
def test_fork_row_refuses_every_bad_argument_by_name_before_writing(change, error, match):
    t, ring = _rows()
    before = _snapshot(t, ring)
    args = change(t, ring)
    with pytest.raises(error, match=match):
        fork_row(*args)
    _unchanged(before, t, ring)


def test_fork_row_refuses_an_inference_tensor_outside_inference_mode_before_writing():
    with torch.inference_mode():
        t, ring = _rows()
    before = _snapshot(t, ring)
    with pytest.raises(ValueError, match=r"state: expected a tensor that can be written here, got an inference"):
        fork_row(t, ring, 0, 1)
    _unchanged(before, t, ring)
    with torch.inference_mode():
        fork_row(t, ring, 0, 1)
    assert torch.equal(t.state[1], t.state[0]) and torch.equal(ring.length[1], ring.length[0])


GOOD = dict(rows=3, flush_length=2, mimo=2, heads=2, dstate=32, headdim=32, kv_dtype=torch.bfloat16, x_dtype=torch.float32)


@pytest.mark.parametrize("name, value, error, match", [
    ("rows", 0, ValueError, r"rows: expected an int in \[1, 2147483647\] \(pool rows: int32 slot ids\), got 0"),
    ("rows", 2.0, ValueError, r"rows: expected an int in \[1, 2147483647\].*got 2.0"),
    ("rows", 2**31, ValueError, r"rows: expected an int in \[1, 2147483647\].*got 2147483648"),
    ("flush_length", 1, ValueError, r"flush_length: expected an int in \[2, 16\] \(the flush length\), got 1"),
    ("flush_length", True, ValueError, r"flush_length: expected an int in \[2, 16\].*got True"),
    ("mimo", 3, ValueError, r"mimo: expected one of \(1, 2, 4, 8\).*got 3"),
    ("heads", -1, ValueError, r"heads: expected an int in \[1, 65535\] \(the step's most heads\), got -1"),
    ("heads", 2**31, ValueError, r"heads: expected an int in \[1, 65535\].*got 2147483648"),
    ("dstate", 48, ValueError, r"dstate: expected one of \(32, 64, 128, 256\).*got 48"),
    ("headdim", "32", ValueError, r"headdim: expected an int >= 1, got '32'"),
    ("draft", 17, ValueError, r"draft: expected an int in \[0, 16\].*got 17"),
    ("rope_angles", 17, ValueError, r"rope_angles: expected an int in \[0, 16\].*got 17"),
    ("kv_dtype", torch.int8, TypeError, r"kv_dtype: expected one of torch.bfloat16, torch.float16, torch.float32, "
                                        r"got torch.int8"),
    ("x_dtype", "float64", TypeError, r"x_dtype: expected one of"),
    ("stochastic", "no", TypeError, r"stochastic: expected a bool, got str 'no'"),
    ("stochastic", 1, TypeError, r"stochastic: expected a bool, got int 1"),
    ("device", "gpu", ValueError, r"device: expected a torch device such as 'cpu' or 'cuda', got 'gpu'"),
])
def test_new_ring_refuses_every_bad_argument_by_name(name, value, error, match):
    with pytest.raises(error, match=match):
        new_ring(**dict(GOOD, **{name: value}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process without CUDA")
def test_new_ring_on_cuda_without_cuda_is_refused_by_name():
    with pytest.raises(ValueError, match=r"device: expected a device this process can use, got 'cuda', but CUDA is "
                                         r"not available"):
        new_ring(**GOOD, device="cuda")


def test_new_ring_builds_what_it_is_asked_for():
    ring = new_ring(**dict(GOOD, draft=2, stochastic=False, rope_angles=np.int64(3), kv_dtype="float16"))
    assert ring.offset is None and ring.drawn_for is None
    assert ring.B.shape == (3, 3, 2, 2, 32) and ring.B.dtype == torch.float16 and ring.angle.shape == (3, 3, 2, 3)
    rounded = new_ring(**GOOD, stochastic=True)
    assert rounded.offset.shape == (3, 1, 2) and rounded.angle is None
    assert all(not bool(f.any()) for f in rounded if f is not None)


def _freed(t):
    u = t.clone()
    u.untyped_storage().resize_(0)
    return u


@pytest.mark.parametrize("name, error, match", [
    ("kv_dtype", TypeError, r"^kv_dtype: expected a torch dtype or its name, got a tensor"),
    ("x_dtype", TypeError, r"^x_dtype: expected a torch dtype or its name, got a tensor"),
    ("flush_length", ValueError, r"^flush_length: expected an int in \[2, 16\]"),
])
def test_new_ring_never_compares_a_tensor_given_for_a_scalar(name, error, match):
    """A tensor whose storage was freed reads freed memory when compared: it is refused by its kind."""
    with pytest.raises(error, match=match):
        new_ring(**dict(GOOD, **{name: _freed(torch.zeros(3))}))


@pytest.mark.parametrize("null", [_freed(torch.tensor([1, 0, 2], dtype=torch.int32)), 0.0, True])
def test_fork_row_refuses_a_null_slot_id_that_is_not_an_int(null):
    t, ring = _rows(null_slot_id=null)
    before = _snapshot(t._replace(null_slot_id=None), ring)
    with pytest.raises(TypeError, match=r"^null_slot_id: expected None or an int"):
        fork_row(t, ring, 1, 2)
    _unchanged(before, t._replace(null_slot_id=None), ring)
