"""The static specialisation of the step kernel: one frozen description, one compile.

Letters (same as SPEC.md everywhere): B batch lanes, P pool rows, H heads, D head dim,
N state size (dstate), R MIMO rank.

Everything that changes the generated code lives in :class:`StepSpec`; everything else
(``B``, ``P``, ``H``, every stride, ``null_slot_id``) is a runtime value and never
recompiles. The compile caches (in-memory and on disk) key on ``StepSpec`` itself, so a
new static field is automatically part of every key: there is no hand-kept tuple to go
stale.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SUPPORTED_N = (32, 64, 128, 256)
SUPPORTED_D = (32, 64, 128)
SUPPORTED_R = (1, 2, 4, 8)
#: dtype names accepted for each tensor group (torch names without the ``torch.`` prefix)
STATE_DTYPES = ("float32", "bfloat16", "float16")
KV_DTYPES = ("bfloat16", "float16", "float32")  # B, C, Bstate
X_DTYPES = ("bfloat16", "float16", "float32")  # x, z, Xstate, out
PROJ_DTYPES = ("float32", "bfloat16", "float16")  # xproj, zproj, outproj

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
        from .tiling import default_tiling

        tile_D, num_warps = default_tiling(self.dstate, self.headdim, self.mimo, self.state_dtype)
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


FLAGSHIP_HEADS = 48
