"""Can an SM issue the step's instructions faster than HBM delivers its bytes? A static model.

Letters (docs/contract.md): B lanes, H heads, D head dim, N state size, R MIMO rank.

The step is memory-bound only while the SMs issue its instructions faster than the memory
system delivers its bytes; otherwise the issue slots, not HBM, set the time. Per SM and per
state slab (one (lane, head): ``D x N`` state elements, one CTA at the default ``tile_D = D``):

* issue time = warp-instructions per slab / (4 per clock x the SM clock): an SM has four
  schedulers, each issuing at most one warp-instruction per clock;
* memory time = bytes per slab / (HBM bandwidth / number of SMs): the slab's share of the
  bytes one step moves (:func:`mamba3_step.tools.bytes_model.bytes_per_step`, all lanes live, per
  (lane, head)) at the SM's share of the bandwidth.

The ratio issue / memory is the fraction of the memory time the SM is busy issuing: well below
1 leaves slack to hide latency. Warp-instructions per slab come from the compiled kernel
(static SASS counts: the kernel is fully unrolled, so a live CTA issues each instruction once
per warp) or from the PTX execution tier (executed PTX instructions, a close proxy).

The GPU figures are datasheet figures; the SM clock is derived from the datasheet's fp32 peak
(fp32 FLOP/s = SMs x 128 lanes x 2 x clock), and each entry says where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

from .bytes_model import bytes_per_step, replay_bytes
from ..spec import StepSpec, flagship_rotary_spec, flagship_spec

__all__ = ["GPUS", "GPU", "ISSUE_PER_CLOCK", "PIPELINE_EXECUTED", "REPLAY_EXECUTED", "REPLAY_STATES_EXECUTED", "SPLIT_EXECUTED",
           "ISSUED_SASS", "STATE_FORMS_EXECUTED",
           "UPSTREAM", "VERIFY_EXECUTED", "VERIFY_FROM_STATE_EXECUTED", "VERIFY_TOKENS", "issue_model", "replay_issue_model",
           "replay_states_issue_model", "replay_states_replay_spec", "replay_states_spec", "replay_verify_issue_model",
           "slab_bytes", "verify_spec"]

#: warp-instructions an SM can issue per clock (four schedulers, one each)
ISSUE_PER_CLOCK = 4


@dataclass(frozen=True)
class GPU:
    name: str
    sms: int
    hbm_bytes_per_s: float
    fp32_flops: float  # dense fp32 peak, for the clock
    arch: str  # the architecture whose kernel it runs
    source: str

    @property
    def clock_hz(self) -> float:
        return self.fp32_flops / (self.sms * 128 * 2)


GPUS = {
    "H100": GPU("H100 SXM5 80 GB", 132, 3.35e12, 67e12, "sm_90a",
                "NVIDIA H100 datasheet (3.35 TB/s HBM3, 67 TFLOPS fp32); 132 SMs: Hopper architecture "
                "whitepaper"),
    "H200": GPU("H200 SXM 141 GB", 132, 4.8e12, 67e12, "sm_90a",
                "NVIDIA H200 datasheet (4.8 TB/s HBM3e, 67 TFLOPS fp32); the H100's 132-SM chip"),
    "B200": GPU("B200 (HGX, 1000 W)", 148, 8.0e12, 80e12, "sm_100a",
                "NVIDIA HGX B200 datasheet (8 TB/s HBM3e, 80 TFLOPS fp32 per GPU); 148 SMs from public "
                "specification listings (not in NVIDIA's datasheet)"),
}

#: upstream's dense step kernel (state-spaces/mamba's CuteDSL ``mamba3_step_fn`` as its Mamba3
#: module calls it: tile_D 64, 4 warps) for the flagship (N=128, D=64, R=4, fp32 state, bf16
#: B/x/proj, z and outproj), compiled with nvidia-cutlass-dsl 4.8.1 and counted from its SASS,
#: counted for this project; upstream's code is not part of it
UPSTREAM = {
    "sm_90a": {"instructions_per_thread": 1947, "threads": 128, "warp_instructions_per_slab": 7788,
               "registers": 110},
    "sm_100a": {"warp_instructions_per_slab": 7268},
}


def slab_bytes(spec: StepSpec, batch: int = 256, heads: int = 48) -> float:
    """Bytes one step moves per (lane, head), all lanes live (weights amortised over the batch)."""
    return bytes_per_step(spec, batch, heads)["total"] / (batch * heads)


def issue_model(warp_instructions_per_slab: float, bytes_per_slab: float, gpu: GPU) -> dict:
    """``issue_us``, ``memory_us`` and ``ratio`` (issue / memory) per slab on one SM of ``gpu``."""
    issue = warp_instructions_per_slab / (ISSUE_PER_CLOCK * gpu.clock_hz)
    memory = bytes_per_slab / (gpu.hbm_bytes_per_s / gpu.sms)
    return {"issue_us": issue * 1e6, "memory_us": memory * 1e6, "ratio": issue / memory}


#: executed PTX warp-instructions per state slab of the flagship's stepwise step (pool mode, update_kv_state) in
#: each state form the latency model tabulates: ``form -> (the register kernel's, the asynchronous state copy's
#: (StepSpec.async_state_copy))``, measured by the PTX execution tier
#: (``mamba3_step.tools.verify.step.executed_facts``: B = 4, H = 2, every lane live; tests/tools/test_issue_model.py
#: re-executes them)
STATE_FORMS_EXECUTED = {"fp32": (6188, 6344), "bf16, round to nearest": (6844, 7148),
                        "bf16, stochastic rounding": (11300, 11512)}
#: the same for the slab pipeline (``StepSpec.pipeline_ctas``; measured alike, B = 4 and H = 2: one slab a CTA, so
#: its prologue counted with it): the register kernel's tokens, plus the stage's reads, the refill and the skewed
#: coefficient rows' addresses (Mamba3StepKernel.uv_layout)
PIPELINE_EXECUTED = {"fp32": 6860, "bf16, round to nearest": 7590, "bf16, stochastic rounding": 11879}
#: the same per CTA of the flagship's D split over ``split`` CTAs (update_kv_state with tile_D = 64 / split, a
#: cluster): ``form -> {split: warp-instructions of one of its CTAs}``; a CTA issues more than 1 / split of the
#: slab's (its index, staging and scalars are not divided)
SPLIT_EXECUTED = {"fp32": {2: 3684, 4: 2368}, "bf16, round to nearest": {2: 3952, 4: 2579},
                  "bf16, stochastic rounding": {2: 6308, 4: 3746}}
#: SASS warp-instructions each kernel issues for one live (lane, head) slab of the flagship (pool mode,
#: update_kv_state), read from its sm_90a cubin (``mamba3_step.tools.sass_trips.issued_path`` x warps; sm_100a is
#: within 0.4%): ``form -> {"registers": the register kernel, "async": StepSpec.async_state_copy, "pipeline": the
#: slab pipeline's slab loop, split: one CTA of the D split over split CTAs}``. What the SM's issue slots serve,
#: and so what the latency model's issue side counts; the executed PTX counts above over-state it where ptxas
#: fuses instructions (Philox's multiply pairs and XOR chains: 0.69x for a stochastically rounded bf16 state).
#: The pipeline's walk falls through the producer's branches, so it counts their few instructions in every
#: warp: an upper bound. tests/kernel/test_issued_sass.py compiles them.
ISSUED_SASS = {"fp32": {"registers": 5860, "async": 6032, "pipeline": 7196, 2: 3572, 4: 2500},
               "bf16, round to nearest": {"registers": 5984, "async": 6292, "pipeline": 6840, 2: 3616, 4: 2568},
               "bf16, stochastic rounding": {"registers": 7796, "async": 8236, "pipeline": 8940, 2: 4688, 4: 3196},
               # the fp32 flagship's T = 4 verify step (verify_spec: 8 warps), on each kernel
               "fp32 verify T = 4": {"registers": 24672, "pipeline": 23656}}
#: executed PTX warp-instructions per state slab of the flagship (pool mode, update_kv_state; one live
#: (lane, head)), stepwise and with replay: ``(F, from_checkpoint) -> (num_warps, counts at ring positions
#: 0..F-1)`` at the default tiling. Measured by the PTX execution tier (``python bench/issue_model.py``
#: prints them; tests/tools/test_issue_model.py re-executes F = 2 and 4 and holds these equal).
REPLAY_EXECUTED = {
    "stepwise": 6188,
    (2, False): (4, (6284, 9422)),
    (4, False): (4, (6306, 9378, 12482, 15634)),
    (8, False): (4, (6358, 9410, 12514, 15626, 18738, 21850, 24962, 28110)),
    (2, True): (4, (4605, 9546)),
    (4, True): (4, (4754, 5448, 6131, 15770)),
    (8, True): (4, (4866, 5561, 6282, 7003, 7724, 8444, 9127, 28206)),
}


#: executed PTX warp-instructions per state slab of the flagship's T = 4 verify step: ``"today"``, the
#: stepwise verify step (T tokens, (B, T) sources with num_accepted_tokens, a destination row per
#: token; its default 8 warps), and per F the replay verify kernel's at the committed-token counts
#: the steady state visits when every draft is accepted by the next step (F = 2 and 4: 4 every step,
#: a flush; F = 8: 4, then 8 with a flush). Measured by the PTX execution tier
#: (``mamba3_step.tools.verify.verify_instructions``; tests/tools/test_issue_model.py re-executes F = 2, 4 and today's).
VERIFY_EXECUTED = {"today": 25668, 2: {4: 33053}, 4: {4: 33069}, 8: {4: 32947, 8: 44901}}
#: the same with ``replay_from_checkpoint``: no draft stepped, their outputs by the algebra from the checkpoint
#: (a flush's, the committed tokens replayed; else the row's, the committed tokens in the sums; 2026-11-28)
VERIFY_FROM_STATE_EXECUTED = {2: {4: 25697}, 4: {4: 25830}, 8: {4: 16382, 8: 38361}}
VERIFY_TOKENS = 4


def verify_spec(**changes) -> StepSpec:
    """The flagship's stepwise verify step of :data:`VERIFY_TOKENS` drafts: (B, T) sources picked by
    ``num_accepted_tokens``, a destination row per token (``changes``: other fields, e.g. ``pipeline_ctas``)."""
    return flagship_spec(tokens=VERIFY_TOKENS, has_dst=True, dst_per_token=True, num_accepted=True, **changes)


def replay_verify_issue_model(flush_length: int, gpu: GPU, batch: int = 256, heads: int = 48,
                              from_checkpoint: bool = False) -> dict:
    """The flagship's T = 4 replay verify step against today's verify step on ``gpu``, every draft
    accepted, averaged over the steady state's steps: ``ratio`` (issue / memory time), ``time`` (the
    larger of the two, relative to today's), ``instructions`` (relative to today's) and
    ``today_ratio``, from :data:`VERIFY_EXECUTED` (with ``from_checkpoint``
    :data:`VERIFY_FROM_STATE_EXECUTED`) and :func:`mamba3_step.tools.bytes_model.replay_bytes`."""
    today = verify_spec()
    base = issue_model(VERIFY_EXECUTED["today"], slab_bytes(today, batch, heads), gpu)
    counts = (VERIFY_FROM_STATE_EXECUTED if from_checkpoint else VERIFY_EXECUTED)[flush_length]
    per_step = sum(counts.values()) / len(counts)
    replay = issue_model(per_step, replay_bytes(today, flush_length, batch, heads)["total"] / (batch * heads), gpu)
    return {"ratio": replay["ratio"], "time": max(replay["issue_us"], replay["memory_us"])
            / max(base["issue_us"], base["memory_us"]), "instructions": per_step / VERIFY_EXECUTED["today"],
            "today_ratio": base["ratio"]}


def replay_issue_model(flush_length: int, from_checkpoint: bool, gpu: GPU, batch: int = 256, heads: int = 48) -> dict:
    """The flagship's replay step against its stepwise step on ``gpu``, averaged over the F ring
    positions (requests at every position share the SMs): ``ratio`` (issue / memory time) and
    ``time`` (the larger of the two, relative to the stepwise step's), from
    :data:`REPLAY_EXECUTED` and :func:`mamba3_step.tools.bytes_model.replay_bytes`."""
    spec = flagship_spec()
    stepwise = issue_model(REPLAY_EXECUTED["stepwise"], slab_bytes(spec, batch, heads), gpu)
    counts = REPLAY_EXECUTED[(flush_length, from_checkpoint)][1]
    replay = issue_model(sum(counts) / flush_length, replay_bytes(spec, flush_length, batch, heads)["total"] / (batch * heads), gpu)
    base = max(stepwise["issue_us"], stepwise["memory_us"])
    return {"ratio": replay["ratio"], "time": max(replay["issue_us"], replay["memory_us"]) / base,
            "instructions": sum(counts) / flush_length / REPLAY_EXECUTED["stepwise"],
            "stepwise_ratio": stepwise["ratio"]}


#: executed PTX warp-instructions per slab of the flagship with Mamba-3's other per-request states,
#: stepwise and replayed (outputs replayed, or with ``"from_checkpoint"`` from the checkpoint, each at
#: its default tiling, sm_90a): ``name -> (the stepwise spec's changes to the flagship, F, the
#: stepwise count, counts at ring positions 0..F-1)``. ``"rotary"`` is the rotary flagship
#: (``flagship_rotary_spec``). Measured 2026-11-27 (from the checkpoint 2026-11-28) by the PTX
#: execution tier (``python bench/issue_model.py --replay-states`` prints them;
#: tests/tools/test_issue_model.py re-executes them with --full-matrix).
REPLAY_STATES_EXECUTED = {
    "rotary": ({"rotary": True}, 4, 6599, (6898, 10207, 13591, 17006)),
    "bf16 state, stochastic rounding": ({"state_dtype": "bfloat16", "stochastic_rounding": True}, 4, 11300,
                                        (11493, 19917, 28405, 36877)),
    "int8 state": ({"state_dtype": "int8", "stochastic_rounding": True}, 2, 14676, (15339, 27529)),
    "int8 state, F = 4": ({"state_dtype": "int8", "stochastic_rounding": True}, 4, 14676,
                          (15845, 27561, 39285, 51409)),
    "rotary, from the checkpoint": ({"rotary": True, "from_checkpoint": True}, 4, 6599, (5469, 6696, 7911, 17306)),
    "bf16 state, stochastic rounding, from the checkpoint": (
        {"state_dtype": "bfloat16", "stochastic_rounding": True, "from_checkpoint": True}, 4, 11300,
        (4870, 5564, 6247, 36885)),
    "int8 state, from the checkpoint": ({"state_dtype": "int8", "stochastic_rounding": True, "from_checkpoint": True},
                                        2, 14676, (5393, 27801)),
    "int8 state, F = 4, from the checkpoint": (
        {"state_dtype": "int8", "stochastic_rounding": True, "from_checkpoint": True}, 4, 14676,
        (5542, 6236, 6919, 51701)),
}


def replay_states_spec(name: str) -> tuple[StepSpec, int]:
    """``(the stepwise spec, F)`` of a :data:`REPLAY_STATES_EXECUTED` entry."""
    changes, flush_length = dict(REPLAY_STATES_EXECUTED[name][0]), REPLAY_STATES_EXECUTED[name][1]
    changes.pop("from_checkpoint", None)
    return (flagship_rotary_spec() if changes.pop("rotary", False) else flagship_spec(**changes)), flush_length


def replay_states_replay_spec(name: str) -> StepSpec:
    """The replay spec of a :data:`REPLAY_STATES_EXECUTED` entry, at its default tiling."""
    spec, flush_length = replay_states_spec(name)
    fc = REPLAY_STATES_EXECUTED[name][0].get("from_checkpoint", False)
    return spec.replace(replay_ring=flush_length, replay_from_checkpoint=fc).with_default_tiling()


def replay_states_issue_model(name: str, gpu: GPU, batch: int = 256, heads: int = 48) -> dict:
    """A :data:`REPLAY_STATES_EXECUTED` entry's replay step against its stepwise step on ``gpu``,
    averaged over the ring positions: ``bytes`` and ``instructions`` (relative to the stepwise
    step's), ``ratio`` and ``stepwise_ratio`` (issue / memory time), ``time`` (the larger of the
    two, relative to the stepwise step's). The bytes are :func:`~mamba3_step.tools.bytes_model.replay_bytes`'
    for the state dtype; it leaves out the angle rows, an 8-bit state's scales and the ring's
    angles and offsets (under 2% of a row's bytes for the fp32 flagship, under 4% for int8)."""
    spec, flush_length = replay_states_spec(name)
    stepwise_count, counts = REPLAY_STATES_EXECUTED[name][2], REPLAY_STATES_EXECUTED[name][3]
    step_bytes = slab_bytes(spec, batch, heads)
    replayed_bytes = replay_bytes(spec, flush_length, batch, heads)["total"] / (batch * heads)
    stepwise = issue_model(stepwise_count, step_bytes, gpu)
    replay = issue_model(sum(counts) / flush_length, replayed_bytes, gpu)
    return {"bytes": replayed_bytes / step_bytes, "instructions": sum(counts) / flush_length / stepwise_count,
            "ratio": replay["ratio"], "stepwise_ratio": stepwise["ratio"],
            "time": max(replay["issue_us"], replay["memory_us"]) / max(stepwise["issue_us"], stepwise["memory_us"])}
