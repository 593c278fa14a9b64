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
from async_state_cases import assert_same_writes, case_params, case_spec as _spec, prepared_call, run_each
from test_kernel_compile import COVERING

from mamba3_step.testing import bits_equal
from mamba3_step.tools.ptx_tier import run_step_ptx
from ptx_executor import analysis

#: the lane kinds of mamba3_step.testing.step_indices that read a row; every other kind is padding
LIVE_KINDS = ("live", "live_nodst", "live_gaps")
@pytest.mark.parametrize("name", case_params())
def test_the_asynchronous_copy_writes_the_register_kernels_bits(name):
    spec = _spec(name)
    tensors, kinds = prepared_call(spec, B=6, seed=17)
    registers, copied = run_each(tensors, spec, spec.replace(async_state_copy=True))
    assert assert_same_writes(registers, copied, f"{name}, the register and the asynchronous-copy kernel") >= 2
    if spec.pool:
        assert any(k in LIVE_KINDS for k in kinds) and any(k not in LIVE_KINDS for k in kinds)
    changed = not bits_equal(registers.out, tensors.out)
    assert changed, f"{name}: the step wrote nothing to out"


@pytest.mark.parametrize("name", [n for n, s in COVERING.items() if s.pool] + ["flagship-T4-spec"])
def test_padding_lanes_issue_no_copy_and_live_lanes_copy_their_rows_once(name):
    spec = _spec(name).replace(async_state_copy=True)
    tensors, kinds = prepared_call(spec, B=8, seed=5)
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
