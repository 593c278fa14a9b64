"""Model benchmark (runs anywhere, no GPU): bytes one decode step moves and the time that
costs at HBM bandwidth, for pool mode, gather -> dense -> scatter and dense mode; for
speculative decoding, one T-token step against T one-token steps; and for the rotary angle,
the fused step against upstream's pipeline (a rotary launch, the step, state copies, with
pools a gather and a scatter).

    python bench/model_bench.py [--out DIR] [--heads 48] [--no-plot]

Prints a table per configuration, the T-token table and the rotary tables (totals, per stage,
the model's assumptions), writes ``model_bench.json`` and
``model_bench.png`` to ``bench/results/`` (or ``--out``). Every number here is *modelled* (``mamba3_step.tools.bytes_model``:
compulsory bytes / peak HBM bandwidth), not measured; ``bench/gpu_bench.py`` measures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402  (also puts the repository on sys.path)

from mamba3_step.tools.bytes_model import (HBM_BANDWIDTH, MODES, bytes_per_step, replay_bytes, token_saving, upstream_pipeline_bytes)
from mamba3_step.spec import FLAGSHIP_HEADS, flagship_rotary_spec, flagship_spec  # noqa: E402
from mamba3_step.tools.issue_model import GPUS as ISSUE_GPUS  # noqa: E402
from mamba3_step.tools.issue_model import (REPLAY_EXECUTED, VERIFY_EXECUTED, VERIFY_FROM_STATE_EXECUTED, VERIFY_TOKENS, replay_issue_model, replay_verify_issue_model)

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
GPUS = tuple(HBM_BANDWIDTH)  # H100, H200, GH200


def configurations() -> dict:
    """name -> StepSpec; the flagship first (pool mode with update_kv_state, as a server runs it)."""
    return {
        "flagship (N=128 D=64 R=4, fp32 state)": flagship_spec(),
        "bf16 state (N=128 D=64 R=4)": flagship_spec(state_dtype="bfloat16"),
        "N=64 D=64 R=2, fp32 state": flagship_spec(dstate=64, mimo=2),
        "flagship without update_kv_state": flagship_spec(update_kv_state=False),
    }


def model_rows(configs: dict | None = None, batches=BATCHES, heads: int = FLAGSHIP_HEADS) -> list[dict]:
    """One row per (configuration, batch): bytes per mode, predicted microseconds per mode and
    GPU, and the predicted speed-up of pool mode over gather -> dense -> scatter."""
    configs = configurations() if configs is None else configs
    rows = []
    for name, spec in configs.items():
        for batch in batches:
            row = {"config": name, "batch": batch, "heads": heads}
            for mode in MODES:
                b = bytes_per_step(spec, batch, heads, mode=mode)
                row[f"bytes_{mode}"] = b["total"]
                row[f"breakdown_{mode}"] = b
                for gpu in GPUS:
                    row[f"us_{mode}_{gpu}"] = b["total"] / HBM_BANDWIDTH[gpu] * 1e6
            row["speedup_pool_vs_gather_scatter"] = row["bytes_gather_scatter"] / row["bytes_pool"]
            rows.append(row)
    return rows


TOKENS = (1, 2, 3, 4, 6, 8)
TOKEN_BATCHES = (1, 64, 256)


def token_rows(batches=TOKEN_BATCHES, tokens=TOKENS, heads: int = FLAGSHIP_HEADS) -> list[dict]:
    """The flagship's speculative verify step (T tokens, (B, K) sources, a row per token, update_kv_state)
    against T one-token steps: bytes and predicted microseconds on each GPU."""
    rows = []
    for batch in batches:
        for T in tokens:
            spec = flagship_spec(tokens=T, has_dst=True, dst_per_token=T > 1, num_accepted=True)
            s = token_saving(spec, batch, heads)
            row = {"batch": batch, "tokens": T, "heads": heads, "mib_t_token": s["t_token_bytes"] / 2**20,
                   "mib_one_token_steps": s["one_token_steps_bytes"] / 2**20, "saving": s["ratio"]}
            for gpu in GPUS:
                row[f"us_t_token_{gpu}"] = s["t_token_bytes"] / HBM_BANDWIDTH[gpu] * 1e6
                row[f"us_one_token_steps_{gpu}"] = s["one_token_steps_bytes"] / HBM_BANDWIDTH[gpu] * 1e6
            rows.append(row)
    return rows


ROTARY_BATCHES = (1, 64, 256)
#: the stages of one layer's rotary decode, in launch order
STAGES = ("gather", "rotary", "step", "copies", "scatter", "indices")
_ROTARY_KEYS = ("angle_state", "angle_proj", "B_bias", "C_bias")
_INDEX_KEYS = ("state_batch_indices", "dst_state_batch_indices", "num_accepted_tokens")
_PREFIX_STAGE = {"gather": "gather", "rotary": "rotary", "step": "step", "copy": "copies", "scatter": "scatter"}

ROTARY_NOTES = (
    "modelled, not measured: compulsory DRAM bytes / peak HBM bandwidth; launches are counted, not timed",
    "fused: this package's pool step (flagship_rotary_spec: S=32 angles, MIMO pairs, B/C biases, B/C shared by "
    "the heads = upstream's num_bc_heads 1), update_kv_state; the angle int64 (8 B), read and written in place; "
    "angle_proj (B, H, S) fp32 per head",
    "a B/C row shared by the heads is counted once per lane (both pipelines): the first of a lane's H CTAs "
    "brings it into L2, the others hit (the CTAs together load H x: bytes_model.bc_load_bytes)",
    "upstream: Mamba3.step at state-spaces/mamba e9594ce: apply_rotary_qk_inference_fwd(inplace=False) reads "
    "B/C (stride-0 expand over the heads), both fp32 biases, the fp32 angle, angle_proj ((B, S) bf16 = the "
    "in_proj output's dtype, expanded over the heads) and dt; writes B~, C~ as full (B, R, H, N) tensors in the "
    "input dtype (bf16) and a new fp32 angle, unreduced",
    "upstream: the biases are rearranged h r n -> r h n and made contiguous inside the rotary wrapper: a copy "
    "of each per call (read + write), counted in the rotary stage",
    "upstream: mamba3_step_fn reads ssm_state, k_state, v_state and updates ssm_state in place (no kv update); "
    "then angle_state.copy_(new angle), k_state.copy_(B~), v_state.copy_(x): the three copies, read + write",
    "upstream with pools: the four state rows (state fp32, k and v bf16, angle fp32) gathered into dense batch "
    "tensors and scattered back, a read + write each, an index vector read per gather/scatter; "
    "'upstream dense' is upstream's own per-batch cache (no pool, no gather/scatter)",
)


def _stages(breakdown: dict, fused: bool) -> dict:
    """Bytes per stage (:data:`STAGES`) of a fused-step or an upstream breakdown."""
    out = dict.fromkeys(STAGES, 0)
    for key, v in breakdown.items():
        if key == "total":
            continue
        if fused:
            stage = "rotary" if key in _ROTARY_KEYS else "indices" if key in _INDEX_KEYS else "step"
        else:
            stage = "indices" if key == "gather/scatter indices" else _PREFIX_STAGE[key.split(":")[0]]
        out[stage] += v
    return out


def upstream_launches(spec, heads: int, pools: bool) -> int:
    """Kernel launches of upstream's rotary decode: 4 gathers and 4 scatters with pools, 2 bias
    copies (R > 1, H > 1), the rotary launch, the step, 3 state copies."""
    return (8 if pools else 0) + (2 if spec.mimo > 1 and heads > 1 else 0) + 1 + 1 + 3


def rotary_rows(batches=ROTARY_BATCHES, heads: int = FLAGSHIP_HEADS) -> list[dict]:
    """Per batch: bytes of the fused pool step, of upstream's pipeline with pools and without,
    per stage and per tensor, predicted microseconds per GPU, launches."""
    spec = flagship_rotary_spec()
    rows = []
    for batch in batches:
        fused = bytes_per_step(spec, batch, heads, mode="pool")
        ups = upstream_pipeline_bytes(spec, batch, heads, pools=True)
        dense = upstream_pipeline_bytes(spec, batch, heads, pools=False)
        row = {"batch": batch, "heads": heads, "bytes_fused": fused["total"], "bytes_upstream_pools": ups["total"],
               "bytes_upstream_dense": dense["total"], "ratio_pools": ups["total"] / fused["total"],
               "ratio_dense": dense["total"] / fused["total"], "launches_fused": 1,
               "launches_upstream_pools": upstream_launches(spec, heads, True),
               "launches_upstream_dense": upstream_launches(spec, heads, False),
               "stages_fused": _stages(fused, True), "stages_upstream_pools": _stages(ups, False),
               "breakdown_fused": fused, "breakdown_upstream_pools": ups}
        for what in ("fused", "upstream_pools", "upstream_dense"):
            row[f"mib_{what}"] = row[f"bytes_{what}"] / 2**20
            for gpu in GPUS:
                row[f"us_{what}_{gpu}"] = row[f"bytes_{what}"] / HBM_BANDWIDTH[gpu] * 1e6
        rows.append(row)
    return rows


ROTARY_COLUMNS = [("batch", "B", ">d"), ("mib_fused", "fused MiB", ">.2f"),
                  ("mib_upstream_pools", "upstream+pools MiB", ">.2f"),
                  ("mib_upstream_dense", "upstream dense MiB", ">.2f"),
                  ("ratio_pools", "upstream+pools/fused", ">.2f"), ("ratio_dense", "upstream dense/fused", ">.2f"),
                  ("us_fused_H100", "H100 fused us", ">.1f"), ("us_upstream_pools_H100", "H100 upstream+pools us", ">.1f"),
                  ("launches_upstream_pools", "launches (fused: 1)", ">d")]


def format_rotary(rows: list[dict]) -> str:
    """The totals table, the per-stage table (MiB, fused beside upstream with pools, per batch) and
    the model's assumptions."""
    heads = rows[0]["heads"]
    out = [f"rotary decode step, flagship rotary (S=32, MIMO pairs, biases, num_bc_heads=1), H={heads}: "
           "fused pool step vs upstream's pipeline; modelled (bytes / peak HBM bandwidth)",
           _util.format_table(rows, ROTARY_COLUMNS), ""]
    stage_rows = [{"stage": st} for st in STAGES + ("total",)]
    cols = [("stage", "stage", "<")]
    for r in rows:
        for what, label in (("fused", "fused"), ("upstream_pools", "upstream")):
            key = f"{what}_{r['batch']}"
            cols.append((key, f"B={r['batch']} {label} MiB", ">.3f"))
            for sr in stage_rows:
                st = sr["stage"]
                n = r[f"bytes_{what}"] if st == "total" else r[f"stages_{what}"][st]
                sr[key] = n / 2**20
    out += ["per stage (upstream with pools)", _util.format_table(stage_rows, cols), "", "assumptions:"]
    out += [f"  - {note}" for note in ROTARY_NOTES]
    return "\n".join(out)


TOKEN_COLUMNS = [("batch", "B", ">d"), ("tokens", "T", ">d"), ("mib_t_token", "T-token MiB", ">.1f"),
                 ("mib_one_token_steps", "T x 1-token MiB", ">.1f")] + [
    (f"us_{k}_H100", f"H100 {label} us", ">.1f") for k, label in (("t_token", "T-token"),
                                                                   ("one_token_steps", "T x 1-token"))
] + [("saving", "saving", ">.2f")]


TABLE_COLUMNS = [
    ("batch", "B", ">d"),
    ("mib_pool", "pool MiB", ">.1f"),
    ("mib_gather_scatter", "g/s MiB", ">.1f"),
    ("mib_dense", "dense MiB", ">.1f"),
] + [
    (f"us_{mode}_{gpu}", f"{gpu} {label} us", ">.1f")
    for gpu in GPUS
    for mode, label in (("pool", "pool"), ("gather_scatter", "g/s"))
] + [("speedup_pool_vs_gather_scatter", "speed-up", ">.2f")]


def format_tables(rows: list[dict]) -> str:
    out = []
    for name in dict.fromkeys(r["config"] for r in rows):
        sub = []
        for r in rows:
            if r["config"] != name:
                continue
            t = dict(r)
            for mode in MODES:
                t[f"mib_{mode}"] = r[f"bytes_{mode}"] / 2**20
            sub.append(t)
        out.append(f"{name}, H={sub[0]['heads']}: modelled (compulsory bytes / peak HBM bandwidth); "
                   "g/s = gather -> dense -> scatter; dense-mode times are in the JSON")
        out.append(_util.format_table(sub, TABLE_COLUMNS))
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path) -> bool:
    """Two panels: the flagship's predicted step time per mode (H100 solid, GH200 dashed), and
    the predicted speed-up per configuration. False when matplotlib is missing."""
    plt = _util.pyplot()
    if plt is None:
        return False
    names = list(dict.fromkeys(r["config"] for r in rows))
    flag = [r for r in rows if r["config"] == names[0]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    colors = _util.MODE_COLORS
    labels = {"pool": "pool mode", "gather_scatter": "gather -> dense -> scatter", "dense": "dense mode"}
    xs = [r["batch"] for r in flag]
    # pool and dense mode move almost the same bytes: pool is drawn wide, dense thin on top
    width = {"pool": 4.0, "gather_scatter": 1.6, "dense": 1.0}
    marker = {"pool": None, "gather_scatter": "o", "dense": "x"}
    for mode in ("gather_scatter", "pool", "dense"):
        for gpu, style in (("H100", "-"), ("GH200", "--")):
            ax1.plot(xs, [r[f"us_{mode}_{gpu}"] for r in flag], style, marker=marker[mode], ms=4,
                     lw=width[mode], alpha=0.45 if mode == "pool" else 1.0,
                     color=colors[mode], label=f"{labels[mode]}, {gpu}")
    ax1.set_yscale("log")
    ax1.set_ylabel("predicted step time (us, one layer)")
    ax1.set_title(f"{names[0]}, H={flag[0]['heads']}\nmodelled: bytes / peak HBM bandwidth "
                  "(pool and dense nearly coincide)", fontsize=10)
    ax1.legend(fontsize=8)
    markers = ["o", "s", "^", "v", "D", "P"]
    styles = ["-", "--", ":", "-."]
    for i, name in enumerate(names):
        sub = [r for r in rows if r["config"] == name]
        ax2.plot([r["batch"] for r in sub], [r["speedup_pool_vs_gather_scatter"] for r in sub],
                 styles[i % len(styles)], marker=markers[i % len(markers)], ms=5, label=name)
    ax2.set_ylim(1.0, 3.2)
    ax2.set_ylabel("predicted speed-up (bytes ratio)")
    ax2.set_title("pool mode over gather -> dense -> scatter\n(modelled; same on every GPU)", fontsize=10)
    ax2.legend(fontsize=8, loc="lower right")
    _util.save_batch_plot(plt, fig, (ax1, ax2), xs, path)
    return True


REPLAY_BATCHES = (1, 64, 256)
REPLAY_K = (2, 4, 8)
REPLAY_NOTE = ("replay (docs/design.md, 'Replay'): bytes averaged over ring positions; a verify step pays the flushes its accepted tokens cause (all T accepted: min(1, T/K) of a "
               "state write). The time ratio is the bytes ratio while the step stays memory-bound: the issue "
               "table below says where it does")
REPLAY_ISSUE_NOTE = ("issue model of the replay kernel (plain decode, B = 256): executed PTX warp-instructions per "
                     "slab at each ring position (mamba3_step.tools.issue_model.REPLAY_EXECUTED, from the PTX tier) "
                     "averaged over positions, against the bytes above; time = the larger of issue and memory "
                     "time, relative to the stepwise step's. A model; 'H200 run N x' is not: the replay kernel's "
                     "graph-replay time over the stepwise step's on one H200 (2026-11-27; docs/measured/). Run 1 "
                     "(2026-11-27-h200) before packed state rows: 8 resident warps per SM against the stepwise "
                     "step's 12, and the model's full-bandwidth assumption failed; run 2 (2026-11-27-h200-run2, "
                     "K = 2 and 4 only) after them: K = 2 at the stepwise residency; runs 1 and 2 timed the "
                     "from-checkpoint step at its former 8-warp default, run 4 (2026-11-27-h200-run4, K = 2 and 4) at "
                     "today's 4 (docs/performance.md 3d)")
#: the GPU replay benchmark's JSON of each H200 run that the replay issue table sets beside the model
MEASURED_REPLAY_RUNS = {
    1: _util.REPO / "docs" / "measured" / "2026-11-27-h200" / "gpu_replay_bench.json",
    2: _util.REPO / "docs" / "measured" / "2026-11-27-h200-run2" / "gpu_replay_bench.json",
    4: _util.REPO / "docs" / "measured" / "2026-11-27-h200-run4" / "checkpoint_warps.json",
}
#: per run, where today's default tiling is a row with a ``num_warps`` (``--checkpoint-warps``) rather than
#: the run's default rows, by from_checkpoint: run 4 timed the from-checkpoint step at 4 warps, today's
#: default, beside the 8 warps then its default
MEASURED_REPLAY_TILING = {4: {True: 4}}
MEASURED_REPLAY = MEASURED_REPLAY_RUNS[1]
#: the GPU verify benchmarks' JSON that the verify issue table sets beside the model, by H200 run
#: (run 2 timed K = 4 and 8, run 3 K = 2, run 4 K = 2 and 4 side by side; each against today's verify step
#: on its own machine). A K timed by several runs shows the latest.
MEASURED_VERIFY_RUNS = {
    2: _util.REPO / "docs" / "measured" / "2026-11-27-h200-run2" / "gpu_replay_verify_bench.json",
    3: _util.REPO / "docs" / "measured" / "2026-11-27-h200-run3" / "gpu_replay_verify_bench.json",
    4: _util.REPO / "docs" / "measured" / "2026-11-27-h200-run4" / "gpu_replay_verify_bench.json",
}
MEASURED_VERIFY = MEASURED_VERIFY_RUNS[2]


def measured_replay_times(path=MEASURED_REPLAY, batch: int = 256, tiling: dict | None = None) -> dict:
    """``{(K, from_checkpoint): replay graph time / stepwise graph time}`` at ``batch`` from a
    ``gpu_replay_bench.py`` JSON: the rows of the run's default tilings (no ``num_warps``), or for an
    output form in ``tiling`` (``{from_checkpoint: num_warps}``) the rows at those warps; empty when the
    file is absent."""
    rows = _graph_rows(path, batch)
    if not rows:
        return {}
    tiling = tiling or {}
    base = next(r["us_graph"] for r in rows if r["step"] == "stepwise")
    return {(r["K"], r["outputs"] == "from checkpoint"): r["us_graph"] / base for r in rows
            if r["K"] is not None and r.get("num_warps") == tiling.get(r["outputs"] == "from checkpoint")}


def measured_verify_times(path=MEASURED_VERIFY, batch: int = 256, from_checkpoint: bool = False) -> dict:
    """``{K: replay verify graph time / today's verify graph time}`` at ``batch`` from a
    ``gpu_replay_verify_bench.py`` JSON, for the drafts' output form ``from_checkpoint`` (rows from
    before that option are replayed ones); empty when the file is absent."""
    rows = _graph_rows(path, batch)
    base = next((r["us_graph"] for r in rows if r["K"] is None), None)
    return {} if base is None else {r["K"]: r["us_graph"] / base for r in rows
                                    if r["K"] is not None and r.get("from_checkpoint", False) == from_checkpoint}


def _graph_rows(path, batch: int) -> list[dict]:
    """A GPU benchmark JSON's rows at ``batch`` that carry a graph time; [] when the file is absent."""
    try:
        return [r for r in json.loads(Path(path).read_text())["rows"] if r["batch"] == batch and "us_graph" in r]
    except FileNotFoundError:
        return []


def replay_issue_rows(batch: int = 256, heads: int = FLAGSHIP_HEADS) -> list[dict]:
    """Per K and output mode: executed instructions relative to the stepwise step, and per GPU the
    issue/memory ratio and the modelled time relative to the stepwise step
    (``mamba3_step.tools.issue_model.replay_issue_model``)."""
    rows = []
    measured = {run: measured_replay_times(path, batch, MEASURED_REPLAY_TILING.get(run))
                for run, path in MEASURED_REPLAY_RUNS.items()}
    for from_checkpoint in (False, True):
        for K in REPLAY_K:
            _, counts = REPLAY_EXECUTED[(K, from_checkpoint)]
            row = {"K": K, "outputs": "from checkpoint" if from_checkpoint else "replayed (exact)",
                   "per_position": list(counts)}
            for name, gpu in ISSUE_GPUS.items():
                m = replay_issue_model(K, from_checkpoint, gpu, batch, heads)
                row.update({"instructions": m["instructions"], f"ratio_{name}": m["ratio"], f"time_{name}": m["time"],
                            f"stepwise_ratio_{name}": m["stepwise_ratio"]})
            for run, times in measured.items():
                if (K, from_checkpoint) in times:
                    row[f"measured_H200_run{run}"] = times[(K, from_checkpoint)]
            rows.append(row)
    return rows


REPLAY_ISSUE_COLUMNS = [("K", "K", ">d"), ("outputs", "append outputs", "<"), ("instructions", "instr. x", ">.2f")] + [
    col for g in ("H100", "H200", "B200") for col in ((f"ratio_{g}", f"{g} issue/mem", ">.2f"),
                                                      (f"time_{g}", f"{g} time x", ">.3f"))] + [
    (f"measured_H200_run{run}", f"H200 run {run} x", ">.3f") for run in MEASURED_REPLAY_RUNS]


REPLAY_VERIFY_NOTE = ("issue model of the replay kernel's T = 4 verify steps (B = 256), every draft accepted by "
                      "the next step, against today's verify step (a destination row per draft): executed PTX "
                      "warp-instructions per slab at the committed-token counts the steady state visits "
                      "(mamba3_step.tools.issue_model.VERIFY_EXECUTED, from the PTX tier; 'from the checkpoint': the "
                      "drafts' outputs by the algebra, VERIFY_FROM_STATE_EXECUTED), the bytes model's verify bytes; "
                      "time = the larger of issue and memory time, relative to today's. A model; 'H200 measured x' is "
                      "not: bench/gpu_replay_verify_bench.py's graph-replay time over today's on an H200, "
                      "both timed in the same run ('run': docs/measured/2026-11-27-h200-run<run>/)")


def replay_verify_rows(batch: int = 256, heads: int = FLAGSHIP_HEADS) -> list[dict]:
    """Per K of :data:`VERIFY_EXECUTED` and of :data:`VERIFY_FROM_STATE_EXECUTED` (the drafts' outputs
    from the checkpoint): instructions relative to today's verify step, and per GPU the issue/memory
    ratio and the modelled time relative to today's (``replay_verify_issue_model``)."""
    rows = []
    measured = {(K, fc): (run, x) for run, path in MEASURED_VERIFY_RUNS.items() for fc in (False, True)
                for K, x in measured_verify_times(path, batch, fc).items()}
    for fc, table in ((False, VERIFY_EXECUTED), (True, VERIFY_FROM_STATE_EXECUTED)):
        for K in (k for k in table if k != "today"):
            row = {"K": K, "tokens": VERIFY_TOKENS, "outputs": "from the checkpoint" if fc else "replayed",
                   "per_step": list(table[K].values())}
            for name, gpu in ISSUE_GPUS.items():
                m = replay_verify_issue_model(K, gpu, batch, heads, from_checkpoint=fc)
                row.update({"instructions": m["instructions"], f"ratio_{name}": m["ratio"], f"time_{name}": m["time"],
                            f"today_ratio_{name}": m["today_ratio"]})
            if (K, fc) in measured:
                row["measured_run"], row["measured_time_H200"] = measured[(K, fc)]
            rows.append(row)
    return rows


REPLAY_VERIFY_COLUMNS = [("K", "K", ">d"), ("tokens", "T", ">d"), ("outputs", "draft outputs", "<"),
                         ("instructions", "instr. x", ">.2f")] + [
    col for g in ("H100", "H200", "B200") for col in ((f"ratio_{g}", f"{g} issue/mem", ">.2f"),
                                                      (f"time_{g}", f"{g} time x", ">.3f"))] + [
    ("measured_time_H200", "H200 measured x", ">.3f"), ("measured_run", "run", ">d")]


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output folder (default bench/results)")
    p.add_argument("--heads", type=int, default=FLAGSHIP_HEADS, help="H (default 48)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    if args.heads < 1:
        p.error(f"--heads must be >= 1, got {args.heads}")
    rows = model_rows(heads=args.heads)
    print(format_tables(rows))
    tokens = token_rows(heads=args.heads)
    print(f"speculative verify step, flagship, H={args.heads}: one T-token step ((B, K) sources, a row per token, "
          "update_kv_state) vs T one-token steps; modelled (bytes / peak HBM bandwidth)")
    print(_util.format_table(tokens, TOKEN_COLUMNS))
    print()
    rotary = rotary_rows(heads=args.heads)
    print(format_rotary(rotary))
    print()
    replay = replay_rows(heads=args.heads)
    print(f"replay, flagship, H={args.heads}: stepwise vs a checkpoint and a ring of K - 1 tokens; modelled "
          "(bytes / peak HBM bandwidth)")
    print(_util.format_table(replay, REPLAY_COLUMNS))
    print(f"  - {REPLAY_NOTE}")
    replay_issue = replay_issue_rows(heads=args.heads)
    print(f"\nreplay kernel, flagship, H={args.heads}, B=256: instructions and time against the stepwise step")
    print(_util.format_table(replay_issue, REPLAY_ISSUE_COLUMNS))
    print(f"  - {REPLAY_ISSUE_NOTE}")
    replay_verify = replay_verify_rows(heads=args.heads)
    print(f"\nreplay kernel, verify steps, flagship, H={args.heads}, B=256: instructions and time against today's "
          "verify step")
    print(_util.format_table(replay_verify, REPLAY_VERIFY_COLUMNS))
    print(f"  - {REPLAY_VERIFY_NOTE}")
    out = _util.results_dir(args.out)
    payload = {
        "what": "modelled, not measured: compulsory HBM bytes per decode step (mamba3_step.tools.bytes_model) "
                "divided by peak HBM bandwidth",
        "environment": _util.environment(),
        "hbm_bandwidth_bytes_per_s": HBM_BANDWIDTH,
        "configs": {name: spec.as_dict() for name, spec in configurations().items()},
        "rows": rows,
        "tokens": tokens,
        "rotary": {"spec": flagship_rotary_spec().as_dict(), "rows": rotary, "notes": list(ROTARY_NOTES)},
        "replay": {"rows": replay, "note": REPLAY_NOTE, "issue": replay_issue, "issue_note": REPLAY_ISSUE_NOTE,
                   "verify_issue": replay_verify, "verify_issue_note": REPLAY_VERIFY_NOTE},
    }
    print(f"wrote {_util.write_json(out / 'model_bench.json', payload)}")
    if not args.no_plot:
        _util.write_plot(lambda png: plot(rows, png), out / "model_bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
