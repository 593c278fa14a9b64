"""``verify``: compile specialisations, execute their PTX on the CPU, and check what they did.

``python -m mamba3_step verify [spec flags] [--batch B] [--heads H] [--json] [--facts]``; the spec
flags are the shared ones of :mod:`mamba3_step.specsets` (default: the flagship as servers run
it). No GPU needed: each specialisation is compiled exactly as the launcher compiles it and its
PTX executed by :mod:`ptx_executor` (docs/ptx-tier.md). Per specialisation, one row:

* ``err_out``/``err_state``: largest error of the executed kernel against the float64
  reference, next to ``budget_*``, the error of the same computation done by PyTorch in float32
  (which rounds to the same storage dtypes); a row passes when every error is at most
  :func:`tolerance` of its budget;
* ``parity``: pool mode bit-identical to gather -> the executed dense kernel -> scatter, pools
  poisoned, every padding kind (-1, INT32_MIN, P, INT32_MAX, the null slot), and with the
  specialisation's ``dst``/``update_kv_state`` (a dense specialisation is checked through its
  pool twin);
* ``padding_bytes``: bytes of any pool tensor that padding lanes' CTAs read or wrote (from the
  recorded addresses; must be 0);
* ``fault``: the first execution fault (an access outside every tensor, a misaligned access, a
  barrier or shuffle not reached by every participant, an unsupported instruction), else None;
* ``races``: bytes shared between CTAs with a write, or touched by two threads of a CTA
  between the same barriers with one of them writing (global and shared memory).

A replay specialisation (``--replay-ring F``) is checked over 2K + 1 executed steps against the
executed stepwise kernel instead: ``parity`` covers every ``out`` the contract makes bit-identical
and every row at its flush, ``err_out`` appends from the checkpoint against float64. With
``--tokens T --num-accepted`` (verify steps) each step accepts every draft of the row's last one.

``--materialize-ring L`` checks ``materialize_fn``'s flush forms instead
(:mod:`mamba3_step.tools.verify.flush`: rings built by the executed stepwise kernel, the flush form's rows
equal to its rows bit for bit, no byte of the originals touched).

The exit status is 1 when any row fails. :func:`executed_facts` gives the executed
instruction mix, sectors per request, bank conflicts and bytes of one specialisation (also
``inspect --executed``).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch

import ptx_executor as ptx
from ...api import mamba3_step_fn, prepare_step
from ..bytes_model import bytes_per_step
from ...contract import source_rows
from ptx_executor import analysis
from ..ptx_tier import ptx_kernel, ptx_step_fn, run_step_ptx
from ...reference import mamba3_step_reference
from ...replay import new_ring
from ..replay_reference import append_reference, draft_references
from ...rounding import dequantize_rows
from ...serving import gather_dense_scatter
from ...spec import KERNEL_CHOICE_FIELDS, StepSpec
from ...specsets import add_spec_arguments, parse_spec_args, spec_label
from ...tensors import LANE_FIELDS, ROW_FIELDS, StepTensors
from .flush import flush_check
from ...testing import bits_equal, inputs_for, poison_, pool_rows, step_indices

__all__ = ["HELP", "add_arguments", "append_reference", "executed_facts", "replay_instructions", "run", "tolerance",
           "verify_instructions", "verify_spec"]

HELP = "compile, execute the kernel's PTX on the CPU and check it against float64 (no GPU needed)"
NULL_SLOT = 2


def tolerance(budget: float, scale: float) -> float:
    """The largest error accepted of an executed kernel: twice PyTorch-float32's error on the
    same inputs plus 1e-6 of the output's scale (approximate instructions, other summation
    order: docs/ptx-tier.md, "Numerics")."""
    return 2 * budget + 1e-6 * max(scale, 1.0)


#: the lane kinds of :func:`mamba3_step.testing.step_indices` whose source row is live
_LIVE_KINDS = ("live", "live_nodst", "live_gaps")


def _inputs(spec: StepSpec, batch: int, heads: int, seed: int, live_only: bool = False) -> tuple[StepTensors, list]:
    """A call of ``spec``: fresh inputs; in pool mode indices with every padding kind
    (:func:`mamba3_step.testing.step_indices`), or with ``live_only`` every lane live on rows of its own."""
    P = pool_rows(spec, batch) if spec.pool else None
    kw = inputs_for(spec, batch, P, heads, seed)
    kinds = ["live"] * batch
    if spec.pool:
        indices, kinds = step_indices(spec, batch, P, null_slot_id=None if live_only else NULL_SLOT,
                                      live_only=live_only, seed=seed)
        kw.update(indices)
    if spec.has_state_out:
        kw["state_out"] = poison_(torch.empty_like(kw["state"]), seed=seed)
    return StepTensors(**kw), kinds


def _clone(t: StepTensors) -> StepTensors:
    return t._replace(**{k: v.clone() for k, v in t._asdict().items() if isinstance(v, torch.Tensor)})


def _tiling(spec: StepSpec) -> dict:
    """The spec's tiling and its options beyond the tensors, as keywords."""
    return dict(tile_D=spec.tile_D, num_warps=spec.num_warps, rotate_pairwise=spec.rotate_pairwise,
                stochastic_rounding=spec.stochastic_rounding)


def _accuracy(spec: StepSpec, tensors: StepTensors, executed: StepTensors) -> dict:
    """Errors of the executed run (already done on ``executed``) and of PyTorch float32 vs float64."""
    f64 = tensors._replace(**{k: v.double() if v.is_floating_point() else v.clone()
                              for k, v in tensors._asdict().items() if isinstance(v, torch.Tensor)})
    if tensors.state_scale is not None:  # an 8-bit state: the float64 reference carries its values unrounded
        f64 = f64._replace(state=dequantize_rows(tensors.state, tensors.state_scale).double(), state_scale=None)
    out64 = mamba3_step_reference(f64, update_kv_state=spec.update_kv_state, rotate_pairwise=spec.rotate_pairwise,
                                  stochastic_rounding=spec.stochastic_rounding, compute_dtype=torch.float64)
    cpu = _clone(tensors)
    out32 = mamba3_step_fn(**cpu._asdict(), update_kv_state=spec.update_kv_state,
                           rotate_pairwise=spec.rotate_pairwise, stochastic_rounding=spec.stochastic_rounding)
    key = "state_out" if spec.has_state_out else "state"

    def err(a, b):
        return (a.double() - b).abs().max().item()

    def values(t):  # the state's values (an 8-bit state's codes times its scales)
        return getattr(t, key) if t.state_scale is None else dequantize_rows(t.state, t.state_scale)

    row = dict(err_out=err(executed.out, out64), budget_out=err(out32, out64),
               err_state=err(values(executed), getattr(f64, key)),
               budget_state=err(values(cpu), getattr(f64, key)))
    scale = out64.abs().max().item()
    row["accurate"] = (row["err_out"] <= tolerance(row["budget_out"], scale)
                       and row["err_state"] <= tolerance(row["budget_state"], 1.0))
    return row


def _padding_bytes(result, tensors: StepTensors, kinds: list) -> int:
    """Bytes of the pools that padding lanes' CTAs touched, from the recorded addresses."""
    log = result.log.arrays()
    lanes = analysis.cta_of(result, log["thread"]) % result.grid[0]
    pad = torch.tensor([k not in _LIVE_KINDS for k in kinds])
    mine = pad.numpy()[lanes]
    touched = 0
    for name in ROW_FIELDS:
        t = getattr(tensors, name)
        if t is None:
            continue
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        a, w = log["addr"][mine].astype("int64"), log["width"][mine]
        touched += int(((a + w > lo) & (a < hi)).sum())
    return touched


def _parity(spec: StepSpec, batch: int, heads: int, seed: int) -> bool:
    """Pool mode (of ``spec``, or its pool twin) bit-identical to gather -> executed dense -> scatter."""
    twin = spec if spec.pool else spec.replace(pool=True, has_dst=True, has_state_out=False,
                                               update_kv_state=spec.tile_D >= spec.headdim,
                                               dst_per_token=spec.tokens > 1, num_accepted=spec.tokens > 1,
                                               has_rand_rows=False)
    tensors, _ = _inputs(twin, batch, heads, seed + 1)
    rows = set(source_rows(tensors.state_batch_indices, tensors.num_accepted_tokens).tolist())
    for name in ROW_FIELDS:  # poison every row no live lane reads
        t = getattr(tensors, name)
        for r in range(0 if t is None else t.shape[0]):
            if r not in rows or r == NULL_SLOT:
                poison_(t[r], seed=seed + r)
    expected = _clone(tensors)
    step = functools.partial(ptx_step_fn, rotate_pairwise=twin.rotate_pairwise,
                             stochastic_rounding=twin.stochastic_rounding)
    out_expected = gather_dense_scatter(expected, update_kv_state=twin.update_kv_state, step_fn=step,
                                        tile_D=twin.tile_D, num_warps=twin.num_warps)
    got = _clone(tensors)._replace(out=poison_(torch.empty_like(out_expected), seed=seed))
    ptx_step_fn(**got._asdict(), update_kv_state=twin.update_kv_state, **_tiling(twin))
    return bits_equal(got.out, out_expected) and all(
        bits_equal(getattr(got, n), getattr(expected, n)) for n in ROW_FIELDS if getattr(got, n) is not None)


def _races(result) -> int:
    return analysis.race_count(result)


def _replay_check(spec: StepSpec, arch: str, batch: int, heads: int, seed: int) -> dict:
    """A replay specialisation over 2K + 1 executed steps (fresh inputs and padding each step) against
    the executed stepwise kernel on pools that start equal: ``parity``, the outs the contract makes
    bit-identical (all, or with ``replay_from_checkpoint`` a flush's) and every row at its flush;
    ``err_out``/``budget_out``, appends from the checkpoint against float64; padding bytes and races
    of the last step. A verify specialisation (T drafts) accepts every draft of a row's last step,
    and the stepwise T-token kernel steps them all: the same drafts, the same states (with
    ``replay_from_checkpoint`` the drafts' outputs against the float64 algebra from the checkpoint)."""
    flush_length, T = spec.replay_ring, spec.tokens
    stepwise = spec.replace(replay_ring=0, replay_from_checkpoint=False, num_accepted=False, replay_draft=0, tile_D=0,
                            num_warps=0).with_default_tiling()
    start, _ = _inputs(stepwise, batch, heads, seed)
    rows_of = tuple(k for k in ("state", "Bstate", "Xstate", "angle_state", "state_scale")  # what a flush writes
                    if getattr(start, k) is not None)
    pools = {kind: {k: getattr(start, k).clone() for k in rows_of} for kind in ("r", "s")}
    P, H, D, N = start.state.shape
    ring = new_ring(P, flush_length, spec.mimo, H, N, D, kv_dtype=start.Bstate.dtype, x_dtype=start.Xstate.dtype,
                    draft=spec.ring_entries - (flush_length - 1),  # the room the step's specialisation replays
                    rope_angles=spec.rope_angles, stochastic=spec.stochastic_rounding)
    row = dict(err_out=0.0, budget_out=0.0, err_state=None, budget_state=None, parity=True, accurate=True)
    pending = set()  # rows whose last verify step's drafts the stepwise kernel has stepped
    for step in range(2 * flush_length + 1):
        fresh, kinds = _inputs(stepwise, batch, heads, seed + 1 + step)  # this step's tokens and lanes
        call = start._replace(**{f: getattr(fresh, f) for f in (*LANE_FIELDS, "state_batch_indices",
                                                              "dst_state_batch_indices")})
        rows = call.state_batch_indices.tolist()
        dsts = rows if call.dst_state_batch_indices is None else call.dst_state_batch_indices.tolist()
        live = [kind in _LIVE_KINDS for kind in kinds]
        accepted = [T if T > 1 and lv and r in pending else 0 for lv, r in zip(live, rows)]  # a token is no draft
        mine = call._replace(**pools["r"], out=poison_(torch.empty_like(call.x), seed=step))
        if spec.num_accepted:
            mine = mine._replace(num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32))
        theirs = call._replace(**pools["s"], out=torch.empty_like(call.x))
        before = {f: getattr(ring, f).clone() for f in ("B", "x", "coef", "length", "angle")
                  if getattr(ring, f) is not None}
        base = tuple(pools["r"][k].clone() for k in ("state", "Bstate", "Xstate", "state_scale") if k in pools["r"])
        held = {k: v.clone() for k, v in pools["s"].items()}  # the state after the committed tokens
        result = run_step_ptx(spec, mine, arch=arch, ring=ring, record_shared=step == 2 * flush_length, record=step == 2 * flush_length)
        run_step_ptx(stepwise, theirs, arch=arch, record=False)
        for b, r in enumerate(rows):
            if not live[b]:
                row["parity"] &= bits_equal(mine.out[b], torch.zeros_like(mine.out[b]))
                continue
            count = int(before["length"][r, 0]) + accepted[b]
            moved = dsts[b] != r  # a destination elsewhere: the lane flushes there (or, padding, writes nothing)
            if T > 1 and spec.replay_from_checkpoint:  # the drafts from the checkpoint (a flush's: stepwise's)
                now = tuple(held[k] for k in ("state", "Bstate", "Xstate", "state_scale") if k in held)
                since = (now, 0) if count >= flush_length else (base, count)
                _account(row, mine.out[b], *(draft_references(call, since[0], before, since[1], r, b, cd)
                                             for cd in _PRECISIONS))
            elif T > 1 or not spec.replay_from_checkpoint or count == flush_length - 1 or moved:
                row["parity"] &= bits_equal(mine.out[b], theirs.out[b])
            else:
                angle = None if ring.angle is None else ring.angle[r, count]  # the one the step stored
                _account(row, mine.out[b], *(append_reference(call, base, before, r, b, cd, angle, spec.rotate_pairwise)
                                             for cd in _PRECISIONS))
            if T > 1 and count >= flush_length:  # a verify step's flush: the state after the committed tokens
                row["parity"] &= all(bits_equal(pools["r"][k][r], held[k][r]) for k in pools["r"])
            elif moved and kinds[b] == "live":  # the destination holds the state after this token
                row["parity"] &= all(bits_equal(pools["r"][k][dsts[b]], pools["s"][k][dsts[b]]) for k in pools["r"])
            elif T == 1 and int(ring.length[r, 0]) == 0:
                row["parity"] &= all(bits_equal(pools["r"][k][r], pools["s"][k][r]) for k in pools["r"])
            pending.add(r)
    row["padding_bytes"] = _padding_bytes(result, mine, kinds)
    row["races"] = _races(result)
    return row


#: a reference's precision, and PyTorch's float32 for the budget
_PRECISIONS = (torch.float64, torch.float32)


def _account(row: dict, got: torch.Tensor, want64: torch.Tensor, torch32: torch.Tensor) -> None:
    """An output from the checkpoint against its float64 reference: ``row``'s worst error and budget
    so far, and whether it is within :func:`tolerance`."""
    budget = (torch32.to(got.dtype).double() - want64).abs().max().item()
    err = (got.double() - want64).abs().max().item()
    row["err_out"], row["budget_out"] = max(row["err_out"], err), max(row["budget_out"], budget)
    row["accurate"] &= err <= tolerance(budget, want64.abs().max().item())


def _step_check(spec: StepSpec, arch: str, batch: int, heads: int, seed: int) -> dict:
    """One executed step against float64, its padding bytes and races, and pool parity (module docstring)."""
    t1 = time.perf_counter()
    tensors, kinds = _inputs(spec, batch, heads, seed)
    s, executed, _ = prepare_step(_clone(tensors), update_kv_state=spec.update_kv_state, **_tiling(spec))
    result = run_step_ptx(s, executed, arch=arch, record_shared=True)
    row = dict(execute_seconds=round(time.perf_counter() - t1, 3), **_accuracy(spec, tensors, executed))
    row["padding_bytes"] = _padding_bytes(result, executed, kinds) if spec.pool else 0
    row["races"] = _races(result)
    row["parity"] = _parity(spec, batch, heads, seed)
    return row


def verify_spec(spec: StepSpec, arch: str = "sm_90a", batch: int = 8, heads: int = 3, seed: int = 0,
                flush: bool = False) -> dict:
    """Compile, execute and check one specialisation (module docstring); returns its row. ``flush``: a
    flush form of materialize (:func:`mamba3_step.tools.verify.flush.flush_check`)."""
    row = dict(label=spec_label(spec), spec=spec.as_dict(), arch=arch, batch=batch, heads=heads, fault=None)
    t0 = time.perf_counter()
    try:
        ptx_kernel(spec, arch)
        row["compile_seconds"] = round(time.perf_counter() - t0, 3)
        check = flush_check if flush else _replay_check if spec.replay_ring else _step_check
        row.update(check(spec, arch, batch, heads, seed))
    except ptx.PTXError as e:
        row["fault"] = f"{type(e).__name__}: {e}"
    row["seconds"] = round(time.perf_counter() - t0, 3)
    row["ok"] = (row["fault"] is None and row.get("accurate", False) and row.get("parity", False)
                 and row.get("padding_bytes") == 0 and row.get("races") == 0)
    return row


def executed_facts(spec: StepSpec, arch: str = "sm_90a", batch: int = 4, heads: int = 2, seed: int = 0) -> dict:
    """What one launch of ``spec`` executed, all lanes live (docs/ptx-tier.md, "Executed facts").

    ``warp_instructions_per_cta`` by class; global accesses: requests, 32-byte sectors and the
    minimum sectors for the same bytes (totals and per PTX line); shared accesses: requests,
    wavefronts and the minimum; unique bytes read + written per tensor next to
    :func:`mamba3_step.tools.bytes_model.bytes_per_step` (``bytes_agree``).
    """
    tensors, _ = _inputs(spec, batch, heads, seed, live_only=True)  # every lane live, on rows of its own
    s, tensors, _ = prepare_step(tensors, update_kv_state=spec.update_kv_state, **_tiling(spec))
    # the kernel choices no call names (not public options) are the spec's
    s = s.replace(**{f: getattr(spec, f) for f in KERNEL_CHOICE_FIELDS})
    result = run_step_ptx(s, tensors, arch=arch, record_shared=True)
    ctas = result.grid[0] * result.grid[1] * result.grid[2]
    coalescing = analysis.coalescing(result)
    conflicts = analysis.bank_conflicts(result)
    touched = analysis.bytes_touched(result, result.extra["memory"])
    model = bytes_per_step(s, batch, heads)
    executed_bytes = {k: v["read"] + v["written"] for k, v in touched.items()}
    return {
        "batch": batch, "heads": heads, "ctas": ctas,
        "warp_instructions_per_cta": analysis.instruction_mix(result, ctas=ctas),
        "global": {"requests": sum(v["requests"] for v in coalescing.values()),
                   "sectors": sum(v["sectors"] for v in coalescing.values()),
                   "ideal_sectors": sum(v["ideal_sectors"] for v in coalescing.values()),
                   "per_line": coalescing},
        "shared": {"requests": sum(v["requests"] for v in conflicts.values()),
                   "wavefronts": sum(v["wavefronts"] for v in conflicts.values()),
                   "ideal_wavefronts": sum(v["ideal"] for v in conflicts.values()),
                   "per_line": conflicts},
        "bytes": {k: {"executed": executed_bytes[k], "model": model.get(k)} for k in executed_bytes},
        "bytes_agree": all(executed_bytes[k] == model.get(k) for k in executed_bytes),
    }


def replay_instructions(spec: StepSpec, arch: str = "sm_90a", seed: int = 0) -> tuple[int, ...]:
    """Executed warp-instructions of one live (lane, head) slab of the replay specialisation ``spec``
    (``spec.replay_ring`` = F) at each ring position 0..F-1 (the row's committed tokens before the
    step); with ``spec.replay_ring = 0`` the stepwise step's, as a 1-tuple. Inputs from the one input
    factory, one lane, one head, ``tile_D = D``."""
    flush_length = spec.replay_ring
    tensors, _ = _inputs(spec.replace(replay_ring=0, replay_from_checkpoint=False), 1, 1, seed, live_only=True)
    counts = []
    for position in range(max(flush_length, 1)):
        ring = None
        if flush_length:
            P, H, D, N = tensors.state.shape
            ring = new_ring(P, flush_length, spec.mimo, H, N, D, kv_dtype=tensors.Bstate.dtype, x_dtype=tensors.Xstate.dtype,
                            stochastic=spec.stochastic_rounding, rope_angles=spec.rope_angles)
            ring.length.fill_(position)
        t = tensors._replace(state=tensors.state.clone(), Bstate=tensors.Bstate.clone(),
                             Xstate=tensors.Xstate.clone()).with_out()
        counts.append(int(run_step_ptx(spec, t, arch=arch, record=False, ring=ring).issued.sum()))
    return tuple(counts)


def verify_instructions(spec: StepSpec, committed: int, arch: str = "sm_90a", seed: int = 0) -> int:
    """Executed warp-instructions of one live (lane, head) slab of the replay verify specialisation
    ``spec`` (``replay_ring`` = F, ``tokens`` = T, ``num_accepted``) whose row holds ``committed``
    tokens once the step's ``accepted`` are taken (``accepted = min(committed, T)``, the rest already
    in the ring). Inputs from the one input factory, one lane, one head, ``tile_D = D``."""
    T = spec.tokens
    base = spec.replace(replay_ring=0, num_accepted=False, replay_draft=0)
    tensors, _ = _inputs(base, 1, 1, seed, live_only=True)
    P, H, D, N = tensors.state.shape
    ring = new_ring(P, spec.replay_ring, spec.mimo, H, N, D, kv_dtype=tensors.Bstate.dtype,
                    x_dtype=tensors.Xstate.dtype, draft=spec.ring_entries - (spec.replay_ring - 1),
                    stochastic=spec.stochastic_rounding, rope_angles=spec.rope_angles)
    accepted = min(committed, T)
    ring.length.fill_(committed - accepted)
    t = tensors._replace(num_accepted_tokens=torch.full((1,), accepted, dtype=torch.int32)).with_out()
    return int(run_step_ptx(spec, t, arch=arch, record=False, ring=ring).issued.sum())


_COLUMNS = (("label", "specialisation", "<"), ("err_out", "err out", ">.2e"), ("budget_out", "torch32", ">.2e"),
            ("err_state", "err state", ">.2e"), ("budget_state", "torch32", ">.2e"), ("parity", "parity", ">"),
            ("padding_bytes", "pad bytes", ">d"), ("races", "races", ">d"), ("seconds", "seconds", ">.1f"),
            ("ok", "ok", ">"))


def format_rows(rows: list[dict]) -> str:
    """The per-specialisation table (faults on their own lines below it)."""
    cells = [[("-" if r.get(k) is None else format(r[k], f.lstrip("<>"))) for k, _, f in _COLUMNS] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(_COLUMNS)]

    def line(items):
        return "  ".join(v.ljust(w) if f.startswith("<") else v.rjust(w)
                         for v, w, (_, _, f) in zip(items, widths, _COLUMNS))

    out = [line([h for _, h, _ in _COLUMNS]), line(["-" * w for w in widths])] + [line(c) for c in cells]
    out += [f"{r['label']}: {r['fault']}" for r in rows if r["fault"]]
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Compile step-kernel specialisations, execute their PTX on the CPU and check them: error "
                     "vs float64, pool/dense parity, padding traffic, memory faults, races. No GPU needed.")
    add_spec_arguments(p)
    p.add_argument("--batch", type=int, default=8, help="lanes of the executed step (default 8)")
    p.add_argument("--heads", type=int, default=3, help="heads of the executed step (default 3)")
    p.add_argument("--seed", type=int, default=0, help="random inputs' seed")
    p.add_argument("--facts", action="store_true", help="also report executed facts (instruction mix, "
                                                        "sectors, bank conflicts, bytes)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON document")


def format_facts(label: str, facts: dict) -> str:
    """A few lines of executed facts for the text output."""
    mix = facts["warp_instructions_per_cta"]
    g, sh = facts["global"], facts["shared"]
    classes = "  ".join(f"{k} {mix[k]:,.0f}" for k in analysis.CLASSES)
    return "\n".join([
        f"{label}: executed at B={facts['batch']} H={facts['heads']} ({facts['ctas']} CTAs, all lanes live)",
        f"  warp-instructions per CTA {mix['total']:,.0f}: {classes}",
        f"  global: {g['requests']:,} warp requests, {g['sectors']:,} sectors of 32 B "
        f"(minimum {g['ideal_sectors']:,}: {100 * g['ideal_sectors'] / max(1, g['sectors']):.0f}% efficient)",
        f"  shared: {sh['requests']:,} warp requests, {sh['wavefronts']:,} wavefronts "
        f"(minimum {sh['ideal_wavefronts']:,})",
        f"  bytes read + written per tensor {'equal' if facts['bytes_agree'] else 'DIFFER FROM'} bytes_model",
    ])


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The ``verify`` subcommand: exit status 0 when every row passes, 1 otherwise, 2 on bad flags."""
    specs, arch = parse_spec_args(args, parser)
    for name, least, most in (("batch", 2, 4096), ("heads", 1, 256), ("seed", -(2**63), 2**63 - 1)):
        if not least <= getattr(args, name) <= most:  # the PTX tier runs every thread: keep it small
            parser.error(f"--{name} must be in [{least}, {most}], got {getattr(args, name)}")
    flush = args.materialize_ring > 0
    if flush and args.facts:
        parser.error("--facts: the executed facts are a decode step's; --materialize-ring names flush forms")
    rows = []
    for spec in specs:
        row = verify_spec(spec, arch, args.batch, args.heads, args.seed, flush=flush)
        if args.facts and row["ok"]:
            row["executed"] = executed_facts(spec, arch, seed=args.seed)
        rows.append(row)
        print(f"verify: {row['label']}: {'ok' if row['ok'] else 'FAILED'} ({row['seconds']:.1f} s)",
              file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else rows))
        return 1 if any(not r["ok"] for r in rows) else 0
    print(f"{arch}, B={args.batch} H={args.heads}: executed PTX vs float64 (torch32: PyTorch-float32's error on "
          f"the same inputs; a row passes at <= 2 x torch32 + 1e-6 of the scale)")
    print(format_rows(rows))
    for row in rows:
        if "executed" in row:
            print(format_facts(row["label"], row["executed"]))
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows)} specialisation(s): {len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0
