"""Packed and padded state rows: StepSpec.padded_state_rows, derived by validation, never passed.

A state whose D stride is N (a packed (D, N) block per pool row and head, as ``torch.empty``
and every slice along P or H make it) gets a kernel that knows that stride at compile time; any
other legal stride (16-byte padded rows) gets the kernel that takes it at run time. Both are
checked here: the derivation, the cache keys, and the executed PTX of the two specialisations
on the same values, bit for bit, with the padding columns untouched.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import torch

from mamba3_step.api import prepare_step
from mamba3_step.tools.ptx_tier import ptx_step_fn, run_step_ptx
from mamba3_step.replay import new_ring
from mamba3_step.spec import flagship_spec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import lane_inputs, layer_weights, make_inputs, poison_, row_tensors

N, D, R = 128, 64, 4


def _padded(t: torch.Tensor, pad: int = 4) -> torch.Tensor:
    """``t``'s values in storage whose rows are ``pad`` elements longer (poisoned padding)."""
    store = poison_(torch.empty(t.shape[:-1] + (t.shape[-1] + pad,), dtype=t.dtype))
    view = store[..., : t.shape[-1]]
    view.copy_(t)
    return view


def _spec(**inputs):
    spec, _, _ = prepare_step(StepTensors(**inputs), update_kv_state=True)
    return spec


def test_validation_derives_padded_state_rows():
    inp = make_inputs(3, 6, H=4, D=D, N=N, R=R, seed=1)
    idx = torch.tensor([0, 2, 5], dtype=torch.int32)
    packed = _spec(**inp, state_batch_indices=idx)
    assert packed.padded_state_rows is False and packed == flagship_spec()
    assert "padded_state_rows" not in packed.key()
    # slices along P or H keep the rows packed: same specialisation
    sliced = dict(inp, state=torch.empty(8, 4, D, N)[1:7], Bstate=inp["Bstate"], Xstate=inp["Xstate"])
    assert _spec(**sliced, state_batch_indices=idx) == packed
    heads = dict(inp, state=torch.empty(6, 6, D, N)[:, 1:5])
    assert _spec(**heads, state_batch_indices=idx) == packed
    padded = _spec(**dict(inp, state=_padded(inp["state"])), state_batch_indices=idx)
    assert padded.padded_state_rows is True and padded == packed.replace(padded_state_rows=True)
    assert "padded_state_rows=1" in padded.key()
    # dense mode: state_out's rows count too
    dense = make_inputs(3, None, H=2, D=D, N=N, R=R, seed=2)
    out = torch.empty_like(dense["state"])
    assert _spec(**dense, state_out=out).padded_state_rows is False
    assert _spec(**dense, state_out=_padded(out)).padded_state_rows is True


def test_padded_rows_execute_bit_identical_to_packed():
    """The flagship from its PTX, pool mode with update_kv_state and padding lanes: the padded
    specialisation's out, state, Bstate and Xstate equal the packed one's bit for bit, and it
    leaves every padding column of the pool as it was."""
    B, P = 4, 6
    inp = make_inputs(B, P, H=2, D=D, N=N, R=R, seed=7)
    idx = torch.tensor([4, -1, 0, 2], dtype=torch.int32)
    runs = {}
    for layout in ("packed", "padded"):
        run = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
        if layout == "padded":
            run["state"] = _padded(run["state"])
            pad = run["state"].as_strided(run["state"].shape[:-1] + (4,), run["state"].stride(),
                                          run["state"].storage_offset() + N)
            pad_before = pad.clone()
        out = ptx_step_fn(**run, state_batch_indices=idx, update_kv_state=True)
        runs[layout] = (out, run)
    (out_a, a), (out_b, b) = runs["packed"], runs["padded"]
    assert out_a.view(torch.int32).eq(out_b.view(torch.int32)).all()
    assert out_a[1].eq(0).all() and not out_a[0].eq(0).all()
    for key in ("state", "Bstate", "Xstate"):
        assert torch.equal(a[key].view(torch.int8), b[key].contiguous().view(torch.int8)), key
    assert not torch.equal(a["state"], inp["state"])  # the step wrote its rows
    assert torch.equal(pad.view(torch.int32), pad_before.view(torch.int32))


def test_padded_rows_replay_executes_bit_identical_to_packed():
    """The replay kernel (K = 2, outputs replayed) from its PTX over three steps, so that every live row
    appends and flushes: padded rows give the packed kernel's outs, states and rings bit for bit."""
    K, P, H = 2, 4, 2
    g = torch.Generator().manual_seed(11)
    rows = row_tensors(P, H, D, N, R, generator=g)
    weights = layer_weights(H, D, R, generator=g)
    index = torch.tensor([2, -1, 0], dtype=torch.int32)
    copies = {}
    for layout in ("packed", "padded"):
        pools = {k: v.clone() for k, v in rows.items()}
        if layout == "padded":
            pools["state"] = _padded(pools["state"])
        ring = new_ring(P, K, R, H, N, D, kv_dtype=rows["Bstate"].dtype, x_dtype=rows["Xstate"].dtype)
        copies[layout] = (pools, ring, flagship_spec(replay_ring=K, padded_state_rows=layout == "padded"), [])
    for _ in range(3):
        lane = lane_inputs(3, H, D, N, R, generator=g)
        for pools, ring, spec, outs in copies.values():
            out = poison_(torch.empty(3, H, D, dtype=rows["Xstate"].dtype))
            call = StepTensors(pools["state"], pools["Bstate"], pools["Xstate"], lane["A"], lane["B"], lane["C"],
                               weights["D"], lane["x"], lane["dt"], lane["trap"], weights["xproj"],
                               outproj=weights["outproj"], out=out, z=lane["z"], zproj=weights["zproj"],
                               state_batch_indices=index)
            run_step_ptx(spec, call, ring=ring)
            outs.append(out)
    (a, ring_a, _, outs_a), (b, ring_b, _, outs_b) = copies["packed"], copies["padded"]
    for x, y in zip(outs_a, outs_b):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    assert outs_a[0][1].eq(0).all() and not outs_a[0][0].eq(0).all()
    for key in ("state", "Bstate", "Xstate"):
        assert torch.equal(a[key].view(torch.int8), b[key].contiguous().view(torch.int8)), key
    assert not torch.equal(a["state"][2], rows["state"][2])  # flushed
    for field in ("B", "x", "coef", "length"):
        assert torch.equal(getattr(ring_a, field), getattr(ring_b, field)), field
