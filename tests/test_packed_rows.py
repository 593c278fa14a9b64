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
from mamba3_step.ptx_tier import ptx_step_fn
from mamba3_step.spec import flagship_spec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import make_inputs, poison_

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
