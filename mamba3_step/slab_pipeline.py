"""The slab pipeline's rules (``StepSpec.pipeline_ctas``, docs/design/kernel.md "The slab pipeline"): its stages,
grid, launch bound and what it refuses. Free of cutlass, like :mod:`.tiling`, which checks a spec's
pipeline through :func:`pipeline_problem`; specs are read by attribute.
"""

from __future__ import annotations

from .contract import DTYPE_BYTES

__all__ = ["MAX_PIPELINE_CTAS", "MAX_PIPELINE_STAGES", "PIPELINE_BOUND_WARPS", "PIPELINE_DEFAULT_CTAS",
           "PIPELINE_INDEX_SLOTS", "PIPELINE_LAUNCH_BOUND", "PIPELINE_STAGE_BUDGET", "PIPELINE_STAGE_BYTES",
           "launch_bound", "pipeline_grid", "pipeline_problem", "pipeline_stages", "stage_tile_bytes"]

#: the shared memory a CTA of the slab pipeline gives its stages where it can (bytes): two of the flagship's fp32
#: 32 KiB tiles, four of its 16-bit 16 KiB ones; with the step's own buffers (11 KiB) three CTAs fit a Hopper or
#: Blackwell SM (228 KiB, 1 KiB of it reserved per CTA), the CTAs per SM the launch bound keeps registers for
PIPELINE_STAGE_BUDGET = 64 << 10
#: the most stages a CTA keeps (:func:`pipeline_stages`): the slab being updated and three in flight
MAX_PIPELINE_STAGES = 4
#: the most shared memory the two stages of a large tile may take (bytes): beyond it a smaller tile_D is asked for
PIPELINE_STAGE_BYTES = 144 << 10
#: slots for the prefetched row indices of later slabs (one read while the next is filled)
PIPELINE_INDEX_SLOTS = 2

#: the slab pipeline's CTAs where a command names none (``--kernel pipeline``): three per SM of an H100 or H200
#: (132 SMs), the CTAs per SM the flagship's stages and registers allow (fp32 and 16-bit states alike)
PIPELINE_DEFAULT_CTAS = 3 * 132

#: the launch bound (CTAs per SM the compiler keeps registers for) of the slab pipeline's one-token steps. Its slab
#: loop keeps loop-invariant values in registers: unbounded, the flagship takes 224 registers (the register kernel
#: 166), bf16 209 and bf16 with stochastic rounding 246, 2 CTAs per SM each; under this bound 160, 167 and 168 with
#: no spill (sm_90a and sm_100a), 3 CTAs per SM each. Only at PIPELINE_BOUND_WARPS
#: warps: 3 CTAs of 4 warps leave 170 registers a thread, of more warps fewer than the update needs (16 warps spill
#: 748 bytes), and of fewer warps the bound's cap would let the compiler grow (N = 32, D = 32, one warp: 80 -> 109
#: registers, 24 -> 16 CTAs). Multi-token steps keep the compiler's choice too (their state stays in registers from
#: token to token), and so does a stochastically rounded fp16 state, whose rounding the bound's 168 registers do not
#: hold (under it the flagship spills 512 bytes on sm_90a)
PIPELINE_LAUNCH_BOUND = 3
PIPELINE_BOUND_WARPS = 4

#: the largest StepSpec.pipeline_ctas (a grid of persistent CTAs: a few per SM of the largest GPU)
MAX_PIPELINE_CTAS = 4096


def stage_tile_bytes(spec) -> int:
    """One stage's state tile, ``(tile_D, N)`` in the state dtype (bytes)."""
    return spec.tile_D * spec.dstate * DTYPE_BYTES[spec.state_dtype]


def pipeline_stages(spec) -> int:
    """The stages of ``spec``'s slab pipeline: as many tiles as :data:`PIPELINE_STAGE_BUDGET` holds, at least 2 and
    at most :data:`MAX_PIPELINE_STAGES`."""
    return max(2, min(MAX_PIPELINE_STAGES, PIPELINE_STAGE_BUDGET // stage_tile_bytes(spec)))


def pipeline_grid(batch, heads, headdim: int, tile_D: int, pipeline_ctas: int, minimum=min) -> tuple:
    """The slab pipeline's grid: ``min(slabs, pipeline_ctas)`` persistent CTAs. The PTX execution tier's on concrete
    sizes; the kernel's launch on its symbolic ones, with the DSL's ``minimum``."""
    return (minimum(batch * heads * (headdim // tile_D), pipeline_ctas), 1, 1)


def launch_bound(spec) -> int:
    """CTAs per SM the compiler is asked to keep registers for (the launch's ``min_blocks_per_mp``; 0: none):
    ``spec.min_ctas_per_sm``, else :data:`PIPELINE_LAUNCH_BOUND` for the slab pipeline's one-token steps of
    :data:`PIPELINE_BOUND_WARPS` warps, but a stochastically rounded fp16 state's."""
    if spec.min_ctas_per_sm or not spec.pipeline_ctas:
        return spec.min_ctas_per_sm
    if spec.carried_tokens > 1 or spec.num_warps != PIPELINE_BOUND_WARPS:
        return 0
    return 0 if spec.stochastic_rounding and spec.state_dtype == "float16" else PIPELINE_LAUNCH_BOUND


def pipeline_problem(spec) -> str | None:
    """Why ``spec`` cannot take the slab pipeline (``spec.pipeline_ctas > 0``), or None."""
    if not 0 <= spec.pipeline_ctas <= MAX_PIPELINE_CTAS:
        return f"pipeline_ctas must be in [0, {MAX_PIPELINE_CTAS}], got {spec.pipeline_ctas}"
    if not spec.pipeline_ctas:
        return None
    if spec.replay_ring or spec.async_state_copy:
        return "the slab pipeline (pipeline_ctas) runs stepwise tokens: not with replay_ring or async_state_copy"
    if spec.update_kv_state and spec.tile_D < spec.headdim:
        return ("the slab pipeline's CTA walks slabs alone: update_kv_state with tile_D < headdim (a cluster per "
                "(lane, head)) is the register kernel's (pipeline_ctas=0)")
    stage_bytes = 2 * stage_tile_bytes(spec)
    if stage_bytes > PIPELINE_STAGE_BYTES:
        return (f"the slab pipeline's 2 stages of tile_D={spec.tile_D} x N={spec.dstate} "
                f"{spec.state_dtype} take {stage_bytes} bytes of shared memory, more than {PIPELINE_STAGE_BYTES}: "
                "use a smaller tile_D")
    return None
