"""Theoretical occupancy: resident CTAs and warps per SM from registers, threads and shared memory."""

from __future__ import annotations

from ...arch import sm_number

__all__ = ["ARCH_LIMITS", "theoretical_occupancy"]

#: Per-SM limits by compute capability. Sources: CUDA C++ Programming Guide, "Technical
#: Specifications per Compute Capability" table (warps/SM, CTAs/SM, registers/SM, max
#: shared memory per SM / per block), and the CUDA occupancy calculator header
#: cuda_occupancy.h (register allocation unit 256 per warp, 4 SM sub-partitions, 1 KiB
#: shared memory reserved per CTA on cc >= 8.0, shared allocation granularity 128 B).
#: cc 10.0 (B200) has the same limits as cc 9.0 in that table; cc 12.x has 48 warps and
#: 100 KiB of shared memory per SM.
ARCH_LIMITS = {
    80: dict(max_warps=64, max_ctas=32, regs=65536, smem_sm=167936, smem_cta=166912),
    86: dict(max_warps=48, max_ctas=16, regs=65536, smem_sm=102400, smem_cta=101376),
    89: dict(max_warps=48, max_ctas=24, regs=65536, smem_sm=102400, smem_cta=101376),
    90: dict(max_warps=64, max_ctas=32, regs=65536, smem_sm=233472, smem_cta=232448),
    100: dict(max_warps=64, max_ctas=32, regs=65536, smem_sm=233472, smem_cta=232448),
    103: dict(max_warps=64, max_ctas=32, regs=65536, smem_sm=233472, smem_cta=232448),
    120: dict(max_warps=48, max_ctas=32, regs=65536, smem_sm=102400, smem_cta=101376),
    121: dict(max_warps=48, max_ctas=32, regs=65536, smem_sm=102400, smem_cta=101376),
}
_REG_ALLOC_UNIT = 256
_SUB_PARTITIONS = 4
_SMEM_RESERVED_PER_CTA = 1024
_SMEM_GRANULARITY = 128


def theoretical_occupancy(registers: int, threads: int, smem_bytes: int, arch: str) -> dict | None:
    """Resident CTAs and warps per SM, and the limiting resource.

    Args:
        registers: registers per thread (as compiled).
        threads: threads per CTA.
        smem_bytes: shared memory per CTA (static + dynamic), excluding the 1 KiB per CTA
            the system reserves (added here).
        arch: e.g. ``"sm_90a"``.

    Returns ``None`` for an architecture not in :data:`ARCH_LIMITS`, else a dict with
    ``ctas_per_sm``, ``warps_per_sm``, ``max_warps_per_sm``, ``occupancy`` (fraction of
    the SM's warp slots), ``limiter`` ("registers", "shared memory", "threads" or
    "CTA slots") and the CTA counts each limit alone allows.
    """
    lim = ARCH_LIMITS.get(sm_number(arch))
    if lim is None:
        return None
    if threads <= 0:
        raise ValueError(f"threads must be positive, got {threads}")
    warps = -(-threads // 32)
    by = {}
    by["CTA slots"] = lim["max_ctas"]
    by["threads"] = lim["max_warps"] // warps
    if registers > 0:
        regs_per_warp = -(-registers * 32 // _REG_ALLOC_UNIT) * _REG_ALLOC_UNIT
        warps_per_partition = (lim["regs"] // _SUB_PARTITIONS) // regs_per_warp
        by["registers"] = (warps_per_partition * _SUB_PARTITIONS) // warps
    smem_cta = -(-smem_bytes // _SMEM_GRANULARITY) * _SMEM_GRANULARITY + _SMEM_RESERVED_PER_CTA
    by["shared memory"] = (lim["smem_sm"] // smem_cta) if smem_bytes <= lim["smem_cta"] else 0
    limiter = min(by, key=lambda k: (by[k], k != "registers"))
    ctas = by[limiter]
    return {
        "ctas_per_sm": ctas,
        "warps_per_sm": ctas * warps,
        "max_warps_per_sm": lim["max_warps"],
        "occupancy": ctas * warps / lim["max_warps"],
        "limiter": limiter,
        "ctas_by_limit": by,
    }
