"""update_kv_state with the D-tiles of a (lane, head) as one cluster (``tiling.launch_cluster``), executed.

With ``tile_D < headdim`` the ``D / tile_D`` CTAs of a (lane, head) all read its old Bstate row and the
first of them overwrites it; the cluster barrier orders the overwrite behind every read
(docs/contract.md, "update_kv_state"). Each form here runs its kernel's PTX on the CPU and checks, bit
for bit, that the split stores what the whole-head tile stores (``out``, ``state``, ``Bstate``,
``Xstate``: the contract says the bits do not depend on the tiling), that the race detector, which
knows what the barrier orders, finds nothing, and that the same kernel launched without its cluster
(each CTA alone at the barrier) is reported racing on the Bstate row.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bits_equal, clone_inputs

from mamba3_step.api import prepare_step
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import make_inputs, padded_indices, speculative_indices
from mamba3_step.tiling import launch_cluster
from mamba3_step.tools.ptx_tier import run_step_ptx
from ptx_executor import analysis

H, NULL = 2, 1

#: (N, D, R, state dtype, tokens, the small tile, whether each token has its row): the flagship's shape with
#: 4 D-tiles (the Bstate store after the update of a one-token step), a bf16 state with 2, a T-token step
#: with its final row (the store after the last token) and a speculative one (a store each token)
FORMS = {
    "flagship-tileD16": (128, 64, 4, torch.float32, 1, 16, False),
    "N64-D64-R2-bf16-tileD32": (64, 64, 2, torch.bfloat16, 1, 32, False),
    "N32-D64-R4-T3-final-tileD16": (32, 64, 4, torch.float32, 3, 16, False),
    "N32-D64-R4-T2-spec-tileD32": (32, 64, 4, torch.float32, 2, 32, True),
}


def _call(form: str, seed: int):
    N, D, R, state_dtype, T, _, per_token = FORMS[form]
    B, P = 6, 16
    inputs = make_inputs(B, P, H, D, N, R, dtypes=dict(state_dtype=state_dtype), tokens=T if T > 1 else None,
                         seed=seed)
    if per_token:
        src, accepted, dst, _ = speculative_indices(B, P, T, null_slot_id=NULL, seed=seed)
        return inputs, dict(state_batch_indices=src, num_accepted_tokens=accepted, dst_state_batch_indices=dst,
                            null_slot_id=NULL)
    src, dst, _ = padded_indices(B, P, null_slot_id=NULL, with_dst=T > 1, seed=seed)
    return inputs, dict(state_batch_indices=src, dst_state_batch_indices=dst, null_slot_id=NULL)


def _execute(inputs, indices, tile_D, **run):
    t = clone_inputs(inputs)
    x = t["x"]
    t["out"] = torch.full(x.shape, float("nan"), dtype=x.dtype)
    spec, tensors, _ = prepare_step(StepTensors(**t, **indices), update_kv_state=True, tile_D=tile_D)
    return spec, t, run_step_ptx(spec, tensors, **run)


#: the forms of the default run (the rest with --full-matrix)
DEFAULT_FORMS = ("flagship-tileD16", "N32-D64-R4-T2-spec-tileD32")


@pytest.mark.parametrize("form", [f if f in DEFAULT_FORMS else pytest.param(f, marks=pytest.mark.full_matrix)
                                  for f in FORMS])
def test_the_cluster_split_stores_the_whole_heads_bits_and_nothing_races(form):
    tile = FORMS[form][5]
    inputs, indices = _call(form, seed=sum(map(ord, form)))
    whole_spec, whole, _ = _execute(inputs, indices, None)
    spec, split, res = _execute(inputs, indices, tile)
    assert whole_spec.tile_D == spec.headdim and launch_cluster(whole_spec) is None
    assert launch_cluster(spec) == (1, 1, spec.headdim // tile) and res.grid[2] == spec.headdim // tile
    for key in ("out", "state", "Bstate", "Xstate"):
        assert_bits_equal(split[key], whole[key], f"{form}: {key}")
    assert not torch.equal(split["Bstate"], inputs["Bstate"]), "the step stored B"
    assert analysis.cta_races(res) == [], f"{form}: bytes shared between CTAs the cluster barrier does not order"
    assert analysis.intra_cta_races(res) == []


def test_the_same_kernel_launched_without_its_cluster_races_on_the_bstate_row():
    inputs, indices = _call("N64-D64-R2-bf16-tileD32", seed=5)
    _, split, res = _execute(inputs, indices, 32, cluster=None)
    races = analysis.cta_races(res)
    assert races and {r[1] for r in races} == {"write/read"}, races
    bstate = split["Bstate"]
    start = bstate.data_ptr()
    assert all(start <= r[0] < start + bstate.numel() * bstate.element_size() for r in races), races
