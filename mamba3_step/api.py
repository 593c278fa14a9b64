"""The public entry point: :func:`mamba3_step_fn`, and :func:`prepare_step`, what every executor
does before the work itself.

CUDA tensors run the CuteDSL kernel through :mod:`mamba3_step.launch` (there is no fallback: a
CUDA call that cannot launch raises); CPU tensors run the PyTorch implementation of the same
contract (:mod:`mamba3_step.reference`); meta tensors are validated and nothing is computed. A
step with a replay ring (``replay_ring``) is the same entry point in its replay mode: the kernel's
replay specialisation on CUDA, replay's CPU path (:mod:`mamba3_step.replay`) on CPU, after the same
checks on both (:func:`mamba3_step.replay_validation.check_replay_inputs`).

While traced (``torch.compile``, or FakeTensors), the call goes through the registered custom op
``torch.ops.mamba3_step.step`` instead, whose fake implementation validates the same way and whose
real implementation is this function. The op is reached through ``torch.ops`` by name, not by an
import (``mamba3_step.ops`` sits above this module; the package's ``__init__`` registers it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

from .contract import new_out, out_shape
from .launch import launch_step
from .reference import mamba3_step_reference
from .replay import replay_step
from .replay_validation import check_replay_inputs, is_replay_call
from .signature import OP_ORDER, StepOptions, op_values, validated_options
from .spec import StepSpec
from .tensors import Ring, StepTensors
from .validation import check_indices, check_options, check_step_inputs_cached

__all__ = ["PreparedStep", "check_index_values", "host_step", "mamba3_step_fn", "prepare_step", "run_step",
           "runs_kernel", "step_through_op"]

_pack = tuple.__new__  # _pack(StepTensors, values): a NamedTuple without its Python-level __new__


def mamba3_step_fn(
    state: torch.Tensor,
    Bstate: torch.Tensor,
    Xstate: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    trap: torch.Tensor,
    xproj: torch.Tensor,
    outproj: torch.Tensor | None = None,
    state_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    zproj: torch.Tensor | None = None,
    *,
    state_batch_indices: torch.Tensor | None = None,
    dst_state_batch_indices: torch.Tensor | None = None,
    null_slot_id: int | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    angle_state: torch.Tensor | None = None,
    angle_proj: torch.Tensor | None = None,
    B_bias: torch.Tensor | None = None,
    C_bias: torch.Tensor | None = None,
    rand_seed: torch.Tensor | None = None,
    rand_rows: torch.Tensor | None = None,
    state_scale: torch.Tensor | None = None,
    replay_ring: Ring | None = None,
    update_kv_state: bool = False,
    tile_D: int | None = None,
    num_warps: int | None = None,
    validate_indices: bool = False,
    rotate_pairwise: bool = False,
    stochastic_rounding: bool = False,
    replay_flush_length: int | None = None,
    replay_from_checkpoint: bool = False,
) -> torch.Tensor:
    """One Mamba-3 MIMO decode step, dense or over a pool of recurrent-state rows.

    Letters: B batch lanes (taken from ``x``), T tokens per lane, P pool rows, H heads, D head
    dim, N state size (dstate), R MIMO rank, K candidate source rows (a (B, K)
    ``state_batch_indices``). ``rows`` below is P in pool
    mode and B in dense mode; ``[T]`` is an axis only a multi-token step has.

    ==========================  ======================  ================================
    argument                    shape                   dtype
    ==========================  ======================  ================================
    state (in place)            (rows, H, D, N)         float32, bfloat16, float16, int8 or
                                                        float8_e4m3fn
    Bstate (previous B)         (rows, R, H, N)         same as B
    Xstate (previous x)         (rows, H, D)            same as x
    A, dt, trap                 (B, [T,] H)             float32
    B, C                        (B, [T,] R, H, N), or   bfloat16, float16 or float32
                                (B, [T,] R, 1, N)
    D                           (H,)                    float32
    x, z (z optional)           (B, [T,] H, D)          bfloat16, float16 or float32
    xproj, zproj, outproj       (R, H, D)               one dtype: float32, bfloat16, float16
    state_out (dense only)      (B, H, D, N)            same as state
    out (optional)              (B, [T,] H, D) with     same as x
                                outproj, else
                                (B, [T,] R, H, D)
    state_batch_indices         (B,), or (B, K) with    int32
                                num_accepted_tokens
    dst_state_batch_indices     (B,), or (B, T)         int32
    num_accepted_tokens         (B,)                    int32
    angle_state (in place)      (rows, H, S)            int64 (fixed-point turns)
    angle_proj                  (B, [T,] H, S)          float32
    B_bias, C_bias              (R, H, N)               float32
    rand_seed                   (2,): [seed, offset]    int64
    rand_rows (dense only)      (B,)                    int32
    state_scale (in place;      (rows, H, D)            float32
    8-bit state only)
    replay_ring (in place)      a Ring (new_ring)       the ring's (docs/contract.md)
    ==========================  ======================  ================================

    Math per lane and head (accumulated in float32): see docs/contract.md or
    :func:`mamba3_step.reference.step_math`.

    Dense mode (``state_batch_indices`` None): lane b uses row b of ``state``/``Bstate``/
    ``Xstate``. The new state is written to ``state_out`` if given, else into ``state``.

    Pool mode (``state_batch_indices`` given): lane b reads row ``src = state_batch_indices[b]``
    and writes the new state to row ``dst = dst_state_batch_indices[b]`` (default ``src``).
    A lane whose ``src`` is negative, ``>= P`` or equal to ``null_slot_id`` is padding: its
    ``out`` is written as zeros and it reads and writes no pool row. A live lane whose ``dst``
    is padding computes ``out`` and writes no row. ``P`` is independent of ``B``. Live lanes
    must not share a ``dst``, and no lane's ``dst`` may be another live lane's ``src`` (a
    race; unchecked unless ``validate_indices=True``).

    Multi-token steps (speculative decoding's verify pass): ``x`` (B, T, H, D) gives every
    per-lane tensor and ``out`` a token axis, and the call is T one-token steps per lane in
    order, bit for bit (token ``t``'s previous B/x are token ``t - 1``'s; the state carries in
    its own dtype); ``T`` (at most 16) is compile-time. ``num_accepted_tokens`` (B,) with a
    (B, K) ``state_batch_indices`` reads lane b's source row at
    ``state_batch_indices[b, num_accepted_tokens[b] - 1]`` (a count outside [1, K] makes the lane
    padding). A (B, T) ``dst_state_batch_indices`` writes the state after token ``t`` (and with
    ``update_kv_state`` token ``t``'s B/x) to row ``dst[b, t]``; a (B,) one, or none, writes only
    the final state. Details: docs/contract.md, "Multi-token steps".

    Rotary (Mamba-3's fourth per-request state; docs/contract.md, "Rotary angle"): with
    ``angle_state`` (S angles per head, a fixed-point fraction of a turn:
    :func:`mamba3_step.angle_from_radians` converts upstream's radians) and ``angle_proj``, each
    token advances the angle row by ``tanh(angle_proj) * dt * pi`` radians, rotates ``B`` and
    ``C`` (plus ``B_bias``/``C_bias`` when given) by it, pairing element i with i + N/2 (or
    2i with 2i + 1 with ``rotate_pairwise``) for i < S, and steps with the rotated B/C; the new
    angle is written wherever the state is (same rows, padding and destinations), and with
    ``update_kv_state`` the rotated B goes to ``Bstate``. ``B``/``C`` may have a head axis of 1
    (shared by every head), with or without rotary.

    In-place effects: the new state goes to ``state`` (rows ``dst`` in pool mode, all rows in
    dense mode) or ``state_out``; ``out`` is overwritten; with ``update_kv_state=True`` this
    step's ``B`` and ``x`` are stored (cast) into the same rows of ``Bstate`` and ``Xstate``,
    after the step has read the old ones. Nothing else is written.

    Args:
        null_slot_id: a pool row reserved as the null block (pool mode only), or None.
        num_accepted_tokens: see "Multi-token steps" above (pool mode only).
        update_kv_state: store this step's B/x into Bstate/Xstate. Needs ``tile_D >= D``
            (ValueError otherwise; the tile is never changed silently).
        tile_D, num_warps: kernel tiling (CUDA only); None picks the per-configuration
            default (``tile_D = D``). ``tile_D`` must be a power of two dividing D;
            ``num_warps`` one of 1, 2, 4, 8, 16.
        validate_indices: check index values first (range, duplicate destinations,
            destination/source overlap). It synchronises the device and raises RuntimeError
            under CUDA-graph capture; leave it False on the hot path.
        angle_state, angle_proj, B_bias, C_bias: the rotary angle rows (written in place), this
            step's angle projection (a stride-0 head axis is read without a copy) and the
            optional biases; see "Rotary" above. ``angle_state`` needs ``tile_D >= D``.
        rotate_pairwise: rotary pairs (2i, 2i + 1) (upstream's SISO layout) instead of
            (i, i + N/2).
        stochastic_rounding, rand_seed: store a 16-bit state with stochastic rounding (unbiased),
            its random bits a counter-based function (Philox4x32-10) of ``rand_seed``'s
            ``[seed, offset]`` (read on the device: advance the offset in-graph for fresh bits),
            the row written, the head, d and n; token t of a T-token step draws at offset + t.
            The CPU path draws the kernel's bits exactly (docs/contract.md, "Stochastic rounding").
        rand_rows: dense mode with stochastic rounding: lane b draws the bits of row
            ``rand_rows[b]`` instead of row b (a dense step on gathered rows then stores the bits a
            pool step would: how the gather -> dense -> scatter baseline matches pool mode).
        state_scale: with an 8-bit ``state`` (int8 or float8_e4m3fn; required then, and
            ``stochastic_rounding=True``): its fp32 scale per (row, head, d), read and written
            wherever the state is. The state is read as ``q * scale``; each store sets
            ``scale = absmax over N / Q`` (Q = 127, or 448 for e4m3) and quantises with
            stochastic rounding (docs/contract.md, "8-bit states").
        replay_ring, replay_flush_length, replay_from_checkpoint: the replay mode (docs/contract.md,
            "Replay"): a pool-mode step with ``update_kv_state=True`` whose ``state`` rows are
            checkpoints, ``Bstate``/``Xstate`` the tokens before the ring ``replay_ring`` (a
            :class:`~mamba3_step.Ring` of :func:`~mamba3_step.new_ring`, written in place). A
            one-token step appends the token to its row's ring, or, once the ring holds
            ``replay_flush_length - 1`` committed tokens (an int in [2, 16], required with the ring),
            replays them and the token on the checkpoint and writes the new checkpoint (a flush); a
            T-token step is a verify step whose drafts stay in the ring uncommitted, and
            ``num_accepted_tokens`` (B,) (with a (B,) ``state_batch_indices``) first commits that
            many of each lane's pending drafts. Every ``out`` is stepwise decoding's, bit for bit;
            with ``replay_from_checkpoint`` an append's and a verify step's drafts' ``out`` come from
            the checkpoint and the ring instead (no state replayed). Every device runs the same
            checks (:func:`mamba3_step.replay_validation.check_replay_inputs`).

    Constraints: N in {32, 64, 128, 256}, D in {32, 64, 128}, R in {1, 2, 4, 8}; S in
    [1, N/2]; all tensors on
    one device; every innermost stride 1; ``state``/``state_out`` 16-byte aligned (base and
    every outer stride); B <= 2**31 - 1 and H <= 65535. ``B == 0`` returns ``out`` without
    launching anything.

    Devices: CUDA tensors run the CuteDSL kernel (on the current stream; no allocation except
    ``out`` when it is None, no synchronisation unless ``validate_indices``). CPU tensors run
    the PyTorch implementation of the same contract (:mod:`mamba3_step.reference`) in float32,
    without autograd. Meta tensors are validated and nothing is computed. Under
    ``torch.compile`` (or with FakeTensors) the call is traced as ``torch.ops.mamba3_step.step``.

    Validation runs in full once per call signature (shapes, strides, dtypes, devices, flags,
    options); a repeated signature costs a guard and the address checks
    (:mod:`mamba3_step.validation.cache`). :func:`mamba3_step.plan_step` validates a signature
    once for a serving loop (``StepPlan.run`` per step).

    A call that raises has written nothing. Written tensors (``out``, ``state``/``state_out``,
    ``Bstate``/``Xstate`` with ``update_kv_state``) must not require grad, must be writable
    here, and must share no memory with themselves or with any other argument.

    Returns:
        ``out``.

    Raises:
        TypeError, ValueError: invalid inputs, naming the argument
            (:func:`mamba3_step.validation.check_step_inputs`).
    """
    values = (state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, state_out, out, z, zproj,
              state_batch_indices, dst_state_batch_indices, null_slot_id, num_accepted_tokens, angle_state, angle_proj,
              B_bias, C_bias, rand_seed, rand_rows, state_scale, replay_ring)
    options = (update_kv_state, tile_D, num_warps, validate_indices, rotate_pairwise, stochastic_rounding,
               replay_flush_length, replay_from_checkpoint)
    if torch.compiler.is_compiling():  # the NamedTuples' own constructors: what every dynamo can trace
        return step_through_op(StepTensors(*values), StepOptions(*options))
    # the hot path: the bundles without their Python-level __new__
    return _run_uncompiled(_pack(StepTensors, values), _pack(StepOptions, options))


def run_step(tensors: StepTensors, options: StepOptions) -> torch.Tensor:
    """:func:`mamba3_step_fn` on a packed call: what every entry point that takes the whole call
    runs (the custom op's real implementation included). Returns ``out``."""
    if torch.compiler.is_compiling():
        return step_through_op(tensors, options)
    return _run_uncompiled(tensors, options)


def _run_uncompiled(tensors: StepTensors, options: StepOptions) -> torch.Tensor:
    """:func:`run_step` outside a ``torch.compile`` trace (FakeTensors still go through the op)."""
    x = tensors.x
    if type(x) is not torch.Tensor and isinstance(x, torch.Tensor) and is_fake(x):
        return step_through_op(tensors, options)
    spec, tensors, out = _prepare(tensors, options)
    if tensors.x.shape[0] == 0 or x.is_meta:
        return out  # meta tensors: validated, shapes only
    if runs_kernel(x):
        launch_step(spec, tensors)  # the CuteDSL kernel; compiled once per specialisation
    else:
        host_step(spec, tensors)
    return out


def runs_kernel(x: torch.Tensor) -> bool:
    """Whether a step whose ``x`` is ``x`` runs the CuteDSL kernel (CUDA tensors) rather than
    :func:`host_step` (``bench/bench_host.py`` replaces this to time the CUDA path on the CPU).
    An ``x`` that is no tensor goes to the CPU path, whose checks name it."""
    return isinstance(x, torch.Tensor) and x.is_cuda


def host_step(spec: StepSpec, tensors: StepTensors) -> None:
    """The step on CPU tensors: the PyTorch implementation of the contract, in float32; with a replay
    ring (``spec.replay_ring``, the flush length) replay's CPU path (:func:`mamba3_step.replay.replay_step`,
    every ``out`` stepwise decoding's unless ``replay_from_checkpoint``)."""
    if spec.replay_ring:
        ring, accepted = tensors.replay_ring, tensors.num_accepted_tokens
        replay_step(tensors._replace(replay_ring=None, num_accepted_tokens=None), ring, spec.replay_ring,
                    num_accepted_tokens=accepted, rotate_pairwise=spec.rotate_pairwise,
                    exact_outputs=not spec.replay_from_checkpoint)
        return
    mamba3_step_reference(tensors, update_kv_state=spec.update_kv_state, rotate_pairwise=spec.rotate_pairwise,
                          stochastic_rounding=spec.stochastic_rounding, compute_dtype=torch.float32)


class PreparedStep(NamedTuple):
    """What :func:`prepare_step` hands an executor."""

    spec: StepSpec  # the specialisation, tiling filled in
    tensors: StepTensors  # the kernel's form of the call (``out`` set; a one-token axis squeezed)
    out: torch.Tensor  # what the call returns: ``out`` in the caller's shape


def prepare_step(tensors: StepTensors, **options) -> PreparedStep:
    """Everything :func:`mamba3_step_fn` does before the work itself, for every executor.

    ``options`` are :class:`~mamba3_step.signature.StepOptions` fields. Validates the inputs
    (raising what :func:`mamba3_step_fn` documents; through
    :func:`mamba3_step.validation.check_step_inputs_cached`, so a repeated call signature is
    validated once and afterwards only its addresses are checked), allocates ``out``
    when it is None, views a one-token step given with a token axis as the plain step
    (:meth:`StepTensors.one_token_squeezed`), and with ``validate_indices`` checks the index
    values (pool mode, ``B > 0``). With ``B == 0`` the caller returns ``out`` at once.
    """
    return PreparedStep(*_prepare(tensors, StepOptions(**options)))


def _prepare(tensors: StepTensors, options: StepOptions) -> tuple:
    """:func:`prepare_step` as a plain tuple ``(spec, tensors, out)`` (what the hot path unpacks)."""
    update_kv_state, tile_D, num_warps, validate_indices, rotate_pairwise, stochastic_rounding, flush, anchored = options
    if type(validate_indices) is not bool:
        validate_indices = check_options(validate_indices=validate_indices)["validate_indices"]  # raises
    if tensors.replay_ring is None and flush is None and anchored is False:
        spec = check_step_inputs_cached(tensors, update_kv_state=update_kv_state, tile_D=tile_D, num_warps=num_warps,
                                        rotate_pairwise=rotate_pairwise, stochastic_rounding=stochastic_rounding)
    else:  # the replay mode: the same checks on every device (mamba3_step.replay_validation)
        spec = check_replay_inputs(tensors, options)
    if tensors.null_slot_id is not None and type(tensors.null_slot_id) is not int:
        tensors = tensors._replace(null_slot_id=int(tensors.null_slot_id))  # e.g. a numpy integer
    tensors = tensors.with_out()
    out = tensors.out
    tensors = tensors.one_token_squeezed()
    if validate_indices:
        check_index_values(tensors)
    return spec, tensors, out


def check_index_values(tensors: StepTensors) -> None:
    """What ``validate_indices=True`` adds to a validated call: in pool mode with ``B > 0``,
    :func:`mamba3_step.validation.check_indices` (it synchronises); meta tensors are refused
    (they hold no values). With a replay ring ``num_accepted_tokens`` are drafts to commit, not
    sources to pick: only the rows are checked."""
    if tensors.replay_ring is not None:
        tensors = tensors._replace(num_accepted_tokens=None)
    if not tensors.pool:
        return
    if tensors.x.device.type == "meta":
        raise ValueError("validate_indices: expected index tensors holding values, got meta tensors "
                         "(pass validate_indices=False to check shapes only)")
    if tensors.batch > 0:
        check_indices(tensors.state_batch_indices, tensors.dst_state_batch_indices, tensors.state.shape[0],
                      tensors.null_slot_id, tensors.num_accepted_tokens)


def step_through_op(tensors: StepTensors, options: StepOptions = StepOptions()) -> torch.Tensor:
    """The step as one call of ``torch.ops.mamba3_step.step`` (what a tracer records); returns ``out``.

    The options are type-checked first (numpy integers become ints), so the op sees exactly what
    :func:`mamba3_step_fn` accepts; ``out`` is allocated (x's dtype and device) when it is None.
    The op's arguments are passed by position, in :data:`mamba3_step.signature.OP_ORDER`.
    """
    checked = check_options(null_slot_id=tensors.null_slot_id, **dict(zip(StepOptions._fields, options)))
    if not torch.compiler.is_compiling():
        # Outside a trace the whole call is checked first, so the dispatcher never sees what it
        # would refuse without naming it (a nested or sparse tensor: no kernel for its backend; an
        # int beyond the Scalar's 64 bits: OverflowError). A trace checks in the op's fake.
        options = StepOptions(**{name: checked[name] for name in StepOptions._fields})
        if is_replay_call(tensors, options):
            check_replay_inputs(tensors, options)
        else:
            check_step_inputs_cached(tensors, **validated_options(checked))
    out = tensors.out if tensors.out is not None else _new_out(tensors)
    call = op_values(tensors, checked)  # checked: the options and null_slot_id
    call["out"] = out
    # by position: a keyword named "out" makes a tracer take the call for an out= variant
    torch.ops.mamba3_step.step(*[call[name] for name in OP_ORDER])
    return out


def _new_out(t: StepTensors):
    """A fresh ``out`` for ``t`` (x's dtype and device), or, when ``x``/``xproj`` are too malformed to
    say its shape, an empty stand-in: the op's validation then reports what is wrong with them."""
    x, xproj = t.x, t.xproj
    if not isinstance(x, torch.Tensor):
        return torch.empty(0)
    if not isinstance(xproj, torch.Tensor) or x.dim() not in (3, 4) or xproj.dim() != 3:
        return torch.empty(0, dtype=x.dtype, device=x.device)
    return new_out(x, out_shape(x, xproj, t.outproj is not None))
