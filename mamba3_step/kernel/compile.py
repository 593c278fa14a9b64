"""Compiling one specialisation: the fake arguments its signature is traced with, which of their
modes are dynamic (what the PTX execution tier packs), and :func:`compile_step_kernel`."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..contract import SCALED_STATE_DTYPES
from ..spec import StepSpec
from ..tensors import KernelArgs
from ..arch import sm_number
from ..tiling import launch_cluster, thread_layout, tiling_problem
from .bundles import CUTLASS_DTYPES
from .step import Mamba3StepKernel

__all__ = ["argument_masks", "compile_step_kernel", "fake_arguments"]


def fake_arguments(spec: StepSpec) -> KernelArgs:
    """Fake tensors for ``cute.compile``, one per :class:`KernelArgs` field (None where the spec
    has no such tensor): B, P, H, the candidate rows, the ring's entries and every stride symbolic but the state's D stride (N unless
    ``padded_state_rows``); T static.

    A tensor's first stride is 64-bit (pool offsets exceed 2**31 elements), the others 32-bit
    (the wrapper checks a row spans less than 2**31 elements). State strides are declared
    divisible by the 16-byte vector and the base 16-byte aligned (the wrapper checks both),
    which is what lets the state copies become 16-byte accesses. Per-lane tensors have a token
    axis (B, T, ...) only when the specialisation has more than one token, so the one-token
    kernel is the plain decode step.
    """
    make = cute.runtime.make_fake_tensor
    sym, sym64 = cute.sym_int, cute.sym_int64
    st, kv, xt, pj = (CUTLASS_DTYPES[n] for n in (spec.state_dtype, spec.kv_dtype, spec.x_dtype, spec.proj_dtype))
    N, D, R = spec.dstate, spec.headdim, spec.mimo
    VN = thread_layout(N, spec.tile_D, spec.num_warps, spec.state_dtype, R).VN
    batch, pool, heads = sym(), sym(), sym()

    def state_like(rows):  # (rows, H, D, N)
        # the row stride is 64-bit (a pool exceeds 2**31 elements); inside a row 32 bits suffice
        # (validation.check_state_strides), which keeps per-vector address math 32-bit. The D
        # stride is N unless the rows are padded: then a thread's rows are immediate offsets
        # from one address (StepSpec.padded_state_rows)
        d_stride = sym(divisibility=VN) if spec.padded_state_rows else N
        return make(st, (rows, heads, D, N), stride=(sym64(divisibility=VN), sym(divisibility=VN), d_stride, 1),
                    assumed_align=16)

    def strided(dtype, shape):  # outermost stride 64-bit, the others 32-bit, innermost 1
        inner = tuple(sym() for _ in shape[1:-1])
        outer = (sym64(),) if len(shape) > 1 else ()
        return make(dtype, shape, stride=outer + inner + (1,), assumed_align=dtype.width // 8)

    rows = pool if spec.pool else batch
    T = spec.tokens
    angles = spec.rope_angles
    bc_heads = 1 if spec.shared_bc else heads
    replay, ring = spec.replay_ring > 0, sym()

    def lane(dtype, rest):  # a per-lane tensor: (B, *rest), or (B, T, *rest) with tokens > 1
        return strided(dtype, (batch,) + ((T,) if T > 1 else ()) + rest)

    return KernelArgs(
        state=state_like(rows),
        Bstate=strided(kv, (rows, R, heads, N)),
        Xstate=strided(xt, (rows, heads, D)),
        A=lane(Float32, (heads,)),
        B=lane(kv, (R, bc_heads, N)),
        C=lane(kv, (R, bc_heads, N)),
        D=strided(Float32, (heads,)),
        x=lane(xt, (heads, D)),
        dt=lane(Float32, (heads,)),
        trap=lane(Float32, (heads,)),
        xproj=strided(pj, (R, heads, D)),
        zproj=strided(pj, (R, heads, D)) if spec.has_z else None,
        outproj=strided(pj, (R, heads, D)) if spec.has_outproj else None,
        z=lane(xt, (heads, D)) if spec.has_z else None,
        out=lane(xt, (heads, D) if spec.has_outproj else (R, heads, D)),
        state_out=state_like(batch) if spec.has_state_out else None,
        # (B,), or (B, candidates) with num_accepted_tokens (but for replay, whose accepted drafts are ring entries)
        state_batch_indices=(strided(Int32, (batch, sym())) if spec.num_accepted and not replay
                             else strided(Int32, (batch,)))
        if spec.pool else None,
        # (B,), or (B, T) per token
        dst_state_batch_indices=(strided(Int32, (batch, T)) if spec.dst_per_token else strided(Int32, (batch,)))
        if spec.has_dst else None,
        num_accepted_tokens=strided(Int32, (batch,)) if spec.num_accepted else None,
        angle_state=strided(Int64, (rows, heads, angles)) if angles else None,
        angle_proj=lane(Float32, (heads, angles)) if angles else None,
        B_bias=strided(Float32, (R, heads, N)) if spec.has_bc_bias else None,
        C_bias=strided(Float32, (R, heads, N)) if spec.has_bc_bias else None,
        rand_seed=strided(Int64, (2,)) if spec.stochastic_rounding else None,
        rand_rows=strided(Int32, (batch,)) if spec.has_rand_rows else None,
        state_scale=strided(Float32, (rows, heads, D)) if spec.state_dtype in SCALED_STATE_DTYPES else None,
        # replay: (P, entries, ...) ring entries, their count symbolic; the length per (row, head)
        ring_B=strided(kv, (pool, ring, R, heads, N)) if replay else None,
        ring_x=strided(xt, (pool, ring, heads, D)) if replay else None,
        ring_coef=strided(Float32, (pool, ring, heads, 3)) if replay else None,
        ring_length=strided(Int32, (pool, heads)) if replay else None,
        ring_angle=strided(Int64, (pool, ring, heads, angles)) if replay and angles else None,
        ring_offset=strided(Int64, (pool, ring, heads)) if replay and spec.stochastic_rounding else None,
        ring_drawn_for=strided(Int32, (pool, ring, heads)) if replay and spec.stochastic_rounding else None,
        null_slot=Int32(-1),
    )


def argument_masks(spec: StepSpec) -> KernelArgs:
    """Per :class:`KernelArgs` field: ``None`` for an absent tensor, ``"scalar"`` for
    ``null_slot``, else ``(dynamic shape modes, dynamic stride modes)`` as bool tuples: which
    values the DSL passes in a tensor's parameter struct."""
    out = []
    for fake in fake_arguments(spec):
        if fake is None:
            out.append(None)
        elif hasattr(fake, "dynamic_shapes_mask"):
            out.append((tuple(bool(m) for m in fake.dynamic_shapes_mask),
                        tuple(bool(m) for m in fake.dynamic_strides_mask)))
        else:
            out.append("scalar")
    return KernelArgs(*out)


def compile_step_kernel(spec: StepSpec, arch: str = "sm_90a", *, extra_options: str = ""):
    """Compile one specialisation for ``arch`` (no GPU needed) and return the tvm-ffi callable.

    The callable takes the :class:`KernelArgs` fields in order (``None`` where the spec has no
    such tensor; :func:`~mamba3_step.tensors.kernel_arguments` fills them from a call); it
    launches on the caller's current CUDA stream.
    """
    problem = tiling_problem(spec)
    if problem is not None:
        raise ValueError(problem)
    if launch_cluster(spec) is not None and sm_number(arch) < 90:
        raise ValueError(f"tile_D: update_kv_state with tile_D={spec.tile_D} < headdim={spec.headdim} launches a "
                         f"thread-block cluster, which needs sm_90 or later, got arch {arch!r}")
    if spec.programmatic_launch and sm_number(arch) < 90:
        raise ValueError(f"programmatic_launch: programmatic dependent launch needs sm_90 or later, got arch {arch!r}")
    options = f"--enable-tvm-ffi --gpu-arch {arch} {extra_options}".strip()
    return cute.compile(Mamba3StepKernel(spec), *fake_arguments(spec),
                        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options=options)
