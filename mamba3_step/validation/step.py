"""``check_step_inputs``: every argument of one step checked against ``validation.table``, in phases.

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.

The phases run in this order, so that the first problem reported is the most basic one: kinds
of argument, mode flags, the optional axes (token axis, per-token destinations, accepted-token
sources: :class:`~mamba3_step.validation.table.Layout`), shapes (the letters come from ``x`` and ``B``), supported sizes,
dtypes (groups, then "same as"), devices, strides, alignment, launch grid, written tensors
(writable in place, no self-overlap), aliasing (no written tensor shares memory with another
argument), tiling. Each phase walks the table rows in order. Only metadata is read (shapes, strides,
dtypes, flags, data pointers): no synchronisation, safe under capture. The result depends on
those, on the options and on one global, whether ``torch.inference_mode`` is on.
"""

from __future__ import annotations

import torch

from ..contract import INT32_MAX, INT32_MIN, MAX_GRID_X, MAX_GRID_Y, ROUNDED_STATE_DTYPES, SCALED_STATE_DTYPES
from ..spec import MAX_TOKENS, StepSpec
from ..tensors import StepTensors
from ..tiling import MAX_CLUSTER_CTAS, kv_split_fits, shape_problem, tiling_problem
from . import checks
from .table import LETTER_SOURCES, RULE_BY_NAME, RULES, Layout, is_written, shape_letters

__all__ = ["check_options", "check_step_inputs", "check_tiling_options", "check_weights"]


def check_options(*, null_slot_id=None, update_kv_state=False, tile_D=None, num_warps=None,
                  validate_indices=False, rotate_pairwise=False, stochastic_rounding=False,
                  replay_flush_length=None, replay_from_checkpoint=False) -> dict:
    """The step's non-tensor options, type-checked, as a dict of the same names.

    Integers may be any ``numbers.Integral`` but bool (numpy integers become ints); flags must be
    real bools. Raises TypeError naming the option.
    """
    return dict(
        null_slot_id=checks.check_int_option("null_slot_id", null_slot_id),
        update_kv_state=checks.check_bool_option("update_kv_state", update_kv_state),
        tile_D=checks.check_int_option("tile_D", tile_D),
        num_warps=checks.check_int_option("num_warps", num_warps),
        validate_indices=checks.check_bool_option("validate_indices", validate_indices),
        rotate_pairwise=checks.check_bool_option("rotate_pairwise", rotate_pairwise),
        stochastic_rounding=checks.check_bool_option("stochastic_rounding", stochastic_rounding),
        replay_flush_length=checks.check_int_option("replay_flush_length", replay_flush_length),
        replay_from_checkpoint=checks.check_bool_option("replay_from_checkpoint", replay_from_checkpoint),
    )


def check_step_inputs(tensors: StepTensors, *, update_kv_state=False, tile_D=None, num_warps=None,
                      rotate_pairwise=False, stochastic_rounding=False) -> StepSpec:
    """Check every input of a step (metadata only) and return its complete StepSpec.

    ``tensors`` holds ``mamba3_step_fn``'s tensor arguments and ``null_slot_id`` (see its
    docstring for shapes and dtypes); ``out`` may be None (the caller allocates it).

    Returns:
        The :class:`StepSpec` of this call with ``tile_D``/``num_warps`` filled: the user's
        values where given, the per-configuration default otherwise.

    Raises:
        TypeError: a non-tensor where a tensor belongs; an unsupported or mismatched dtype;
            indices that are not int32; a non-int ``null_slot_id``/``tile_D``/``num_warps``; a
            non-bool ``update_kv_state``.
        ValueError: wrong ranks or shapes; unsupported N/D/R; tensors on different devices;
            a non-unit innermost stride; a row spanning more than 2**31 - 1 elements (32-bit
            offsets below the first dimension); ``state``/``state_out`` not 16-byte aligned;
            a written tensor (``out``, ``state``/``state_out``, ``Bstate``/``Xstate`` with
            ``update_kv_state``) that requires grad, is an inference tensor outside inference
            mode, has elements sharing memory, or shares memory with any other argument;
            ``state_out`` in pool mode; ``dst_state_batch_indices`` without
            ``state_batch_indices``; ``null_slot_id`` without pool mode; ``z`` without
            ``zproj`` or the reverse; a token count T outside [1, MAX_TOKENS]; a (B, T)
            ``dst_state_batch_indices`` without a token axis; ``num_accepted_tokens`` without a
            (B, K) ``state_batch_indices`` (K >= 1) or the reverse; a batch or head count too large for the launch grid;
            an impossible ``tile_D``/``num_warps`` (including ``update_kv_state`` with
            ``headdim / tile_D`` above the cluster size, 8).
    """
    for rule in RULES:
        checks.check_is_tensor(rule.name, getattr(tensors, rule.name), optional=not rule.required)
    options = check_options(null_slot_id=tensors.null_slot_id, update_kv_state=update_kv_state, tile_D=tile_D,
                            num_warps=num_warps, rotate_pairwise=rotate_pairwise,
                            stochastic_rounding=stochastic_rounding)
    null_slot_id, tile_D, num_warps = options["null_slot_id"], options["tile_D"], options["num_warps"]
    _check_modes(tensors, null_slot_id)
    _check_rotary_modes(tensors, rotate_pairwise)
    _check_rounding_modes(tensors, stochastic_rounding)
    layout = _check_layout(tensors)
    N, Dh, R, layout = _check_shapes(tensors, layout)
    dtypes = _check_dtypes(tensors)
    _check_scaled_state(tensors, dtypes["state_dtype"], stochastic_rounding)
    _check_memory(tensors)
    _check_grid(tensors)
    _check_writes(tensors, update_kv_state)
    spec = StepSpec(
        dstate=N, headdim=Dh, mimo=R, **dtypes,
        tile_D=tile_D or 0, num_warps=num_warps or 0,
        pool=tensors.pool, has_dst=tensors.dst_state_batch_indices is not None,
        update_kv_state=update_kv_state, has_z=tensors.z is not None,
        has_outproj=tensors.outproj is not None, has_state_out=tensors.state_out is not None,
        tokens=tensors.tokens, dst_per_token=layout.per_token_dst and tensors.tokens > 1,
        num_accepted=layout.accepted,
        rope_angles=0 if tensors.angle_state is None else int(tensors.angle_state.shape[-1]),
        rotate_pairwise=rotate_pairwise, has_bc_bias=tensors.B_bias is not None, shared_bc=layout.shared_bc,
        stochastic_rounding=stochastic_rounding, has_rand_rows=tensors.rand_rows is not None,
        padded_state_rows=padded_state_rows(tensors, N),
    )
    return _check_tiling(spec, tile_D, num_warps)


def padded_state_rows(t: StepTensors, N: int) -> bool:
    """Whether ``state`` or ``state_out`` steps along D by other than N elements (StepSpec's
    ``padded_state_rows``). A D of one element is never stepped along: its stride does not count."""
    return any(s is not None and s.shape[-2] > 1 and s.stride(-2) != N for s in (t.state, t.state_out))


def _check_modes(t: StepTensors, null_slot_id) -> None:
    pool = t.pool
    if t.dst_state_batch_indices is not None and not pool:
        raise ValueError(
            "dst_state_batch_indices: expected None without state_batch_indices (a separate "
            "destination only exists in pool mode), got a tensor"
        )
    if pool and t.state_out is not None:
        raise ValueError(
            "state_out: expected None in pool mode (state_batch_indices given: the new state "
            "goes to the pool rows dst_state_batch_indices, default state_batch_indices), got a tensor"
        )
    if null_slot_id is not None and not pool:
        raise ValueError(
            f"null_slot_id: expected None without state_batch_indices (it marks padding lanes "
            f"in pool mode only), got {null_slot_id}"
        )
    if null_slot_id is not None and not INT32_MIN <= null_slot_id <= INT32_MAX:
        raise ValueError(f"null_slot_id: expected an int32 value, got {null_slot_id}")
    if (t.z is None) != (t.zproj is None):
        missing, given = ("zproj", "z") if t.zproj is None else ("z", "zproj")
        raise ValueError(f"{missing}: expected a tensor because {given} is given (z and zproj come together), got None")


def _check_rotary_modes(t: StepTensors, rotate_pairwise: bool) -> None:
    """``angle_state`` and ``angle_proj`` come together; the biases come together and need them;
    ``rotate_pairwise`` needs them."""
    if (t.angle_state is None) != (t.angle_proj is None):
        missing, given = ("angle_proj", "angle_state") if t.angle_proj is None else ("angle_state", "angle_proj")
        raise ValueError(f"{missing}: expected a tensor because {given} is given (the rotary angle and its "
                         f"projection come together), got None")
    if (t.B_bias is None) != (t.C_bias is None):
        missing, given = ("C_bias", "B_bias") if t.C_bias is None else ("B_bias", "C_bias")
        raise ValueError(f"{missing}: expected a tensor because {given} is given (B_bias and C_bias come "
                         f"together), got None")
    if t.angle_state is None and t.B_bias is not None:
        raise ValueError("B_bias: expected None without angle_state (the biases are added before the rotary "
                         "rotation), got a tensor")
    if t.angle_state is None and rotate_pairwise:
        raise ValueError("rotate_pairwise: expected False without angle_state (it chooses the rotary pairs), "
                         "got True")


def _check_rounding_modes(t: StepTensors, stochastic_rounding: bool) -> None:
    """``rand_seed`` exactly with ``stochastic_rounding``; a 16-bit state (checked with the dtypes
    below, where the state's dtype is known to be a tensor's)."""
    if stochastic_rounding and t.rand_seed is None:
        raise ValueError("rand_seed: expected an int64 tensor [seed, offset] on the state's device because "
                         "stochastic_rounding=True, got None")
    if not stochastic_rounding and t.rand_seed is not None:
        raise ValueError("rand_seed: expected None without stochastic_rounding=True (it seeds the stochastic "
                         "rounding of the state's store), got a tensor")
    if t.rand_rows is not None and (t.pool or not stochastic_rounding):
        raise ValueError("rand_rows: expected None except in dense mode with stochastic_rounding=True (it names "
                         "the row each lane's random bits are drawn for; pool mode draws for the row written), "
                         "got a tensor")


def _check_scaled_state(t: StepTensors, state_dtype: str, stochastic_rounding: bool) -> None:
    """A rounded state (16- or 8-bit) for ``stochastic_rounding``; an 8-bit state comes with
    ``state_scale``, is always rounded stochastically and is updated in place (docs/contract.md,
    "8-bit states")."""
    if stochastic_rounding and state_dtype not in ROUNDED_STATE_DTYPES:
        raise ValueError(f"stochastic_rounding: expected a 16- or 8-bit state ({', '.join(ROUNDED_STATE_DTYPES)}: a "
                         f"float32 state is stored exactly as computed), got state dtype {state_dtype}")
    scaled = state_dtype in SCALED_STATE_DTYPES
    if scaled and t.state_scale is None:
        raise ValueError(f"state_scale: expected a float32 tensor (rows, H, D) of the {state_dtype} state's scales, "
                         "got None")
    if not scaled and t.state_scale is not None:
        raise ValueError(f"state_scale: expected None with a {state_dtype} state (scales belong to an 8-bit state: "
                         f"{', '.join(SCALED_STATE_DTYPES)}), got a tensor")
    if scaled and not stochastic_rounding:
        raise ValueError(f"stochastic_rounding: expected True with a {state_dtype} state (an 8-bit state is always "
                         "stored with stochastic rounding: rounding to nearest stalls it), got False")
    if scaled and t.state_out is not None:
        raise ValueError(f"state_out: expected None with a {state_dtype} state (an 8-bit state and its scales are "
                         "updated in place), got a tensor")


def _check_layout(t: StepTensors) -> Layout:
    """The call's optional axes, from the ranks of ``x``, ``state_batch_indices`` and
    ``dst_state_batch_indices`` and the presence of ``num_accepted_tokens``."""
    if t.x.dim() not in (3, 4):
        raise ValueError(f"x: expected a 3-D tensor (B, H, D), or 4-D (B, T, H, D) for T tokens per lane, "
                         f"got {t.x.dim()}-D with shape {tuple(t.x.shape)}")
    tokens = t.x.dim() == 4
    if tokens and not 1 <= t.x.shape[1] <= MAX_TOKENS:
        raise ValueError(f"x: expected T (dimension 1 of x (B, T, H, D)) in [1, {MAX_TOKENS}], got T={t.x.shape[1]}")
    src, dst, accepted = t.state_batch_indices, t.dst_state_batch_indices, t.num_accepted_tokens is not None
    if accepted and src is None:
        raise ValueError("num_accepted_tokens: expected None without state_batch_indices (it picks each lane's "
                         "source row among its pool indices), got a tensor")
    if src is not None and src.dim() == 2 and not accepted:
        raise ValueError("num_accepted_tokens: expected a (B,) int32 tensor because state_batch_indices is 2-D "
                         "(B, K) (lane b reads row state_batch_indices[b, num_accepted_tokens[b] - 1]), got None")
    if accepted and src.dim() != 2:
        raise ValueError(f"state_batch_indices: expected a 2-D tensor (B, K) with num_accepted_tokens (K "
                         f"candidate source rows per lane), got {src.dim()}-D with shape {tuple(src.shape)}")
    if accepted and src.shape[1] == 0:
        raise ValueError(f"state_batch_indices: expected K >= 1 candidate source rows per lane, got shape "
                         f"{tuple(src.shape)}")
    per_token_dst = dst is not None and dst.dim() == 2
    if per_token_dst and not tokens:
        raise ValueError(f"dst_state_batch_indices: expected a 1-D tensor (B,) (a (B, T) destination per token "
                         f"needs x with a token axis, (B, T, H, D)), got shape {tuple(dst.shape)}")
    return Layout(t.pool, t.outproj is not None, tokens, per_token_dst, accepted)


def _check_shapes(t: StepTensors, layout: Layout) -> tuple:
    """Ranks of the letter sources, then every shape against the letters; returns (N, D, R) and
    the layout with ``shared_bc`` decided (B's head axis is 1 while H is not)."""
    why = (" because x is 4-D (B, T, H, D), a step of T tokens per lane" if layout.tokens else
           " because x is 3-D (B, H, D), a step without a token axis")
    for name in LETTER_SOURCES:
        checks.check_rank(name, getattr(t, name), shape_letters(RULE_BY_NAME[name], layout), why)
    nb, H, Dh = t.x.shape[0], t.x.shape[-2], t.x.shape[-1]
    R, N = t.B.shape[-3], t.B.shape[-1]
    layout = layout._replace(shared_bc=bool(t.B.shape[-2] == 1 and H != 1))
    checks.check_rank("state", t.state, "P H D N" if layout.pool else "B H D N")
    angles = t.angle_state if t.angle_state is not None else t.angle_proj
    sizes = {"B": nb, "T": t.tokens, "P": t.state.shape[0] if layout.pool else nb, "H": H, "D": Dh, "N": N,
             "R": R, "K": t.state_batch_indices.shape[-1] if layout.accepted else 0, "1": 1,
             "S": angles.shape[-1] if angles is not None and angles.dim() >= 1 else 0, "2": 2}
    for rule in RULES:
        value = getattr(t, rule.name)
        if value is not None:
            letters = shape_letters(rule, layout)
            checks.check_shape(rule.name, value, letters, tuple(sizes[c] for c in letters.split()))
    problem = shape_problem(N, Dh, R)
    if problem:
        raise ValueError(f"unsupported shape (from x (B, H, D) and B (B, R, H, N)): {problem}")
    if angles is not None and not 1 <= sizes["S"] <= N // 2:
        raise ValueError(f"angle_state: expected S (its last dimension, the rotary angles per head) in "
                         f"[1, N/2 = {N // 2}] (each angle rotates one pair of B/C's N elements), got S={sizes['S']}")
    # compile-time sizes of the specialisation: plain ints even when a tracer made them symbolic
    return int(N), int(Dh), int(R), layout


def _check_dtypes(t: StepTensors) -> dict:
    """Group and single-dtype rules first, then "same as" rules; returns the spec's dtype names."""
    names = {}
    for rule in RULES:
        value = getattr(t, rule.name)
        if value is not None and rule.dtypes:
            names[rule.name] = checks.check_dtype(rule.name, value, rule.dtypes, rule.hint)
    for rule in RULES:
        value = getattr(t, rule.name)
        if value is not None and rule.same_as:
            checks.check_dtype_same(rule.name, value, rule.same_as, getattr(t, rule.same_as))
    return dict(state_dtype=names["state"], kv_dtype=names["B"], x_dtype=names["x"],
                proj_dtype=names["xproj"])


def _check_memory(t: StepTensors) -> None:
    """One device (x's), unit innermost strides, 16-byte alignment where the kernel vectorises."""
    present = [(rule, getattr(t, rule.name)) for rule in RULES if getattr(t, rule.name) is not None]
    for rule, value in present:
        checks.check_device(rule.name, value, t.x.device)
    for rule, value in present:
        checks.check_unit_inner_stride(rule.name, value)
        checks.check_inner_offsets_int32(rule.name, value)
    for rule, value in present:
        if rule.vector_aligned:
            checks.check_vector_aligned(rule.name, value)


def _check_writes(t: StepTensors, update_kv_state: bool) -> None:
    """Written tensors: writable in place, no element sharing memory with another, and no byte
    shared with any other argument (docs/contract.md, "Written tensors and aliasing")."""
    present = [(rule, getattr(t, rule.name)) for rule in RULES if getattr(t, rule.name) is not None]
    has_state_out = t.state_out is not None
    written = {rule.name for rule, _ in present if is_written(rule, has_state_out, update_kv_state)}
    inference_mode = torch.is_inference_mode_enabled()
    for rule, value in present:
        if rule.name in written:
            checks.check_write_target(rule.name, value, inference_mode)
            checks.check_no_internal_overlap(rule.name, value)
    spans = {rule.name: checks.byte_span(value) for rule, value in present}
    for rule, _ in present:
        if rule.name in written and spans[rule.name] is not None:
            for other, _ in present:
                if other.name != rule.name:
                    checks.check_disjoint(rule.name, spans[rule.name], other.name, spans[other.name],
                                          other.name in written)


def _check_grid(t: StepTensors) -> None:
    """The launch grid is (B, H, D / tile_D)."""
    nb, H = t.x.shape[0], t.x.shape[-2]
    if nb > MAX_GRID_X:
        raise ValueError(
            f"x: batch B={nb} is too large for the launch grid (grid.x = B must be at most "
            f"{MAX_GRID_X}); split the batch"
        )
    if H > MAX_GRID_Y:
        raise ValueError(
            f"state: H={H} heads is too many for the launch grid (grid.y = H must be at most "
            f"{MAX_GRID_Y})"
        )


def check_tiling_options(tile_D, num_warps) -> tuple:
    """``(tile_D, num_warps)`` as ints or None (the default), each refused by name unless it is one
    (TypeError) or positive (ValueError)."""
    options = check_options(tile_D=tile_D, num_warps=num_warps)
    for name in ("tile_D", "num_warps"):
        if options[name] is not None and options[name] <= 0:
            raise ValueError(f"{name}: expected a positive int or None (the default), got {options[name]}")
    return options["tile_D"], options["num_warps"]


def _check_tiling(spec: StepSpec, tile_D, num_warps) -> StepSpec:
    check_tiling_options(tile_D, num_warps)
    spec = spec.with_default_tiling()
    if spec.update_kv_state and not kv_split_fits(spec.headdim, spec.tile_D):
        raise ValueError(
            f"tile_D: update_kv_state=True with tile_D < headdim runs the headdim / tile_D CTAs of a (lane, head) "
            f"as one cluster, at most {MAX_CLUSTER_CTAS}: expected tile_D >= {spec.headdim // MAX_CLUSTER_CTAS} "
            f"or None, got tile_D={spec.tile_D} (headdim={spec.headdim}); the tile is never changed silently"
        )
    if spec.rope_angles and spec.tile_D < spec.headdim:
        raise ValueError(
            f"tile_D: angle_state needs tile_D >= headdim (exactly one CTA owns each (lane, head) angle "
            f"row, or its update races), expected tile_D={spec.headdim} or None, got tile_D={spec.tile_D}"
        )
    problem = tiling_problem(spec)
    if problem:
        raise ValueError(
            f"tile_D/num_warps: {problem} (leave tile_D and num_warps None for the "
            f"per-configuration default)"
        )
    return spec


def check_weights(weights: dict, dims: dict, device: torch.device, why: str) -> None:
    """Layer weights given outside a step (``ReplayStatePool.materialize``), each by its row of the
    table: ``weights`` maps an argument name to its tensor (None where the row allows it); ``dims``
    maps the table's letters to sizes; ``device`` is where they must be, ``why`` says why (for the
    messages). TypeError/ValueError naming the argument."""
    for name, t in weights.items():
        rule = RULE_BY_NAME[name]
        checks.check_is_tensor(name, t, optional=not rule.required)
        if t is None:
            continue
        shape = tuple(int(c) if c.isdigit() else dims[c] for c in rule.letters.split())
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected a tensor of shape {shape} = ({', '.join(rule.letters.split())}) "
                             f"{why}, got {tuple(t.shape)}")
        ref = weights.get(rule.same_as) if rule.same_as else None
        if ref is not None:
            checks.check_dtype_same(name, t, rule.same_as, ref)
        elif not rule.same_as:
            checks.check_dtype(name, t, rule.dtypes, rule.hint)
        if t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} {why}, got {t.device}")
