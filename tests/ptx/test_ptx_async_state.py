"""The asynchronous state copy (``StepSpec.async_state_copy``), executed: its PTX run on the CPU
beside the register kernel users get by default.

The contract says ``out`` and every stored byte are independent of how the slab reaches the
update, so for each specialisation both kernels run on the same fresh random inputs (poisoned
``out``, every padding kind in the batch) and everything they write must be the same bits: ``out``,
the state pool (or ``state_out``), Bstate/Xstate, the rotary angles and an 8-bit state's scales.
The executor models the copies' asynchrony (docs/ptx-tier.md, "Asynchronous copies"): a copy's
bytes land in shared memory at the wait that completes it, and a read of them before, a write
into them while in flight, or a thread exiting with copies pending is an error, so these runs also
show the kernel waits where it must.

Padding lanes: not one byte of any pool row read (no copy issued) or written; live lanes read
exactly their source rows, each state byte once.

The covering set, one multi-token, one rotary, one stochastic-rounding and one 8-bit
specialisation run by default; every multi-token, rotary, stochastic and 8-bit one with
``--full-matrix``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from async_state_cases import ASYNC_DEFAULT as DEFAULT, ASYNC_FULL as FULL
from test_kernel_compile import COVERING

from mamba3_step.api import prepare_step
from mamba3_step.spec import StepSpec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits_equal, inputs_for, poison_, pool_rows, step_indices
from mamba3_step.tools.ptx_tier import run_step_ptx
from ptx_executor import analysis

NULL = 2
#: the lane kinds of mamba3_step.testing.step_indices that read a row; every other kind is padding
LIVE_KINDS = ("live", "live_nodst", "live_gaps")
#: the tensors a step may write, compared bit for bit between the two kernels
WRITTEN = ("out", "state", "state_out", "Bstate", "Xstate", "angle_state", "state_scale")

CASES = [pytest.param(name, id=name) for name in DEFAULT] + [
    pytest.param(name, id=name, marks=pytest.mark.full_matrix) for name in FULL]


def _spec(name: str) -> StepSpec:
    return {**DEFAULT, **FULL}[name].with_default_tiling()


def _prepared(spec: StepSpec, B: int, seed: int) -> tuple:
    """Fresh inputs and indices for ``spec`` (every padding kind in pool mode), validated as a
    user's call: ``(StepTensors, lane kinds)``; ``out`` poisoned."""
    P = pool_rows(spec, B) if spec.pool else None
    inputs = inputs_for(spec, B, P, H=2 if spec.dstate * spec.headdim * spec.mimo < 256 * 32 * 8 else 1, seed=seed)
    kinds = ["live"] * B
    kw = {}
    if spec.pool:
        kw, kinds = step_indices(spec, B, P, null_slot_id=NULL, seed=seed)
        kw = {k: v for k, v in kw.items() if v is not None}
    if spec.has_state_out:
        inputs["state_out"] = poison_(torch.empty_like(inputs["state"]))
    if spec.has_rand_rows:  # dense mode drawing each lane's bits for another row
        inputs["rand_rows"] = torch.randperm(3 * B, generator=torch.Generator().manual_seed(seed))[:B].to(torch.int32)
    x = inputs["x"]
    lead = x.shape[:-2]
    inputs["out"] = poison_(torch.empty((*lead, x.shape[-2], x.shape[-1]) if spec.has_outproj else
                                        (*lead, spec.mimo, x.shape[-2], x.shape[-1]), dtype=x.dtype))
    prepared, tensors, _ = prepare_step(StepTensors(**inputs, **kw), update_kv_state=spec.update_kv_state,
                                        stochastic_rounding=spec.stochastic_rounding,
                                        rotate_pairwise=spec.rotate_pairwise, tile_D=spec.tile_D,
                                        num_warps=spec.num_warps)
    assert prepared == spec, (prepared, spec)
    return tensors, kinds


def _clone(tensors: StepTensors) -> StepTensors:
    return StepTensors(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tensors._asdict().items()})


@pytest.mark.parametrize("name", CASES)
def test_the_asynchronous_copy_writes_the_register_kernels_bits(name):
    spec = _spec(name)
    tensors, kinds = _prepared(spec, B=6, seed=17)
    registers, copied = _clone(tensors), _clone(tensors)
    run_step_ptx(spec, registers, record=False)
    run_step_ptx(spec.replace(async_state_copy=True), copied, record=False)
    compared = 0
    for key in WRITTEN:
        a, b = getattr(registers, key, None), getattr(copied, key, None)
        if a is None:
            continue
        assert bits_equal(a, b), f"{name}: {key} differs between the register and the asynchronous-copy kernel"
        compared += 1
    assert compared >= 2
    if spec.pool:
        assert any(k in LIVE_KINDS for k in kinds) and any(k not in LIVE_KINDS for k in kinds)
    changed = not bits_equal(registers.out, tensors.out)
    assert changed, f"{name}: the step wrote nothing to out"


@pytest.mark.parametrize("name", [n for n, s in COVERING.items() if s.pool] + ["flagship-T4-spec"])
def test_padding_lanes_issue_no_copy_and_live_lanes_copy_their_rows_once(name):
    spec = _spec(name).replace(async_state_copy=True)
    tensors, kinds = _prepared(spec.replace(async_state_copy=False), B=8, seed=5)
    res = run_step_ptx(spec, tensors)
    log = res.log.arrays()
    lane = analysis.cta_of(res, log["thread"]) % res.grid[0]
    src = tensors.state_batch_indices
    if src.dim() == 2:  # (B, K): the accepted entry
        nat = tensors.num_accepted_tokens.long()
        src = torch.where((nat >= 1) & (nat <= src.shape[1]), src.gather(1, (nat - 1).clamp(0, src.shape[1] - 1)
                                                                          .unsqueeze(1)).squeeze(1), -1)
    pool = tensors.state
    start, end = pool.data_ptr(), pool.data_ptr() + pool.numel() * pool.element_size()
    for b, kind in enumerate(kinds):
        sel = (lane == b) & ~log["write"]
        reads = [a + k for a, w in zip(log["addr"][sel].astype(np.int64).tolist(), log["width"][sel].tolist())
                 for k in range(w)]
        state_reads = [a for a in reads if start <= a < end]
        if kind not in LIVE_KINDS:
            assert not state_reads, f"{name}: padding lane {b} ({kind}) issued a copy of a state row"
            continue
        row = pool[int(src[b])]
        want = set(range(row.data_ptr(), row.data_ptr() + row.numel() * row.element_size()))
        assert set(state_reads) == want, f"{name}: lane {b} copies exactly its source row"
        assert len(state_reads) == len(want), f"{name}: lane {b} copies a state byte twice"


#: replay steps on the asynchronous state copy: one by default, the replay set's other forms with --full-matrix
REPLAY_CASES = [pytest.param("N32-D64-R8-replay-K3-bf16state-from-checkpoint-noout", id="small-from-checkpoint"),
                pytest.param("flagship-replay-K4", id="flagship-replay-K4", marks=pytest.mark.full_matrix),
                pytest.param("flagship-int8state-replay-K2", id="flagship-int8state-replay-K2",
                             marks=pytest.mark.full_matrix),
                pytest.param("flagship-rotary-replay-K4", id="flagship-rotary-replay-K4", marks=pytest.mark.full_matrix)]


@pytest.mark.parametrize("name", REPLAY_CASES)
def test_a_replay_decode_on_the_asynchronous_copy_is_the_executed_stepwise_kernels(name, monkeypatch):
    """tests/ptx/test_ptx_replay.py's decode (requests joining and leaving, every padding kind, flushes),
    with the replay kernel compiled on the asynchronous state copy and the stepwise kernel it is held
    to the register kernel users run."""
    import test_ptx_replay

    def replay_on_the_copy(spec, *args, **kwargs):
        return run_step_ptx(spec.replace(async_state_copy=spec.replay_ring > 0), *args, **kwargs)

    monkeypatch.setattr(test_ptx_replay, "run_step_ptx", replay_on_the_copy)
    test_ptx_replay.test_replay_decode_is_bit_identical_to_the_executed_stepwise_kernel(name)
