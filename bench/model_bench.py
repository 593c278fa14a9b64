"""Model benchmark (runs anywhere, no GPU): bytes one decode step moves and the time that
costs at HBM bandwidth, for pool mode, gather -> dense -> scatter and dense mode; for
speculative decoding, one T-token step against T one-token steps; and for the rotary angle,
the fused step against upstream's pipeline (a rotary launch, the step, state copies, with
pools a gather and a scatter).

    python bench/model_bench.py [--out DIR] [--heads 48] [--no-plot] [--measured bench/results/gpu_bench.json]

Prints a table per configuration, the T-token table, the rotary tables (totals, per stage, the
model's assumptions) and the replay tables (bytes, and the issue model of the plain and the verify
step), writes ``model_bench.json`` and ``model_bench.png`` to ``bench/results/`` (or ``--out``).
Every number here is *modelled* (``mamba3_step.tools.bytes_model``: compulsory bytes / peak HBM bandwidth),
not measured; ``bench/gpu_bench.py`` measures. With ``--measured``, a result of
``bench/gpu_bench.py --suite replay,replay-verify``, the replay issue tables add its graph times at
B = 256 over the stepwise step's (column ``measured x``) beside the model.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402  (also puts the repository on sys.path)
import gpu_results  # noqa: E402
from model_replay import replay_tables  # noqa: E402

from mamba3_step.tools.bytes_model import HBM_BANDWIDTH, MODES, bytes_per_step, token_saving, upstream_pipeline_bytes
from mamba3_step.spec import FLAGSHIP_HEADS, flagship_rotary_spec, flagship_spec  # noqa: E402

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output folder (default bench/results)")
    p.add_argument("--heads", type=int, default=FLAGSHIP_HEADS, help="H (default 48)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--measured", default=None, metavar="GPU_BENCH_JSON",
                   help="a bench/gpu_bench.py result (gpu_bench.json): its suites replay and replay-verify's times "
                        "at B = 256 beside the replay models ('measured x')")
    args = p.parse_args(argv)
    if args.heads < 1:
        p.error(f"--heads must be >= 1, got {args.heads}")
    try:
        measured = None if args.measured is None else gpu_results.load(args.measured)
    except ValueError as e:
        p.error(str(e))
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
    replay = replay_tables(args.heads, measured)
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
        "replay": replay,
    }
    print(f"wrote {_util.write_json(out / 'model_bench.json', payload)}")
    if not args.no_plot:
        _util.write_plot(lambda png: plot(rows, png), out / "model_bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
