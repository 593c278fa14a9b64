"""Fuzz (hypothesis): random write-target defects and aliasing patterns are refused with a named
error, and a refused call changes no byte of any input (docs/contract.md, "Written
tensors and aliasing").

Each example draws a valid call (pool mode, dense mode, dense mode with ``state_out``; with or
without ``update_kv_state``; small shapes, CPU path), then one or two defects:

* a written tensor that requires grad, or is an inference tensor used outside inference mode;
* a written tensor with elements sharing memory: a stride-0 ``expand`` of one slice, or a view
  whose outer stride is smaller than the span below it;
* a written tensor sharing bytes with another argument (read or written): both are carved out of
  one byte buffer, the written one starting anywhere (16-byte steps) inside the other, exactly on
  top of it included.

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import torch
from helpers import make_inputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mamba3_step import mamba3_step_fn

D, N = 32, 32
TENSOR_NAMES = ["state", "Bstate", "Xstate", "A", "B", "C", "D", "x", "dt", "trap", "xproj", "outproj",
                "state_out", "out", "z", "zproj", "state_batch_indices", "dst_state_batch_indices"]


def _base_call(draw) -> dict:
    mode = draw(st.sampled_from(["pool", "dense", "dense_so"]))
    B, H, R = draw(st.integers(1, 4)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    P = draw(st.integers(1, 5)) if mode == "pool" else None
    kw = make_inputs(B, P, H, D, N, R, has_z=draw(st.booleans()), has_outproj=draw(st.booleans()),
                     seed=draw(st.integers(0, 2**16)))
    kw["out"] = torch.zeros((B, H, D) if kw["outproj"] is not None else (B, R, H, D), dtype=kw["x"].dtype)
    if mode == "pool":
        kw["state_batch_indices"] = torch.tensor([b % P if b % 2 == 0 else -1 for b in range(B)], dtype=torch.int32)
    if mode == "dense_so":
        kw["state_out"] = torch.zeros_like(kw["state"])
    kw["update_kv_state"] = draw(st.booleans())
    return kw


def _written(kw) -> list[str]:
    """What the step writes (docs/contract.md), stated here independently of the code's table."""
    names = ["out", "state_out" if kw.get("state_out") is not None else "state"]
    return names + (["Bstate", "Xstate"] if kw["update_kv_state"] else [])


def _self_overlapping(t: torch.Tensor, draw) -> torch.Tensor | None:
    """A view shaped like ``t`` whose elements share memory (same dtype, new storage holding t's
    first values); None when every outer dimension has size 1 (nothing can overlap)."""
    dims = [d for d in range(t.dim() - 1) if t.shape[d] > 1]
    if not dims:
        return None
    if draw(st.booleans()):
        d = draw(st.sampled_from(dims))
        return t.narrow(d, 0, 1).expand(t.shape)  # stride 0 in dimension d
    d = draw(st.sampled_from(dims))
    strides = list(t.contiguous().stride())
    span_below = sum((s - 1) * st_ for s, st_ in zip(t.shape[d + 1:], strides[d + 1:])) + 1
    strides[d] = draw(st.integers(1, max(1, span_below - 1)))  # rows overlap the ones after them
    need = sum((s - 1) * st_ for s, st_ in zip(t.shape, strides)) + 1
    base = t.reshape(-1)[:need].clone() if t.numel() >= need else torch.zeros(need, dtype=t.dtype)
    return base.as_strided(tuple(t.shape), tuple(strides))


def _carve(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    t = buf[offset:offset + nbytes].view(like.dtype).view(like.shape)
    t.copy_(like)
    return t


@st.composite
def defective_calls(draw):
    kw = _base_call(draw)
    written = _written(kw)
    buffers, involved = [], set()
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["requires_grad", "inference", "self_overlap", "alias"]))
        name = draw(st.sampled_from(written))
        involved.add(name)
        t = kw[name]
        if kind == "requires_grad":
            kw[name] = t.detach().clone().requires_grad_(True)
        elif kind == "inference":
            with torch.inference_mode():
                kw[name] = t.detach().clone()
        elif kind == "self_overlap":
            view = _self_overlapping(t.detach(), draw)
            kw[name] = view if view is not None else t.detach().clone().requires_grad_(True)
        else:
            others = [n for n in TENSOR_NAMES if n != name and isinstance(kw.get(n), torch.Tensor)]
            other = draw(st.sampled_from(others))
            involved.add(other)
            o = kw[other].detach()
            ob, wb = (x.numel() * x.element_size() for x in (o, t))
            start = draw(st.integers(0, max(0, ob - 1) // 16)) * 16  # inside the other one
            buf = torch.zeros(start + ob + wb + 16, dtype=torch.uint8)
            kw[other] = _carve(buf, 0, o)
            kw[name] = _carve(buf, start, t.detach())
            buffers.append(buf)
    return kw, involved, buffers


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=defective_calls())
def test_defective_write_targets_and_aliasing_are_refused_and_change_nothing(case):
    kw, involved, buffers = case
    tensors = [v for v in kw.values() if isinstance(v, torch.Tensor)] + buffers
    before = [_raw(t) for t in tensors]
    try:
        mamba3_step_fn(**kw)
    except (TypeError, ValueError) as e:
        msg = str(e)
    else:
        raise AssertionError(f"accepted a call with defects in {sorted(involved)}")
    name = msg.split(":", 1)[0]
    assert name in involved, f"the error names {name!r}, not one of {sorted(involved)}: {msg}"
    for i, (t, b) in enumerate(zip(tensors, before)):
        assert torch.equal(_raw(t), b), f"input #{i} changed although the call was refused ({msg})"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.data())
def test_the_same_calls_without_defects_are_accepted(case):
    """The guard for the fuzz above: the base calls it breaks are valid."""
    kw = case.draw(st.composite(lambda draw: _base_call(draw))())
    mamba3_step_fn(**kw)
