"""The model benchmark's replay tables (``bench/model_bench.py``): the flagship's bytes per plain and
per T = 4 verify step with replay at K = 2, 4, 8 (``mamba3_step.tools.bytes_model.replay_bytes``), and the issue
model of the replay kernel's plain and verify steps (``mamba3_step.tools.issue_model``), with a
``bench/gpu_bench.py`` result's measured times beside it when one is given (``gpu_results``)."""

from __future__ import annotations

import _util
import gpu_results

from mamba3_step.tools.bytes_model import HBM_BANDWIDTH, bytes_per_step, replay_bytes
from mamba3_step.tools.issue_model import GPUS as ISSUE_GPUS
from mamba3_step.tools.issue_model import (REPLAY_EXECUTED, VERIFY_EXECUTED, VERIFY_FROM_STATE_EXECUTED, VERIFY_TOKENS, replay_issue_model, replay_verify_issue_model)
from mamba3_step.spec import FLAGSHIP_HEADS, flagship_spec

REPLAY_BATCHES = (1, 64, 256)
REPLAY_K = (2, 4, 8)
REPLAY_NOTE = ("replay (docs/design/replay.md): bytes averaged over ring positions; a verify step pays the "
               "flushes its accepted tokens cause (all T accepted: min(1, T/K) of a state write). The time "
               "ratio is the bytes ratio while the step stays memory-bound: the issue table below says where it does")
REPLAY_ISSUE_NOTE = ("issue model of the replay kernel (plain decode, B = 256): executed PTX warp-instructions per "
                     "slab at each ring position (mamba3_step.tools.issue_model.REPLAY_EXECUTED, from the PTX tier) "
                     "averaged over positions, against the bytes above; time = the larger of issue and memory "
                     "time, relative to the stepwise step's. A model; 'measured x' (with --measured) is not: suite "
                     "replay's graph-replay time over the stepwise step's in a bench/gpu_bench.py result")


def replay_issue_rows(batch: int = 256, heads: int = FLAGSHIP_HEADS, measured: dict | None = None) -> list[dict]:
    """Per K and output mode: executed instructions relative to the stepwise step, and per GPU the
    issue/memory ratio and the modelled time relative to the stepwise step
    (``mamba3_step.tools.issue_model.replay_issue_model``); ``measured_x`` from ``measured``
    (``{(K, from_checkpoint): time ratio}``, ``gpu_results.replay_times``) where it holds the row."""
    measured = measured or {}
    rows = []
    for from_checkpoint in (False, True):
        for K in REPLAY_K:
            _, counts = REPLAY_EXECUTED[(K, from_checkpoint)]
            row = {"K": K, "outputs": "from checkpoint" if from_checkpoint else "replayed (exact)",
                   "per_position": list(counts)}
            for name, gpu in ISSUE_GPUS.items():
                m = replay_issue_model(K, from_checkpoint, gpu, batch, heads)
                row.update({"instructions": m["instructions"], f"ratio_{name}": m["ratio"], f"time_{name}": m["time"],
                            f"stepwise_ratio_{name}": m["stepwise_ratio"]})
            if (K, from_checkpoint) in measured:
                row["measured_x"] = measured[(K, from_checkpoint)]
            rows.append(row)
    return rows


#: the measured column of the replay tables (present when a row has it)
MEASURED_COLUMN = ("measured_x", "measured x", ">.3f")
REPLAY_ISSUE_COLUMNS = [("K", "K", ">d"), ("outputs", "append outputs", "<"), ("instructions", "instr. x", ">.2f")] + [
    col for g in ("H100", "H200", "B200") for col in ((f"ratio_{g}", f"{g} issue/mem", ">.2f"),
                                                      (f"time_{g}", f"{g} time x", ">.3f"))] + [MEASURED_COLUMN]


REPLAY_VERIFY_NOTE = ("issue model of the replay kernel's T = 4 verify steps (B = 256), every draft accepted by "
                      "the next step, against today's verify step (a destination row per draft): executed PTX "
                      "warp-instructions per slab at the committed-token counts the steady state visits "
                      "(mamba3_step.tools.issue_model.VERIFY_EXECUTED, from the PTX tier; 'from the checkpoint': the "
                      "drafts' outputs by the algebra, VERIFY_FROM_STATE_EXECUTED), the bytes model's verify bytes; "
                      "time = the larger of issue and memory time, relative to today's. A model; 'measured x' (with "
                      "--measured) is not: suite replay-verify's graph-replay time over today's verify step's in a "
                      "bench/gpu_bench.py result")


def replay_verify_rows(batch: int = 256, heads: int = FLAGSHIP_HEADS, measured: dict | None = None) -> list[dict]:
    """Per K of :data:`VERIFY_EXECUTED` and of :data:`VERIFY_FROM_STATE_EXECUTED` (the drafts' outputs
    from the checkpoint): instructions relative to today's verify step, and per GPU the issue/memory
    ratio and the modelled time relative to today's (``replay_verify_issue_model``); ``measured_x`` from
    ``measured`` (``{(K, from_checkpoint): time ratio}``, ``gpu_results.verify_times``) where it holds the row."""
    measured = measured or {}
    rows = []
    for fc, table in ((False, VERIFY_EXECUTED), (True, VERIFY_FROM_STATE_EXECUTED)):
        for K in (k for k in table if k != "today"):
            row = {"K": K, "tokens": VERIFY_TOKENS, "outputs": "from the checkpoint" if fc else "replayed",
                   "per_step": list(table[K].values())}
            for name, gpu in ISSUE_GPUS.items():
                m = replay_verify_issue_model(K, gpu, batch, heads, from_checkpoint=fc)
                row.update({"instructions": m["instructions"], f"ratio_{name}": m["ratio"], f"time_{name}": m["time"],
                            f"today_ratio_{name}": m["today_ratio"]})
            if (K, fc) in measured:
                row["measured_x"] = measured[(K, fc)]
            rows.append(row)
    return rows


REPLAY_VERIFY_COLUMNS = [("K", "K", ">d"), ("tokens", "T", ">d"), ("outputs", "draft outputs", "<"),
                         ("instructions", "instr. x", ">.2f")] + [
    col for g in ("H100", "H200", "B200") for col in ((f"ratio_{g}", f"{g} issue/mem", ">.2f"),
                                                      (f"time_{g}", f"{g} time x", ">.3f"))] + [MEASURED_COLUMN]


def measured_ratios(payload: dict | None, batch: int = 256) -> tuple[dict, dict]:
    """``(replay, verify)``: ``{(K, from_checkpoint): time ratio}`` of suites replay and replay-verify in a
    bench/gpu_bench.py result (``gpu_results.load``), both empty without one."""
    if payload is None:
        return {}, {}
    verify = {(K, fc): x for fc in (False, True) for K, x in gpu_results.verify_times(payload, batch, fc).items()}
    return gpu_results.replay_times(payload, batch), verify


def _present(columns: list, rows: list[dict]) -> list:
    """``columns`` less the measured column when no row has it."""
    return [c for c in columns if c is not MEASURED_COLUMN or any(c[0] in r for r in rows)]


def replay_rows(batches=REPLAY_BATCHES, heads: int = FLAGSHIP_HEADS) -> list[dict]:
    """The flagship's bytes per plain step and per T = 4 verify step (a destination row per token),
    stepwise and with replay at each K of :data:`REPLAY_K` (``bytes_model.replay_bytes``)."""
    plain = flagship_spec()
    verify = flagship_spec(tokens=4, has_dst=True, dst_per_token=True, num_accepted=True)
    rows = []
    for batch in batches:
        for kind, spec in (("plain", plain), ("verify T=4", verify)):
            base = bytes_per_step(spec, batch, heads)["total"]
            row = {"batch": batch, "heads": heads, "step": kind, "bytes_stepwise": base, "mib_stepwise": base / 2**20,
                   "us_stepwise_H100": base / HBM_BANDWIDTH["H100"] * 1e6}
            for K in REPLAY_K:
                b = replay_bytes(spec, K, batch, heads)["total"]
                row.update({f"bytes_K{K}": b, f"mib_K{K}": b / 2**20, f"ratio_K{K}": b / base,
                            f"us_K{K}_H100": b / HBM_BANDWIDTH["H100"] * 1e6})
            rows.append(row)
    return rows


REPLAY_COLUMNS = [("batch", "B", ">d"), ("step", "step", "<"), ("mib_stepwise", "stepwise MiB", ">.1f")] + [
    col for K in REPLAY_K for col in ((f"mib_K{K}", f"K={K} MiB", ">.1f"), (f"ratio_K{K}", f"K={K} x", ">.3f"))
] + [("us_stepwise_H100", "H100 stepwise us", ">.1f"), ("us_K4_H100", "H100 K=4 us", ">.1f")]


def replay_tables(heads: int, measured: dict | None) -> dict:
    """Print the replay tables (bytes, the issue model of the plain and the verify step, with the times of
    ``measured``, a bench/gpu_bench.py result, beside them); their rows and notes."""
    replay = replay_rows(heads=heads)
    print(f"replay, flagship, H={heads}: stepwise vs a checkpoint and a ring of K - 1 tokens; modelled "
          "(bytes / peak HBM bandwidth)")
    print(_util.format_table(replay, REPLAY_COLUMNS))
    print(f"  - {REPLAY_NOTE}")
    measured_replay, measured_verify = measured_ratios(measured)
    issue = replay_issue_rows(heads=heads, measured=measured_replay)
    print(f"\nreplay kernel, flagship, H={heads}, B=256: instructions and time against the stepwise step")
    print(_util.format_table(issue, _present(REPLAY_ISSUE_COLUMNS, issue)))
    print(f"  - {REPLAY_ISSUE_NOTE}")
    verify = replay_verify_rows(heads=heads, measured=measured_verify)
    print(f"\nreplay kernel, verify steps, flagship, H={heads}, B=256: instructions and time against today's "
          "verify step")
    print(_util.format_table(verify, _present(REPLAY_VERIFY_COLUMNS, verify)))
    print(f"  - {REPLAY_VERIFY_NOTE}")
    source = None if measured is None else gpu_results.describe(measured)
    if source:
        print(f"  - measured x: {source}")
    return {"rows": replay, "note": REPLAY_NOTE, "issue": issue, "issue_note": REPLAY_ISSUE_NOTE,
            "verify_issue": verify, "verify_issue_note": REPLAY_VERIFY_NOTE, "measured_on": source}
