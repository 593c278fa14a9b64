"""``check_indices``: the opt-in debug check of pool index *values* (``validate_indices=True``).

Letters (docs/contract.md): B lanes, P pool rows.

It copies the indices to the host, so it synchronises the device, and it refuses to run during
CUDA-graph capture. Padding follows :func:`mamba3_step.contract.lane_is_live`.
"""

from __future__ import annotations

import torch

from ..contract import lane_is_live

__all__ = ["check_indices"]


def _lanes_str(lanes: list[int], limit: int = 10) -> str:
    shown = ", ".join(str(v) for v in lanes[:limit])
    count = f"{len(lanes)} lane{'' if len(lanes) == 1 else 's'}"
    return f"[{shown}{', ...' if len(lanes) > limit else ''}] ({count})"


def check_indices(
    state_batch_indices: torch.Tensor,  # (B,) int32
    dst_state_batch_indices: torch.Tensor | None,  # (B,) int32
    P: int,
    null_slot_id: int | None = None,
) -> None:
    """Debug check of pool index values (``validate_indices=True``); synchronises the device.

    Negative indices and ``null_slot_id`` are legitimate padding. Raises ValueError listing
    the offending lanes for:

    * an index ``>= P`` in ``state_batch_indices`` or ``dst_state_batch_indices`` that is not
      ``null_slot_id`` (the kernel would treat it as padding, but outside a padded graph replay
      it is almost always a bug);
    * two live lanes writing the same destination row (a race);
    * a live lane's destination equal to another live lane's source (a read/write race).

    A lane is live when its source is a real row; a live lane whose destination is padding
    writes nothing, so it cannot collide.

    Raises:
        RuntimeError: called during CUDA-graph capture (it would synchronise the stream).
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "validate_indices=True copies the indices to the host and synchronises, which is "
            "not allowed while a CUDA graph is being captured; validate outside capture or "
            "pass validate_indices=False"
        )
    src = state_batch_indices.detach().to("cpu", torch.int64).tolist()
    dst = src if dst_state_batch_indices is None else (
        dst_state_batch_indices.detach().to("cpu", torch.int64).tolist()
    )
    dst_name = "state_batch_indices" if dst_state_batch_indices is None else "dst_state_batch_indices"

    def is_row(v: int) -> bool:
        return lane_is_live(v, P, null_slot_id)

    problems = []
    for name, values in (("state_batch_indices", src), ("dst_state_batch_indices", dst)):
        if name == "dst_state_batch_indices" and dst_state_batch_indices is None:
            continue
        bad = [b for b, v in enumerate(values) if v >= P and v != null_slot_id]  # the null slot is padding
        if bad:
            problems.append(
                f"{name}: lanes {_lanes_str(bad)} hold indices >= P={P} "
                f"(values {[values[b] for b in bad[:10]]}); padding must be negative"
                f"{' or null_slot_id' if null_slot_id is not None else ''}"
            )

    live = [b for b, v in enumerate(src) if is_row(v)]
    writers: dict[int, list[int]] = {}
    for b in live:
        if is_row(dst[b]):
            writers.setdefault(dst[b], []).append(b)
    dup = sorted(b for lanes in writers.values() if len(lanes) > 1 for b in lanes)
    if dup:
        problems.append(
            f"{dst_name}: live lanes {_lanes_str(dup)} share a destination row (rows "
            f"{sorted(r for r, lanes in writers.items() if len(lanes) > 1)[:10]}): a write race"
        )
    readers: dict[int, list[int]] = {}
    for b in live:
        readers.setdefault(src[b], []).append(b)
    overlap = sorted(
        b for r, lanes in writers.items() for b in lanes
        if any(other != b for other in readers.get(r, ()))
    )
    if overlap:
        problems.append(
            f"{dst_name}: live lanes {_lanes_str(overlap)} write a row that another live lane "
            f"reads (its state_batch_indices): a read/write race"
        )
    if problems:
        raise ValueError("invalid pool indices: " + "; ".join(problems))
