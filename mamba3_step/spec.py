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

from .contract import KV_DTYPES, PROJ_DTYPES, STATE_DTYPES, X_DTYPES
from .tiling import default_tiling, shape_problem, tiling_problem

__all__ = ["FLAGSHIP_HEADS", "MAX_TOKENS", "StepSpec", "complete_spec", "flagship_spec", "mode_problem"]


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
            ``state_batch_indices[b, num_accepted_tokens[b] - 1]``.
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

    def replace(self, **changes) -> "StepSpec":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def key(self) -> str:
        """A deterministic, file-name-safe string naming this specialisation."""
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool):
                v = int(v)
            parts.append(f"{f.name}={v}")
        return "-".join(parts)

    def with_default_tiling(self) -> "StepSpec":
        """Fill ``tile_D`` / ``num_warps`` left at 0 with the per-configuration default."""
        tile_D, num_warps = default_tiling(self.dstate, self.headdim, self.mimo, self.state_dtype, self.tokens,
                                           whole_head=self.update_kv_state)
        return self.replace(
            tile_D=self.tile_D or tile_D,
            num_warps=self.num_warps or num_warps,
        )


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
    return None
