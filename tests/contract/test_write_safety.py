"""A failed step changes nothing, and a written tensor may not share memory with anything else
(docs/contract.md, "Written tensors and aliasing").

Every case is a call that must be refused up front with a named error; afterwards every input is
compared byte for byte with a snapshot taken before the call.

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import make_inputs

from mamba3_step import mamba3_step_fn

NB, P, H, DH, N, R = 3, 5, 2, 32, 32, 2
TENSORS = ("state", "Bstate", "Xstate", "A", "B", "C", "D", "x", "dt", "trap", "xproj", "outproj",
           "state_out", "out", "z", "zproj", "state_batch_indices", "dst_state_batch_indices")


def pool_call(**overrides) -> dict:
    kw = make_inputs(NB, P, H, DH, N, R, seed=5)
    kw["out"] = torch.zeros(NB, H, DH, dtype=torch.bfloat16)
    kw["state_batch_indices"] = torch.tensor([0, 1, -1], dtype=torch.int32)
    kw["dst_state_batch_indices"] = torch.tensor([2, 3, -1], dtype=torch.int32)
    kw["update_kv_state"] = True
    kw.update(overrides)
    return kw


def dense_call(**overrides) -> dict:
    kw = make_inputs(NB, None, H, DH, N, R, seed=6)
    kw["out"] = torch.zeros(NB, H, DH, dtype=torch.bfloat16)
    kw["update_kv_state"] = True
    kw.update(overrides)
    return kw


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (logical order), as a new uint8 tensor."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def snapshot(kw: dict, extra=()) -> list:
    return [raw(v) for v in kw.values() if isinstance(v, torch.Tensor)] + [raw(t) for t in extra]


def refused(kw: dict, exc, *words, extra=()) -> str:
    """Assert the call raises ``exc`` whose message contains every word (whole-word for names),
    and that no input (nor any tensor of ``extra``) changed a byte."""
    before = snapshot(kw, extra)
    with pytest.raises(exc) as info:
        mamba3_step_fn(**kw)
    msg = str(info.value)
    for w in words:
        assert re.search(rf"(?<![A-Za-z0-9_]){re.escape(w)}(?![A-Za-z0-9_])", msg), f"{w!r} not in: {msg}"
    after = snapshot(kw, extra)
    for i, (a, b) in enumerate(zip(before, after)):
        assert torch.equal(a, b), f"tensor #{i} changed although the call was refused: {msg}"
    return msg


def test_valid_calls_pass():
    mamba3_step_fn(**pool_call())
    mamba3_step_fn(**dense_call())
    mamba3_step_fn(**dense_call(update_kv_state=False, state_out=torch.empty(NB, H, DH, N)))


# ------------------------------------------------------------------ item 3: write targets
WRITTEN = [("pool", "out"), ("pool", "state"), ("pool", "Bstate"), ("pool", "Xstate"),
           ("dense", "out"), ("dense", "state"), ("dense", "Bstate"), ("dense", "Xstate"),
           ("dense_so", "state_out")]


def call_for(mode: str, **overrides) -> dict:
    if mode == "pool":
        return pool_call(**overrides)
    if mode == "dense":
        return dense_call(**overrides)
    return dense_call(state_out=torch.zeros(NB, H, DH, N), **overrides)


@pytest.mark.parametrize("mode,arg", WRITTEN)
def test_written_leaf_requiring_grad_is_refused(mode, arg):
    kw = call_for(mode)
    kw[arg] = kw[arg].clone().requires_grad_(True)
    refused(kw, ValueError, arg, "requires_grad")


@pytest.mark.parametrize("mode,arg", WRITTEN)
def test_written_inference_tensor_is_refused_outside_inference_mode(mode, arg):
    kw = call_for(mode)
    with torch.inference_mode():
        kw[arg] = kw[arg].clone()
    refused(kw, ValueError, arg, "inference")


def test_inference_tensors_inside_inference_mode_are_fine():
    with torch.inference_mode():
        kw = pool_call()
        kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        mamba3_step_fn(**kw)


@pytest.mark.parametrize("mode,arg", WRITTEN)
def test_written_tensor_with_stride_0_is_refused(mode, arg):
    kw = call_for(mode)
    t = kw[arg]
    kw[arg] = t[:1].expand(t.shape)  # every row is the same memory
    refused(kw, ValueError, arg, "overlap")


def test_stride_0_state_pool_in_pool_mode_is_refused_without_a_warning():
    """Used to run with only PyTorch's index_put_ warning, writing one row P times."""
    kw = pool_call(update_kv_state=False)
    kw["state"] = kw["state"][:1].expand(P, H, DH, N)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        refused(kw, ValueError, "state", "overlap")


def test_self_overlapping_written_view_is_refused():
    """Not only stride 0: a view whose rows overlap each other (stride smaller than a row)."""
    kw = pool_call()
    buf = torch.zeros(NB * H * DH, dtype=torch.bfloat16)
    kw["out"] = buf.as_strided((NB, H, DH), (DH, DH, 1))  # lanes share the heads' memory
    refused(kw, ValueError, "out", "overlap", extra=[buf])


def test_read_only_tensors_may_require_grad_and_outputs_carry_no_grad_fn():
    """Weights are often nn.Parameters: reading them is fine, and the result is a plain tensor."""
    for call in (pool_call(), dense_call()):
        for name in ("A", "D", "xproj", "outproj", "zproj", "B", "x"):
            call[name] = call[name].clone().requires_grad_(True)
        out = mamba3_step_fn(**call)
        assert out.grad_fn is None and not out.requires_grad
        for name in ("state", "Bstate", "Xstate"):
            assert call[name].grad_fn is None and not call[name].requires_grad, name
    kw = pool_call()
    kw["out"] = None
    kw["x"] = kw["x"].clone().requires_grad_(True)
    out = mamba3_step_fn(**kw)
    assert out.grad_fn is None and not out.requires_grad


def test_read_only_stride_0_tensors_are_fine():
    """Broadcast inputs that are only read (weights, a shared B) are legitimate."""
    kw = pool_call(update_kv_state=False)
    kw["Bstate"] = kw["Bstate"][:1].expand(P, R, H, N)
    kw["C"] = kw["C"][:1].expand(NB, R, H, N)
    mamba3_step_fn(**kw)


# ------------------------------------------------------------------ item 4: aliasing
def test_out_aliasing_x_with_update_kv_state_is_refused():
    """Used to store out (not x) into Xstate: the CPU path wrote out before storing x."""
    for make in (pool_call, dense_call):
        kw = make()
        kw["out"] = kw["x"]
        refused(kw, ValueError, "out", "x")


def carve(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor shaped and typed like ``like`` at byte ``offset`` of the uint8 ``buf``,
    holding ``like``'s values."""
    nbytes = like.numel() * like.element_size()
    t = buf[offset:offset + nbytes].view(like.dtype).view(like.shape)
    t.copy_(like)
    return t


def shared(read: torch.Tensor, written: torch.Tensor):
    """``(buf, read', written')``: copies of the two placed in one buffer, the written one starting
    half-way into the read one (16-byte aligned)."""
    rb, wb = (t.numel() * t.element_size() for t in (read, written))
    start = (rb // 2) // 16 * 16
    buf = torch.zeros(start + rb + wb + 16, dtype=torch.uint8)
    return buf, carve(buf, 0, read), carve(buf, start, written)


@pytest.mark.parametrize("written,read", [
    ("out", "z"), ("out", "x"), ("out", "Xstate"), ("state", "Bstate"), ("Bstate", "B"), ("Xstate", "x"),
    ("Xstate", "z"), ("out", "xproj"), ("Bstate", "C"), ("out", "A"), ("state", "D"),
])
def test_written_tensor_overlapping_another_argument_is_refused(written, read):
    """The written tensor is carved out of the same buffer as the other one, partly overlapping."""
    kw = pool_call()
    buf, kw[read], kw[written] = shared(kw[read], kw[written])
    refused(kw, ValueError, written, read, extra=[buf])


def test_two_written_tensors_overlapping_is_refused():
    kw = dense_call(update_kv_state=False)
    buf = torch.zeros(NB * H * DH * N * 2)
    kw["state_out"] = buf[: NB * H * DH * N].view(NB, H, DH, N)
    kw["state"] = buf[NB * H * DH * N // 2: NB * H * DH * N // 2 + NB * H * DH * N].view(NB, H, DH, N)
    refused(kw, ValueError, "state_out", "state", extra=[buf])


def test_written_pool_overlapping_the_indices_is_refused():
    kw = pool_call()
    kw["dst_state_batch_indices"] = kw["Xstate"].view(torch.int32)[0, 0, :NB]
    refused(kw, ValueError, "Xstate", "dst_state_batch_indices")


def test_read_only_arguments_may_share_memory():
    """Read-read sharing is harmless: C is B, z is x, zproj is xproj, Bstate/Xstate are read only."""
    kw = pool_call(update_kv_state=False)
    kw["C"] = kw["B"]
    kw["z"] = kw["x"]
    kw["zproj"] = kw["xproj"]
    kw["Xstate"] = torch.cat([kw["x"], kw["x"]])[:P]
    mamba3_step_fn(**kw)


def test_in_place_state_is_its_own_read_and_write():
    kw = pool_call()
    before = kw["state"].clone()
    mamba3_step_fn(**kw)
    assert not torch.equal(kw["state"], before)
