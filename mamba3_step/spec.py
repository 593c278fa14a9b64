"""The static specialisation of the step kernel: one frozen description, one compile.

Letters (docs/contract.md): B batch lanes, P pool rows, H heads, D head dim, N state size
(dstate), R MIMO rank.

Everything that changes the generated code lives in :class:`StepSpec`; everything else
(``B``, ``P``, ``H``, every stride, ``null_slot_id``) is a runtime value and never
recompiles. The compile caches (in-memory and on disk) key on ``StepSpec`` itself, so a
new static field is automatically part of every key: there is no hand-kept tuple to go
stale. Defaults for the tiling come from the pure functions of :mod:`mamba3_step.tiling`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .contract import KV_DTYPES, PROJ_DTYPES, ROUNDED_STATE_DTYPES, SCALED_STATE_DTYPES, STATE_DTYPES, X_DTYPES
from .tiling import default_tiling, shape_problem, tiling_problem

__all__ = ["FLAGSHIP_HEADS", "FLUSH_DRAFTS", "KERNEL_CHOICE_FIELDS", "MAX_TOKENS", "PREVIOUS_LOAD_LAYOUTS", "StepSpec", "complete_spec", "flagship_rotary_spec",
           "flagship_spec", "flush_entries", "flush_groups", "flush_specs", "mode_problem", "replay_problem", "rotary_problem"]


@dataclass(frozen=True)
class StepSpec:
    """Static specialisation of one compiled step kernel.

    Attributes:
        dstate: N, the SSM state size.
        headdim: D, the head dimension.
        mimo: R, the MIMO rank.
        state_dtype: dtype of ``state`` / ``state_out``.
        kv_dtype: dtype of ``B``, ``C`` and ``Bstate``.
        x_dtype: dtype of ``x``, ``z``, ``Xstate`` and ``out``.
        proj_dtype: dtype of ``xproj``, ``zproj`` and ``outproj``.
        tile_D: rows of D handled by one CTA (``headdim % tile_D == 0``).
        num_warps: warps per CTA.
        pool: pool mode (``state_batch_indices`` given).
        has_dst: a separate ``dst_state_batch_indices`` (pool mode only).
        update_kv_state: store this step's B/x into the B/x states.
        has_z: gate with ``z`` / ``zproj``.
        has_outproj: reduce over R with ``outproj`` (out is (B, H, D), else (B, R, H, D)).
        has_state_out: dense mode writes the new state to ``state_out``.
        tokens: T, tokens per lane in this step (speculative decoding's verify pass: the
            state carries from token to token; 1 is the ordinary decode step).
        dst_per_token: ``dst_state_batch_indices`` is (B, T): the state after token t goes to
            row ``dst[b, t]`` (else (B,): only the final state is written).
        num_accepted: ``state_batch_indices`` is (B, K) and the source row of lane b is
            ``state_batch_indices[b, num_accepted_tokens[b] - 1]``; with ``replay_ring``,
            ``state_batch_indices`` stays (B,) and lane b first commits ``num_accepted_tokens[b]``
            drafts of its ring.
        rope_angles: S, the rotary angles per head (``angle_state`` (rows, H, S)); 0 without
            rotary. With S > 0 the step advances the angle and rotates B and C
            (docs/contract.md, "Rotary angle").
        rotate_pairwise: rotary pairs are (2i, 2i + 1) (SISO); else (i, i + N/2) (MIMO).
        has_bc_bias: ``B_bias``/``C_bias`` are added before the rotation.
        shared_bc: B and C have a head axis of 1 (one B/C per lane, read by every head).
        stochastic_rounding: a 16-bit state is stored with stochastic rounding, its bits drawn
            from ``rand_seed`` (docs/contract.md, "Stochastic rounding"); always set with an
            8-bit state (``int8``/``float8_e4m3fn``, whose ``state_scale`` the kernel then reads
            and writes: docs/contract.md, "8-bit states").
        has_rand_rows: dense mode draws lane b's bits for row ``rand_rows[b]`` (else for b).
        replay_ring: K, the flush length of a replay step (docs/contract.md, "Replay"): the
            state row is a checkpoint and the ring pools hold the tokens since; the kernel
            replays a row's committed ring tokens in registers, then this token, and writes
            the state every K-th token (appending to the ring otherwise). 0: no replay. 1, with
            a verify step only: every committed entry flushed (materialize's flush form).
        replay_from_checkpoint: a replay step's appends compute ``out`` from the checkpoint and the
            ring (the design's algebra: no state update, the step's accuracy rule), and a verify
            step's drafts from the checkpoint (a flush's, or the row's), the ring tokens since and
            the drafts before; else (the default) by replaying the state, bit for bit stepwise
            decoding's ``out``.
        replay_draft: with ``replay_ring`` and ``num_accepted``, the draft room ``T_max`` of a ring
            made for longer steps than this one needs (its entries ``L = K - 1 + T_max``; a verify
            step needs ``T``, a one-token step none): the kernel replays up to ``L`` committed
            entries (0: the step's own need). Derived from the ring by validation, never passed
            (docs/contract.md, "The replay kernel").
        padded_state_rows: the D stride of ``state`` (or ``state_out``) is not N, so the kernel
            takes it at run time. Else (the default: a pool row whose (D, N) block is packed,
            as ``torch.empty`` and every slice along P or H make it) the stride is the
            compile-time N: a thread's state rows are then one address plus immediate offsets,
            not one 64-bit address per row kept from the loads to the stores (docs/design/kernel.md,
            "Packed state rows"). Derived from the tensors by validation, never passed.
        min_ctas_per_sm: an experiment's launch bound: the compiler keeps registers for this many
            CTAs per SM (the launch's ``min_blocks_per_mp``, PTX ``.minnctapersm``), spilling if it
            must; 0, the default, leaves the choice to it. NVVM compiles the kernel under the bound
            (other PTX, not only the directive), so the PTX tier executes such a specialisation like
            any other. Not a public option: an experiment's (docs/performance.md, 3d).
        async_state_copy: the slab arrives in shared memory by asynchronous copies (``cp.async``,
            16 bytes each), all issued right after the row index and before every other load,
            and a thread reads its rows from there when the update needs them (docs/design/kernel.md,
            "The asynchronous state copy"). False, the default, loads the slab into registers. Not
            a public option until a GPU measures it faster: a benchmark's and the PTX tier's.
        late_epilogue: the register kernel loads the epilogue's global operands (D, z, zproj,
            outproj) after the update, in a dependent round trip of their own. By default a
            stepwise token of a 4- or 8-warp tiling loads them at its start, with its staging
            loads (``tiling.EARLY_EPILOGUE_WARPS``; docs/design/kernel.md, "The epilogue's
            operands, loaded early"); the same arithmetic, so the same bits. Not a public option:
            the layout before, kept for the benchmark's and the PTX tier's comparisons.
        unpinned_loads: the register kernel's first token leaves the order of its global loads to
            the compiler, which places most of the slab's loads after the first use of the staging
            loads: one dependent round trip more. By default a CTA barrier follows the loads the
            first token issues at its start (the slab, the decay coefficients, the epilogue's
            operands) where ``tiling.pinned_loads`` says so; the compiler moves no memory operation
            across a barrier, so all of them are in flight before any of them is used
            (docs/design/kernel.md, "Every load in flight before the first use"). The same
            arithmetic, so the same bits. Not a public option: the kernel without the barrier, kept for the
            benchmark's and the PTX tier's comparisons.
        pipeline_ctas: the slab pipeline (docs/design/kernel.md, "The slab pipeline"): at most this
            many persistent CTAs walk the slabs, and each keeps the next slab's state in flight in
            shared memory by a bulk copy (``cp.async.bulk`` signalled by an mbarrier) while it
            updates this one; the same arithmetic on the same values, so the register kernel's
            bits. 0, the default, launches one CTA per slab. Not a public option until a GPU
            measures it faster: a benchmark's and the PTX tier's.
        programmatic_launch: the register kernel launched with programmatic dependent launch
            (docs/contract.md, "Programmatic dependent launch"): its CTAs read the indices and the
            state rows before ``griddepcontrol.wait``, everything else after it, so their
            prologue overlaps the previous kernel's tail; the same arithmetic, so the same bits.
            Not a public option until a GPU measures it faster: a benchmark's and the PTX tier's.
    """

    dstate: int
    headdim: int
    mimo: int
    state_dtype: str = "float32"
    kv_dtype: str = "bfloat16"
    x_dtype: str = "bfloat16"
    proj_dtype: str = "bfloat16"
    tile_D: int = 0  # 0 is never valid in a finished spec; see with_default_tiling()
    num_warps: int = 0
    pool: bool = False
    has_dst: bool = False
    update_kv_state: bool = False
    has_z: bool = True
    has_outproj: bool = True
    has_state_out: bool = False
    tokens: int = 1
    dst_per_token: bool = False
    num_accepted: bool = False
    rope_angles: int = 0
    rotate_pairwise: bool = False
    has_bc_bias: bool = False
    shared_bc: bool = False
    stochastic_rounding: bool = False
    has_rand_rows: bool = False
    replay_ring: int = 0
    replay_from_checkpoint: bool = False
    replay_draft: int = 0
    padded_state_rows: bool = False
    min_ctas_per_sm: int = 0
    async_state_copy: bool = False
    late_epilogue: bool = False
    unpinned_loads: bool = False
    pipeline_ctas: int = 0
    programmatic_launch: bool = False

    @property
    def ring_entries(self) -> int:
        """L, the most committed ring entries a replay step replays: ``F - 1 + max(need,
        replay_draft)``, the step's own need ``T`` for a verify step and 0 for a one-token step; 0
        without replay."""
        if not self.replay_ring:
            return 0
        return self.replay_ring - 1 + max(self.draft_need, self.replay_draft)

    @property
    def draft_need(self) -> int:
        """The ring entries beyond ``F - 1`` this step itself needs: its T drafts, or none for one token."""
        return self.tokens if self.tokens > 1 else 0

    @property
    def carried_tokens(self) -> int:
        """Tokens the state is carried through in registers: T, or F with replay (its flush)."""
        return self.replay_ring or self.tokens

    def replace(self, **changes) -> "StepSpec":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def key(self) -> str:
        """A deterministic, file-name-safe string naming this specialisation.

        The rotary fields are named only when they differ from their default, so a spec
        without rotary keeps the key it had before they existed (and its disk cache entries).
        """
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _KEY_OMITTED_AT_DEFAULT and v == f.default:
                continue
            if isinstance(v, bool):
                v = int(v)
            parts.append(f"{f.name}={v}")
        return "-".join(parts)

    def with_default_tiling(self) -> "StepSpec":
        """Fill ``tile_D`` / ``num_warps`` left at 0 with the per-configuration default."""
        tile_D, num_warps = default_tiling(self.dstate, self.headdim, self.mimo, self.state_dtype, self.carried_tokens,
                                           whole_head=self.update_kv_state or self.rope_angles > 0,
                                           lean=_rounding_lean(self),
                                           replay=self.replay_ring > 0,
                                           from_checkpoint=self.replay_from_checkpoint,
                                           verify=self.replay_ring > 0 and self.tokens > 1,
                                           states=_other_states(self))
        return self.replace(
            tile_D=self.tile_D or tile_D,
            num_warps=self.num_warps or num_warps,
        )


def _other_states(spec: StepSpec) -> str:
    """tiling.default_tiling's ``states``: ``"rotary"`` (the angle with per-head B/C), ``"sr"``
    (stochastic rounding), or ``""``."""
    if spec.rope_angles and not spec.shared_bc:
        return "rotary"
    return "sr" if spec.stochastic_rounding else ""


def _rounding_lean(spec: StepSpec):
    """How much lighter a stochastic-rounding specialisation's default threads are (tiling.default_tiling's
    ``lean``): a quarter of the values with R = 8 (its operands and the Philox state), else as usual
    (the compile matrix is clean so: `--full-matrix`)."""
    return "quarter" if spec.stochastic_rounding and spec.mimo == 8 else False


def flagship_spec(**changes) -> StepSpec:
    """The flagship configuration (first in every benchmark table).

    H=48 (runtime), D=64, N=128, R=4, fp32 state, bf16 B/x/z, with z and outproj. The
    projections are bf16 (model weights), pool mode with update_kv_state as a server runs it.
    """
    spec = StepSpec(
        dstate=128,
        headdim=64,
        mimo=4,
        state_dtype="float32",
        kv_dtype="bfloat16",
        x_dtype="bfloat16",
        proj_dtype="bfloat16",
        pool=True,
        has_dst=False,
        update_kv_state=True,
        has_z=True,
        has_outproj=True,
    )
    return spec.replace(**changes).with_default_tiling()


#: the register kernel's previous load layouts, each as the StepSpec fields that select it (not public options:
#: kept for the benchmark's and the PTX tier's comparisons): its loads in the compiler's order, and with that the
#: epilogue's operands loaded after the update
PREVIOUS_LOAD_LAYOUTS = {"unpinned": {"unpinned_loads": True},
                         "late-epilogue": {"unpinned_loads": True, "late_epilogue": True}}

#: the fields that choose a kernel variant no call names (not public options: a benchmark's, the PTX tier's)
KERNEL_CHOICE_FIELDS = ("min_ctas_per_sm", "async_state_copy", "late_epilogue", "unpinned_loads", "pipeline_ctas",
                        "programmatic_launch")

#: fields a key names only when they are not at their default (added after keys were on disk)
_KEY_OMITTED_AT_DEFAULT = frozenset({"rope_angles", "rotate_pairwise", "has_bc_bias", "shared_bc",
                                     "stochastic_rounding", "has_rand_rows", "replay_ring",
                                     "replay_from_checkpoint", "replay_draft", "padded_state_rows",
                                     "min_ctas_per_sm", "async_state_copy", "late_epilogue",
                                     "unpinned_loads", "pipeline_ctas", "programmatic_launch"})


def flagship_rotary_spec(**changes) -> StepSpec:
    """The flagship with upstream's rotary as a Mamba-3 layer runs it: rope fraction 0.5
    (S = N / 4 = 32 angles), MIMO pairing, the B/C biases, and B/C shared by the heads."""
    return flagship_spec(rope_angles=32, has_bc_bias=True, shared_bc=True, **changes)


#: H of the flagship model (a runtime size: the benchmarks' default)
FLAGSHIP_HEADS = 48

_DTYPE_FIELDS = (("state_dtype", STATE_DTYPES), ("kv_dtype", KV_DTYPES), ("x_dtype", X_DTYPES),
                 ("proj_dtype", PROJ_DTYPES))


def complete_spec(spec) -> StepSpec:
    """``spec`` checked and with its default tiling filled in: what a compile may be asked for.

    Raises:
        TypeError: ``spec`` is not a StepSpec.
        ValueError: an unsupported dtype name, N, D or R, or an impossible tiling (the message
            starts with ``spec`` and names the field).
    """
    if not isinstance(spec, StepSpec):
        raise TypeError(f"spec: expected a mamba3_step.StepSpec, got {type(spec).__name__}")
    for field, allowed in _DTYPE_FIELDS:
        if getattr(spec, field) not in allowed:
            raise ValueError(f"spec.{field}: expected one of {allowed}, got {getattr(spec, field)!r}")
    problem = shape_problem(spec.dstate, spec.headdim, spec.mimo)
    if problem is not None:
        raise ValueError(f"spec: {problem}")
    if spec.tile_D == 0 or spec.num_warps == 0:
        spec = spec.with_default_tiling()
    problem = tiling_problem(spec) or mode_problem(spec)
    if problem is not None:
        raise ValueError(f"spec: {problem}")
    return spec


#: most tokens per lane a step takes (the kernel unrolls its token loop: code grows with T)
MAX_TOKENS = 16


def mode_problem(spec: StepSpec) -> str | None:
    """Why ``spec``'s mode flags cannot go together, or None."""
    if isinstance(spec.tokens, bool) or not isinstance(spec.tokens, int) or not 1 <= spec.tokens <= MAX_TOKENS:
        return f"tokens must be an int in [1, {MAX_TOKENS}], got {spec.tokens!r}"
    if spec.dst_per_token and not spec.has_dst:
        return "dst_per_token needs has_dst (per-token destinations are dst_state_batch_indices (B, T))"
    if spec.dst_per_token and spec.tokens == 1:
        return "dst_per_token needs tokens > 1 (a one-token step's (B, 1) destinations are its (B,) ones)"
    if spec.num_accepted and not spec.pool:
        return "num_accepted needs pool mode (it selects the source row among state_batch_indices (B, K))"
    if spec.has_dst and not spec.pool:
        return "has_dst needs pool mode"
    if spec.has_state_out and spec.pool:
        return "has_state_out is dense mode only"
    return rotary_problem(spec) or replay_problem(spec)


#: what a replay specialisation takes so far (docs/contract.md, "Replay"): the field and its required value
_REPLAY_NEEDS = (("pool", True, "pool mode"), ("update_kv_state", True, "update_kv_state (Bstate/Xstate are the "
                 "token before the ring)"))


#: the drafts of materialize's flush form (a verify step with F = 1; the fewest a verify step has)
FLUSH_DRAFTS = 2


def flush_specs(spec: StepSpec, L: int) -> list:
    """The flush form's specialisations for a replay pool whose steps are ``spec`` and whose rings
    hold ``L`` entries (one launch group each, :func:`flush_groups`), at their default tiling: what
    :func:`mamba3_step.materialize_fn` compiles on CUDA (``precompile --materialize-ring L``)."""
    out = []
    for _, _, flush_length in flush_groups(L):
        room = flush_entries(L, flush_length) - (flush_length - 1)
        out.append(spec.replace(tokens=FLUSH_DRAFTS, num_accepted=True, replay_ring=flush_length,
                                replay_draft=room if room > FLUSH_DRAFTS else 0, has_z=False, has_outproj=False,
                                has_dst=False, dst_per_token=False, shared_bc=False, replay_from_checkpoint=False,
                                padded_state_rows=False, tile_D=0, num_warps=0).with_default_tiling())
    return out


def flush_entries(L: int, flush_length: int) -> int:
    """The entries of the ring copy a flush launch of flush length ``F`` reads, for rings of ``L``:
    room for the committed entries it takes and for its two drafts."""
    return max(FLUSH_DRAFTS, min(L, flush_length - 1 + MAX_TOKENS))


def flush_groups(L: int) -> list:
    """The flush form's launches for rings of ``L`` entries: ``(first, last, F)``, the committed counts
    each takes and its flush length (a verify step replays at most ``F - 1 + 16`` entries)."""
    most = min(L, MAX_TOKENS)
    return [(1, most, 1)] + ([(MAX_TOKENS + 1, L, L - (MAX_TOKENS - 1))] if L > MAX_TOKENS else [])


def replay_problem(spec: StepSpec) -> str | None:
    """Why ``spec``'s replay field cannot go with the rest, or None."""
    flush_length, room = spec.replay_ring, spec.replay_draft
    need = spec.draft_need
    if isinstance(room, bool) or not isinstance(room, int) or not (room == 0 or need < room <= MAX_TOKENS):
        return f"replay_draft must be 0 or an int in ({need}, {MAX_TOKENS}] (above the step's own need), got {room!r}"
    if room and not (flush_length and spec.num_accepted):
        return "replay_draft needs replay_ring and num_accepted (a ring made for longer verify steps)"
    if flush_length == 0:
        return "replay_from_checkpoint needs replay_ring > 0" if spec.replay_from_checkpoint else None
    if isinstance(flush_length, bool) or not isinstance(flush_length, int) or not (2 <= flush_length <= MAX_TOKENS or (flush_length == 1 and spec.tokens > 1)):
        return (f"replay_ring (F) must be 0, an int in [2, {MAX_TOKENS}], or 1 with a verify step (tokens > 1: "
                f"materialize's flush form), got {flush_length!r}")
    for field, value, what in _REPLAY_NEEDS:
        if getattr(spec, field) != value:
            return f"replay_ring needs {what}, got {field}={getattr(spec, field)!r}"
    if spec.has_dst and spec.tokens > 1:
        return "replay_ring with has_dst takes one-token steps (a verify step keeps its drafts in its row's ring)"
    if spec.tokens > 1 and spec.replay_from_checkpoint and spec.rope_angles:
        return ("replay_from_checkpoint with a verify step (tokens > 1) takes no rope_angles (the drafts' outputs "
                "from the checkpoint are built without rotary)")
    if spec.num_accepted and spec.replay_from_checkpoint and spec.tokens == 1:
        return ("replay_from_checkpoint takes no num_accepted with one token (a step committing drafts replays the "
                "state)")
    if spec.tile_D and spec.tile_D < spec.headdim:
        return "replay_ring needs tile_D >= headdim (one CTA per (lane, head) owns its ring entry and length)"
    return None


def rotary_problem(spec: StepSpec) -> str | None:
    """Why ``spec``'s rotary fields cannot go together, or None."""
    S = spec.rope_angles
    if isinstance(S, bool) or not isinstance(S, int) or not 0 <= S <= spec.dstate // 2:
        return f"rope_angles (S) must be an int in [0, N/2 = {spec.dstate // 2}], got {S!r}"
    if S == 0 and (spec.rotate_pairwise or spec.has_bc_bias):
        return "rotate_pairwise and has_bc_bias need rope_angles > 0 (angle_state given)"
    if S and spec.tile_D and spec.tile_D < spec.headdim:
        return "rope_angles > 0 needs tile_D >= headdim (one CTA per (lane, head) updates the angle)"
    if spec.stochastic_rounding and spec.state_dtype not in ROUNDED_STATE_DTYPES:
        return f"stochastic_rounding needs a 16- or 8-bit state {ROUNDED_STATE_DTYPES}, got {spec.state_dtype}"
    if spec.state_dtype in SCALED_STATE_DTYPES and not spec.stochastic_rounding:
        return f"a {spec.state_dtype} state needs stochastic_rounding (8-bit states are always rounded stochastically)"
    if spec.state_dtype in SCALED_STATE_DTYPES and spec.has_state_out:
        return f"a {spec.state_dtype} state is updated in place: has_state_out must be False"
    if spec.has_rand_rows and (spec.pool or not spec.stochastic_rounding):
        return "has_rand_rows needs dense mode and stochastic_rounding"
    return None
