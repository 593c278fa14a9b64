"""``check_indices``: the opt-in debug check of pool index *values* (``validate_indices=True``).

Letters (docs/contract.md): B lanes, P pool rows.

It copies the indices to the host, so it synchronises the device, and it refuses to run during
CUDA-graph capture. Padding follows :func:`mamba3_step.contract.lane_is_live`.
"""

from __future__ import annotations

import torch

from ..contract import lane_is_live, source_rows

__all__ = ["check_indices"]


def _lanes_str(lanes: list[int], limit: int = 10) -> str:
    shown = ", ".join(str(v) for v in lanes[:limit])
    count = f"{len(lanes)} lane{'' if len(lanes) == 1 else 's'}"
    return f"[{shown}{', ...' if len(lanes) > limit else ''}] ({count})"


def check_indices(
    state_batch_indices: torch.Tensor,  # (B,) int32, or (B, K) with num_accepted_tokens
    dst_state_batch_indices: torch.Tensor | None,  # (B,) or (B, T) int32
    P: int,
    null_slot_id: int | None = None,
    num_accepted_tokens: torch.Tensor | None = None,  # (B,) int32
) -> None:
    """Debug check of pool index values (``validate_indices=True``); synchronises the device.

    Negative indices and ``null_slot_id`` are legitimate padding. Raises ValueError listing the
    offending lanes for:

    * an index ``>= P`` in ``state_batch_indices`` or ``dst_state_batch_indices`` that is not
      ``null_slot_id`` (the kernel would treat it as padding, but outside a padded graph replay
      it is almost always a bug);
    * a ``num_accepted_tokens`` count outside [1, K] (the same: the kernel makes the lane
      padding; a padding lane is marked by a padding source index);
    * two live lanes writing the same destination row (a race); with a (B, T) destination
      every token's row counts, and one lane writing a row for two tokens is refused too (the
      kernel would keep the later state, but the earlier one, needed to roll back to it, is lost);
    * a live lane writing a row that another live lane reads (a read/write race). A lane may
      write its own source row: it reads the row before writing anything.

    A lane is live when its source (:func:`mamba3_step.contract.source_rows`) is a real row; a
    live lane whose destination is padding writes nothing, so it cannot collide.

    Raises:
        RuntimeError: called during CUDA-graph capture (it would synchronise the stream).
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "validate_indices=True copies the indices to the host and synchronises, which is "
            "not allowed while a CUDA graph is being captured; validate outside capture or "
            "pass validate_indices=False"
        )

    def host(t):
        return None if t is None else t.detach().to("cpu", torch.int64)

    sbi, dst_t, nat = host(state_batch_indices), host(dst_state_batch_indices), host(num_accepted_tokens)
    src = source_rows(sbi, nat).tolist()
    dsts = [[r] for r in src] if dst_t is None else [v if isinstance(v, list) else [v] for v in dst_t.tolist()]
    dst_name = "state_batch_indices" if dst_t is None else "dst_state_batch_indices"

    def is_row(v: int) -> bool:
        return lane_is_live(v, P, null_slot_id)

    problems = []
    for name, t in (("state_batch_indices", sbi), ("dst_state_batch_indices", dst_t)):
        if t is None:
            continue
        bad = [b for b, lane in enumerate(t.view(t.shape[0], -1).tolist())
               if any(v >= P and v != null_slot_id for v in lane)]  # the null slot is padding
        if bad:
            problems.append(
                f"{name}: lanes {_lanes_str(bad)} hold indices >= P={P} "
                f"(values {[t[b].tolist() for b in bad[:10]]}); padding must be negative"
                f"{' or null_slot_id' if null_slot_id is not None else ''}"
            )
    if nat is not None:
        K = sbi.shape[1]
        bad = [b for b, n in enumerate(nat.tolist()) if not 1 <= n <= K]
        if bad:
            problems.append(f"num_accepted_tokens: lanes {_lanes_str(bad)} hold counts outside [1, K={K}] "
                            f"(values {[nat[b].item() for b in bad[:10]]}); mark a padding lane with a padding "
                            f"state_batch_indices entry")

    live = [b for b, v in enumerate(src) if is_row(v)]
    writers: dict[int, set[int]] = {}
    twice = []
    for b in live:
        rows = [r for r in dsts[b] if is_row(r)]
        if len(set(rows)) != len(rows):
            twice.append(b)
        for r in rows:
            writers.setdefault(r, set()).add(b)
    if twice:
        problems.append(f"dst_state_batch_indices: live lanes {_lanes_str(twice)} write one row for two tokens "
                        f"(the earlier token's state would be lost)")
    dup = sorted(b for lanes in writers.values() if len(lanes) > 1 for b in lanes)
    if dup:
        problems.append(
            f"{dst_name}: live lanes {_lanes_str(sorted(set(dup)))} share a destination row (rows "
            f"{sorted(r for r, lanes in writers.items() if len(lanes) > 1)[:10]}): a write race"
        )
    readers: dict[int, list[int]] = {}
    for b in live:
        readers.setdefault(src[b], []).append(b)
    overlap = sorted({b for r, lanes in writers.items() for b in lanes
                      if any(other != b for other in readers.get(r, ()))})
    if overlap:
        problems.append(
            f"{dst_name}: live lanes {_lanes_str(overlap)} write a row that another live lane "
            f"reads (its source row): a read/write race"
        )
    if problems:
        raise ValueError("invalid pool indices: " + "; ".join(problems))
