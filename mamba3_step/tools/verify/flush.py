"""``verify`` of materialize's flush form (``--materialize-ring L``): the check of one flush
specialisation (``StepSpec.replay_ring = 1``, or a second launch's ``F = L - 15``), executed from
its PTX on the CPU against the executed stepwise kernel (docs/contract.md, "Replay").

The rings are built by the stepwise kernel itself: each pool row steps its own tokens, one
executed one-token step per token, and each token is written to the row's ring as a replay step
appends it (B as received, x, A, dt, trap; with rotary the angle after the token, which is the
stepwise kernel's ``angle_state`` then; with stochastic rounding the token's offset and its row).
The rows hold every committed count the specialisation takes, and some none; the entries after a
row's count are poisoned. ``parity``: the flush form's rows are the stepwise rows bit for bit, and
the launches are the one specialisation checked. ``padding_bytes``: the flush form's accesses to
the original pools or rings (registered around the launch; it works on copies): 0 is the pass.

Letters: P pool rows, H heads, D head dim, N state size, R MIMO rank, L ring entries.
"""

from __future__ import annotations

import torch

from ...materialize import flush_form
from ptx_executor import analysis
from ..ptx_tier import run_step_ptx
from ...replay import Ring, new_ring
from ...spec import MAX_TOKENS, StepSpec, flush_groups
from ...tensors import StepTensors
from ...testing import bits_equal, inputs_for, poison_

__all__ = ["flush_check"]

#: the pools a flush form returns, as ``StepTensors`` fields
_ROWS = ("state", "Bstate", "Xstate", "state_scale", "angle_state")


def flush_check(spec: StepSpec, arch: str, batch: int, heads: int, seed: int) -> dict:
    """The row of ``verify`` for a flush specialisation (module docstring); ``batch`` pool rows."""
    L, flush_length = spec.ring_entries, spec.replay_ring
    stepwise = spec.replace(replay_ring=0, tokens=1, num_accepted=False, replay_draft=0, tile_D=0,
                            num_warps=0).with_default_tiling()
    lo, hi = next((first, last) for first, last, k in flush_groups(L) if k == flush_length)  # the counts it takes
    counts = [([0] + list(range(lo, hi + 1)))[p % (hi - lo + 2)] for p in range(batch)]
    pools = inputs_for(stepwise, batch, batch, heads, seed)
    start = {k: pools[k].clone() for k in _ROWS if pools.get(k) is not None}
    weights = {k: pools.get(k) for k in ("D", "xproj", "B_bias", "C_bias")}
    ring = _stepped_ring(stepwise, pools, weights, counts, L, arch, seed)
    t = StepTensors(start["state"], start["Bstate"], start["Xstate"], None, None, None, weights["D"], None, None, None,
                    weights["xproj"], angle_state=start.get("angle_state"), B_bias=weights["B_bias"],
                    C_bias=weights["C_bias"], state_scale=start.get("state_scale"),
                    rand_seed=pools.get("rand_seed"))
    current, launches = flush_form(t, ring, list(range(batch)), rotate_pairwise=spec.rotate_pairwise)
    row = dict(err_out=None, budget_out=None, err_state=None, budget_state=None, accurate=True,
               parity=[launch.spec for launch in launches] == [spec], padding_bytes=0, races=0)
    originals = {**{f"pool.{k}": v for k, v in start.items()},
                 **{f"ring.{f}": v for f, v in zip(Ring._fields, ring) if v is not None}}
    for launch in launches:
        result = run_step_ptx(launch.spec, launch.tensors, arch=arch, ring=launch.ring, record_shared=True,
                              extra_regions=originals)
        row["padding_bytes"] += _bytes_in(result, originals)
        row["races"] += analysis.race_count(result)
    for k, v in current._asdict().items():
        if v is not None:
            row["parity"] &= bits_equal(v, pools[k])
    return row


def _stepped_ring(stepwise: StepSpec, pools: dict, weights: dict, counts: list, L: int, arch: str, seed: int) -> Ring:
    """Rings of ``L`` entries whose row ``p`` holds ``counts[p]`` tokens, each stepped on ``pools`` by
    the executed stepwise kernel as it is recorded (module docstring); poison after the counts."""
    P, H = len(counts), pools["state"].shape[1]
    D, N = pools["state"].shape[2:]
    flush_length = max(2, L - MAX_TOKENS + 1)  # a pool's F and T_max with F - 1 + T_max = L
    ring = new_ring(P, flush_length, stepwise.mimo, H, N, D, kv_dtype=pools["Bstate"].dtype, x_dtype=pools["Xstate"].dtype,
                    draft=L - flush_length + 1, rope_angles=stepwise.rope_angles, stochastic=stepwise.stochastic_rounding)
    for f in ("B", "x", "coef", "offset", "drawn_for", "angle"):
        if getattr(ring, f) is not None:
            poison_(getattr(ring, f), seed=seed)
    for j in range(max(counts)):
        lane = inputs_for(stepwise, P, P, H, seed + 1 + j)
        index = torch.tensor([p if m > j else -1 for p, m in enumerate(counts)], dtype=torch.int32)
        live = index >= 0
        call = {k: lane[k] for k in ("A", "B", "C", "x", "dt", "trap", "angle_proj", "rand_seed") if k in lane}
        if "rand_seed" in call:
            call["rand_seed"] = torch.tensor([int(pools["rand_seed"][0]), int(lane["rand_seed"][1])])
        run_step_ptx(stepwise, StepTensors(**{k: pools.get(k) for k in _ROWS}, **call, **weights,
                                           state_batch_indices=index).with_out(), arch=arch, record=False)
        B = call["B"].expand(-1, -1, H, -1)  # a B shared by the heads is kept per head
        ring.B[live, j], ring.x[live, j] = B[live], call["x"][live]
        ring.coef[live, j] = torch.stack([call[f][live] for f in ("A", "dt", "trap")], -1)
        if ring.angle is not None:
            ring.angle[live, j] = pools["angle_state"][live]
        if ring.offset is not None:
            ring.offset[live, j] = call["rand_seed"][1]
            ring.drawn_for[live, j] = index[live, None]
    ring.length[:] = torch.tensor(counts, dtype=torch.int32)[:, None]
    return ring


def _bytes_in(result, regions: dict) -> int:
    """The launch's accesses that touch any byte of ``regions``' tensors (counted as verify's
    ``padding_bytes`` counts a padding lane's: 0 is the pass)."""
    log = result.log.arrays()
    addrs, widths = log["addr"].astype("int64"), log["width"]
    total = 0
    for t in regions.values():
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        total += int(((addrs + widths > start) & (addrs < end)).sum())
    return total
