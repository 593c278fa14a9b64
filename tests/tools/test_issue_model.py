"""The static issue model's arithmetic (mamba3_step.tools.issue_model), on figures checked by hand, and the
replay kernel's executed counts it reads (re-executed on the PTX tier)."""

from __future__ import annotations

import pytest

from mamba3_step.tools.bytes_model import bytes_per_step, replay_bytes
from mamba3_step.tools.issue_model import (GPUS, PIPELINE_EXECUTED, REPLAY_EXECUTED, REPLAY_STATES_EXECUTED, SPLIT_EXECUTED, STATE_FORMS_EXECUTED, UPSTREAM, VERIFY_EXECUTED, VERIFY_FROM_STATE_EXECUTED, issue_model, replay_issue_model, replay_states_replay_spec, replay_states_spec, replay_verify_issue_model, slab_bytes)
from mamba3_step.slab_pipeline import PIPELINE_DEFAULT_CTAS
from mamba3_step.spec import flagship_spec
from mamba3_step.tools.verify.step import executed_facts, replay_instructions, verify_instructions


def test_clock_is_derived_from_the_fp32_peak():
    assert GPUS["H100"].clock_hz == pytest.approx(67e12 / (132 * 256))  # ~1.98 GHz
    assert 1.9e9 < GPUS["H100"].clock_hz < 2.0e9 and 2.0e9 < GPUS["B200"].clock_hz < 2.2e9


def test_issue_and_memory_times_per_slab():
    gpu = GPUS["H100"]
    m = issue_model(7788, 70_000, gpu)
    assert m["issue_us"] == pytest.approx(7788 / 4 / gpu.clock_hz * 1e6)
    assert m["memory_us"] == pytest.approx(70_000 / (3.35e12 / 132) * 1e6)
    assert m["ratio"] == pytest.approx(m["issue_us"] / m["memory_us"])


def test_slab_bytes_is_the_step_per_lane_and_head():
    spec = flagship_spec()
    assert slab_bytes(spec, 8, 2) == bytes_per_step(spec, 8, 2)["total"] / 16
    # the fp32 (64 x 128) state, read and written, is most of it
    assert 65536 < slab_bytes(spec) < 1.1 * 65536


def test_upstream_constants_are_the_issue_figures():
    assert UPSTREAM["sm_90a"]["warp_instructions_per_slab"] == 1947 * 128 // 32 == 7788
    assert UPSTREAM["sm_100a"]["warp_instructions_per_slab"] == 7268


@pytest.mark.parametrize("K", [pytest.param(2, marks=pytest.mark.full_matrix), 4])
@pytest.mark.parametrize("from_checkpoint", [False, True])
def test_replay_counts_are_what_the_ptx_tier_executes(K, from_checkpoint):
    """REPLAY_EXECUTED (what bench/model_bench.py's replay issue table reads) holds the executed counts of
    today's kernel: re-executed here for K = 4, and K = 2 with --full-matrix (K = 8: bench/issue_model.py
    prints it)."""
    spec = flagship_spec(replay_ring=K, replay_from_checkpoint=from_checkpoint)
    warps, counts = REPLAY_EXECUTED[(K, from_checkpoint)]
    assert spec.num_warps == warps
    assert replay_instructions(spec) == counts
    assert replay_instructions(flagship_spec()) == (REPLAY_EXECUTED["stepwise"],)


@pytest.mark.parametrize("form, copied", [
    pytest.param(form, copied, id=f"{form}-{'async' if copied else 'registers'}",
                 marks=[] if (form, copied) == ("fp32", True) else [pytest.mark.full_matrix])
    for form in STATE_FORMS_EXECUTED for copied in (False, True)])
def test_state_form_counts_are_what_the_ptx_tier_executes(form, copied):
    changes = {"fp32": {}, "bf16, round to nearest": dict(state_dtype="bfloat16"),
               "bf16, stochastic rounding": dict(state_dtype="bfloat16", stochastic_rounding=True)}[form]
    facts = executed_facts(flagship_spec(async_state_copy=copied, **changes))
    assert facts["warp_instructions_per_cta"]["total"] == STATE_FORMS_EXECUTED[form][copied]
    assert facts["bytes_agree"]


@pytest.mark.parametrize("form, split", [pytest.param(f, k, marks=[] if (f, k) == ("fp32", 4) else [pytest.mark.full_matrix])
                                         for f in SPLIT_EXECUTED for k in (2, 4)])
def test_d_split_counts_are_what_the_ptx_tier_executes(form, split):
    changes = {"fp32": {}, "bf16, round to nearest": dict(state_dtype="bfloat16"),
               "bf16, stochastic rounding": dict(state_dtype="bfloat16", stochastic_rounding=True)}[form]
    facts = executed_facts(flagship_spec(tile_D=64 // split, **changes))
    assert facts["warp_instructions_per_cta"]["total"] == SPLIT_EXECUTED[form][split]
    assert facts["bytes_agree"]


@pytest.mark.parametrize("form", [pytest.param(f, marks=[] if f == "fp32" else [pytest.mark.full_matrix])
                                  for f in PIPELINE_EXECUTED])
def test_pipeline_counts_are_what_the_ptx_tier_executes(form):
    changes = {"fp32": {}, "bf16, round to nearest": dict(state_dtype="bfloat16"),
               "bf16, stochastic rounding": dict(state_dtype="bfloat16", stochastic_rounding=True)}[form]
    facts = executed_facts(flagship_spec(pipeline_ctas=PIPELINE_DEFAULT_CTAS, **changes))
    assert facts["warp_instructions_per_cta"]["total"] == PIPELINE_EXECUTED[form]
    assert facts["bytes_agree"]


@pytest.mark.full_matrix  # 40 s of flagship T = 4 executions: model inputs, re-read after a kernel change
def test_verify_counts_are_what_the_ptx_tier_executes():
    """VERIFY_EXECUTED (model_bench's replay verify table) holds today's verify step's executed count and
    the replay verify kernel's at K = 2 and 4 (4 committed tokens: a flush), re-executed here; K = 8's
    are printed by the same function (verify_instructions). VERIFY_FROM_STATE_EXECUTED the same with the
    drafts' outputs from the checkpoint, at K = 2, 4 and 8 (4 committed tokens: a flush at K = 2 and 4,
    the committed tokens in the sums at K = 8)."""
    today = flagship_spec(tokens=4, has_dst=True, dst_per_token=True, num_accepted=True)
    assert replay_instructions(today) == (VERIFY_EXECUTED["today"],)
    for K in (2, 4):
        spec = flagship_spec(replay_ring=K, tokens=4, num_accepted=True)
        assert verify_instructions(spec, 4) == VERIFY_EXECUTED[K][4]
    for K in (2, 4, 8):
        spec = flagship_spec(replay_ring=K, tokens=4, num_accepted=True, replay_from_checkpoint=True)
        assert verify_instructions(spec, 4) == VERIFY_FROM_STATE_EXECUTED[K][4]


def test_replay_verify_issue_model_by_hand():
    """H100, K = 8: the steady state's two steps (4 and 8 committed tokens) averaged, against the bytes
    model's verify step (half a state write a step); the figures docs/performance.md 3d states."""
    gpu = GPUS["H100"]
    today = flagship_spec(tokens=4, has_dst=True, dst_per_token=True, num_accepted=True)
    counts = VERIFY_EXECUTED[8]
    replay = issue_model((counts[4] + counts[8]) / 2, replay_bytes(today, 8, 256, 48)["total"] / (256 * 48), gpu)
    base = issue_model(VERIFY_EXECUTED["today"], slab_bytes(today), gpu)
    m = replay_verify_issue_model(8, gpu)
    assert m["ratio"] == pytest.approx(replay["ratio"]) and m["today_ratio"] == pytest.approx(base["ratio"])
    assert m["time"] == pytest.approx(max(replay["issue_us"], replay["memory_us"]) / max(base["issue_us"],
                                                                                        base["memory_us"]))
    assert (round(m["ratio"], 2), round(m["time"], 2), round(m["instructions"], 2)) == (1.79, 0.69, 1.52)
    k4 = replay_verify_issue_model(4, gpu)
    assert (round(k4["ratio"], 2), round(k4["time"], 2), round(k4["today_ratio"], 2)) == (1.26, 0.59, 0.46)
    # the drafts' outputs from the checkpoint: the issue's T = 4 targets (at most 0.45x today's bytes and
    # 0.5x its modelled H100 time) both met at K = 8, the time at K = 4 too
    fc8 = replay_verify_issue_model(8, gpu, from_checkpoint=True)
    counts = VERIFY_FROM_STATE_EXECUTED[8]
    replay = issue_model((counts[4] + counts[8]) / 2, replay_bytes(today, 8, 256, 48)["total"] / (256 * 48), gpu)
    assert fc8["time"] == pytest.approx(max(replay["issue_us"], replay["memory_us"]) / max(base["issue_us"],
                                                                                          base["memory_us"]))
    assert (round(fc8["ratio"], 2), round(fc8["time"], 3), round(fc8["instructions"], 2)) == (1.26, 0.488, 1.07)
    assert round(replay_verify_issue_model(4, gpu, from_checkpoint=True)["time"], 3) == 0.468


def test_replay_issue_model_by_hand():
    """H100, K = 4, replayed outputs: average executed instructions over the ring positions against the
    bytes averaged over them; time is the larger of issue and memory time over the stepwise step's."""
    gpu = GPUS["H100"]
    counts = REPLAY_EXECUTED[(4, False)][1]
    spec = flagship_spec()
    replay = issue_model(sum(counts) / 4, replay_bytes(spec, 4, 256, 48)["total"] / (256 * 48), gpu)
    stepwise = issue_model(REPLAY_EXECUTED["stepwise"], slab_bytes(spec), gpu)
    m = replay_issue_model(4, False, gpu)
    assert m["ratio"] == pytest.approx(replay["ratio"])
    assert m["time"] == pytest.approx(max(replay["issue_us"], replay["memory_us"]) / stepwise["memory_us"])
    assert m["time"] == pytest.approx(replay_bytes(spec, 4, 256, 48)["total"] / bytes_per_step(spec, 256, 48)["total"])


@pytest.mark.full_matrix
@pytest.mark.parametrize("name", list(REPLAY_STATES_EXECUTED))
def test_replay_states_counts_are_what_the_ptx_tier_executes(name):
    """REPLAY_STATES_EXECUTED (docs/performance.md 3d: replay with rotary, stochastic rounding, int8)
    holds the executed counts of today's kernel."""
    spec, _ = replay_states_spec(name)
    _, _, stepwise, counts = REPLAY_STATES_EXECUTED[name]
    assert replay_instructions(spec.with_default_tiling()) == (stepwise,)
    assert replay_instructions(replay_states_replay_spec(name)) == counts
