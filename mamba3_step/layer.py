"""A reference Mamba-3 decode layer over paged state pools: hidden state in, hidden state out, one step launch.

Letters (docs/contract.md): B lanes, P pool rows (slots), H heads, D head dim, N state size (dstate),
R MIMO rank, S rotary angles per head, G heads of B/C (``num_bc_heads``: 1 or H).

:class:`Mamba3DecodeLayer` follows upstream's ``Mamba3.step`` (``mamba_ssm.modules.mamba3.Mamba3``
of state-spaces/mamba at commit e9594ce): its parameterisation (the parameter names and shapes, the
in_proj split ``[z, x, B, C, dd_dt, dd_A, trap, angle]``, B/C laid out ``(R, G, N)``), so an upstream
layer's weights load into it, and its math, term by term. It decodes the way a server does: every
request's recurrent state lives in a row of a pool (:class:`LayerPools`), and
:meth:`Mamba3DecodeLayer.decode` runs one token for a padded batch of slots as

1. ``in_proj`` (one matmul);
2. element-wise preparation: ``A = min(-heavy_tail(dd_A), -A_floor)`` with upstream's heavy-tail
   activation ``heavy_tail(v) = 1 + v`` for ``v >= 0``, ``1 / (1 - v)`` for ``v < 0``;
   ``dt = softplus(dd_dt + dt_bias)``, ``trap = sigmoid(trap)``, B and C RMS-normed over N
   (``v * rsqrt(mean(v**2) + 1e-5) * weight``, kept with their G heads, never expanded), x and z viewed
   per head, the angle projection expanded over the heads with stride 0;
3. exactly one :func:`mamba3_step.mamba3_step_fn` call in pool mode with ``update_kv_state=True``: it
   reads each lane's rows in place, advances the rotary angle, adds ``B_bias``/``C_bias`` and rotates
   B/C, steps, and writes the new state, the rotated B, x and the angle back to the lane's rows
   (padding lanes touch no row and give zeros);
4. ``out_proj`` (one matmul).

No row of a pool is gathered, scattered or copied by the layer: the step does it all (on CUDA, one
kernel launch; on CPU, the PyTorch path of the same contract).

:meth:`Mamba3DecodeLayer.decode_reference` is the same layer in float64: the same preparation in
float64 and :func:`mamba3_step.reference.mamba3_step_reference` (``compute_dtype=float64``) on
float64 pools (:meth:`LayerPools.reference`); the tests pin it to an independent transcription of
upstream's ``Mamba3.step``.

The angle pool holds fixed-point turns (int64, :mod:`mamba3_step.rotary`), not upstream's fp32
radians: a prefill that produced radians writes ``angle_from_radians(theta)`` into the slot's row.
Not covered: upstream's ``is_outproj_norm`` (the gated RMSNorm before ``mimo_o``), prefill (the chunked
scan) and training.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .api import mamba3_step_fn
from .contract import KV_DTYPES, PROJ_DTYPES, X_DTYPES, as_torch_dtype, dtype_name
from .reference import mamba3_step_reference
from .tensors import StepTensors

__all__ = ["DecodeTrace", "LayerDtypes", "LayerPools", "Mamba3DecodeLayer", "RMSNorm", "StepInputs", "heavy_tail"]

Tensor = torch.Tensor
#: upstream's dt initialisation range and floor, and the B/C RMSNorm epsilon
DT_MIN, DT_MAX, DT_INIT_FLOOR = 0.001, 0.1, 1e-4
NORM_EPS = 1e-5


def heavy_tail(v: Tensor) -> Tensor:
    """Upstream's activation of ``dd_A`` (positive, continuous): ``1 + v`` for ``v >= 0``, ``1 / (1 - v)``
    for ``v < 0``; ``A = -heavy_tail(dd_A)`` before the ``A_floor`` clamp."""
    return torch.where(v >= 0, 1 + v, 1 / (1 - v.clamp(max=0)))


class LayerDtypes(NamedTuple):
    """Storage dtypes of the step: ``state`` (the state pool), ``kv`` (B, C and the Bstate pool), ``x``
    (x, z, the Xstate pool and the step's out) and ``proj`` (mimo_x/z/o as the step reads them)."""

    state: torch.dtype = torch.float32
    kv: torch.dtype = torch.bfloat16
    x: torch.dtype = torch.bfloat16
    proj: torch.dtype = torch.float32

    @classmethod
    def of(cls, state=torch.float32, kv=torch.bfloat16, x=None, proj=torch.float32) -> "LayerDtypes":
        """From torch dtypes or their names (``x`` None: ``kv``'s); TypeError naming a bad one."""
        kv = as_torch_dtype(kv, "kv")
        return cls(as_torch_dtype(state, "state"), kv, kv if x is None else as_torch_dtype(x, "x"),
                   as_torch_dtype(proj, "proj"))


#: the dtypes each field of :class:`LayerDtypes` may take in this layer (the step's groups, the state's
#: without the 8-bit ones: the layer's pools carry no scales and its decode no seed)
_LAYER_DTYPES = {"state": ("float32", "bfloat16", "float16"), "kv": KV_DTYPES, "x": X_DTYPES, "proj": PROJ_DTYPES}


def _checked_dtypes(dtypes) -> LayerDtypes:
    """``dtypes`` (None: the defaults) as a :class:`LayerDtypes` the layer can decode with; TypeError naming
    ``dtypes`` and the field otherwise, before anything is built."""
    if dtypes is None:
        return LayerDtypes()
    if not isinstance(dtypes, LayerDtypes):
        raise TypeError(f"dtypes: expected a LayerDtypes (LayerDtypes.of(...)) or None, got {type(dtypes).__name__}")
    for field, allowed in _LAYER_DTYPES.items():
        value = getattr(dtypes, field)
        if not isinstance(value, torch.dtype) or dtype_name(value) not in allowed:
            why = " (an 8-bit state needs scales and a seed, which decode does not take)" if field == "state" else ""
            raise TypeError(f"dtypes.{field}: expected one of {', '.join('torch.' + a for a in allowed)}{why}, "
                            f"got {value}")
    return dtypes


class LayerPools(NamedTuple):
    """One layer's pools, a row per slot: what ``mamba3_step_fn`` reads and writes in place.

    A fresh request's row is all zeros (state, previous B and x, angle 0); a request whose prefill
    ran elsewhere gets its final state, rotated B, x and ``angle_from_radians(angle)`` written into
    its row. A ``StatePool`` built with ``rope_angles=S`` gives them: ``LayerPools(**pool.layer_rows(l))``.
    """

    state: Tensor  # (P, H, D, N), dtypes.state
    Bstate: Tensor  # (P, R, H, N), dtypes.kv: the previous token's rotated B
    Xstate: Tensor  # (P, H, D), dtypes.x: the previous token's x
    angle_state: Tensor  # (P, H, S) int64: the running angle, fixed-point turns

    def clone(self) -> "LayerPools":
        return LayerPools(*(t.clone() for t in self))

    def reference(self) -> "LayerPools":
        """Float64 copies (the angle copied as it is): the pools of :meth:`Mamba3DecodeLayer.decode_reference`."""
        return LayerPools(*(t.to(torch.float64) for t in self[:3]), self.angle_state.clone())

    def zero_rows_(self, rows) -> None:
        """Zero the given rows of every pool (a fresh request)."""
        for t in self:
            t[rows] = 0


class StepInputs(NamedTuple):
    """The per-lane step inputs the preparation makes (field names: ``mamba3_step_fn``'s)."""

    A: Tensor  # (B, H) fp32
    dt: Tensor  # (B, H) fp32
    trap: Tensor  # (B, H) fp32
    B: Tensor  # (B, R, G, N) dtypes.kv, RMS-normed, not rotated, without bias
    C: Tensor  # (B, R, G, N) dtypes.kv
    x: Tensor  # (B, H, D) dtypes.x
    z: Tensor  # (B, H, D) dtypes.x
    angle_proj: Tensor  # (B, H, S) fp32, a stride-0 head axis


class DecodeTrace(NamedTuple):
    """What :meth:`Mamba3DecodeLayer.decode_traced` returns: the layer's output and what led to it."""

    out: Tensor  # (B, d_model)
    step_out: Tensor  # (B, H, D) the step's out (dtypes.x), before out_proj
    inputs: StepInputs  # the prepared per-lane inputs the step read


class RMSNorm(nn.Module):
    """``v * rsqrt(mean(v**2) + eps) * weight`` over the last axis (upstream's ungated RMSNorm), computed
    in a given dtype."""

    def __init__(self, size: int, eps: float = NORM_EPS, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, device=device))

    def forward(self, v: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        v = v.to(dtype)
        return v * torch.rsqrt(v.square().mean(-1, keepdim=True) + self.eps) * self.weight.to(dtype)


class Mamba3DecodeLayer(nn.Module):
    """A Mamba-3 layer's decode over pools (module docstring).

    Args (upstream's names and defaults, but ``is_mimo``):
        d_model: the hidden size; ``d_inner = expand * d_model`` is split into ``H = d_inner / headdim``
            heads of ``headdim`` (one of 32, 64, 128).
        d_state: N, one of 32, 64, 128, 256.
        ngroups: G, the heads of B and C: 1 (shared by every head) or H.
        rope_fraction: 0.5 or 1.0; ``S = N * rope_fraction / 2`` rotary angles per head.
        is_mimo: MIMO (rank ``mimo_rank``, mimo_x/z/o projections; rotary pairs (i, i + N/2)) or SISO
            (rank 1, unit projections; pairs (2i, 2i + 1): upstream's ``rotate_pairwise``).
        A_floor: A is at most ``-A_floor``.
        dtypes: a :class:`LayerDtypes` (default: fp32 state, bf16 B/x, fp32 projections). The state is
            fp32, bf16 or fp16: an 8-bit state needs scale rows and a seed, which :class:`LayerPools` and
            :meth:`Mamba3DecodeLayer.decode` do not carry (refused here, TypeError naming ``dtypes``).
        device: where the parameters live (the pools and inputs must live there too).
    """

    def __init__(self, d_model: int, d_state: int = 128, expand: int = 2, headdim: int = 64, ngroups: int = 1,
                 rope_fraction: float = 0.5, is_mimo: bool = True, mimo_rank: int = 4, A_floor: float = 1e-4,
                 dtypes: Optional[LayerDtypes] = None, device=None):
        super().__init__()
        self.d_model, self.d_state, self.headdim, self.A_floor = d_model, d_state, headdim, A_floor
        self.d_inner = int(expand * d_model)
        if self.d_inner % headdim:
            raise ValueError(f"headdim: expected a divisor of d_inner = {self.d_inner}, got {headdim}")
        self.nheads = H = self.d_inner // headdim
        if ngroups not in (1, H):
            raise ValueError(f"ngroups: expected 1 or nheads = {H}, got {ngroups}")
        if rope_fraction not in (0.5, 1.0):
            raise ValueError(f"rope_fraction: expected 0.5 or 1.0, got {rope_fraction}")
        self.num_bc_heads, self.is_mimo = ngroups, bool(is_mimo)
        self.mimo_rank = R = mimo_rank if is_mimo else 1
        self.num_rope_angles = int(d_state * rope_fraction) // 2
        self.rotate_pairwise = not self.is_mimo  # upstream: MIMO pairs i with i + N/2, SISO 2i with 2i + 1
        self.dtypes = _checked_dtypes(dtypes)
        bc = R * ngroups * d_state
        self._split = [self.d_inner, self.d_inner, bc, bc, H, H, H, self.num_rope_angles]
        self.in_proj = nn.Linear(d_model, sum(self._split), bias=False, device=device)
        dt = torch.exp(torch.rand(H, device=device) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
        dt = dt.clamp(min=DT_INIT_FLOOR)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.B_bias = nn.Parameter(torch.ones(H, R, d_state, device=device))
        self.C_bias = nn.Parameter(torch.ones(H, R, d_state, device=device))
        self.B_norm, self.C_norm = RMSNorm(d_state, device=device), RMSNorm(d_state, device=device)
        if self.is_mimo:
            self.mimo_x = nn.Parameter(torch.ones(H, R, headdim, device=device) / R)
            self.mimo_z = nn.Parameter(torch.ones(H, R, headdim, device=device))
            self.mimo_o = nn.Parameter(torch.ones(H, R, headdim, device=device) / R)
        self.D = nn.Parameter(torch.ones(H, device=device))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False, device=device)

    # ---- pools and weights ------------------------------------------------------------------------
    def new_pools(self, num_slots: int, *, reference: bool = False) -> LayerPools:
        """Zeroed pools of ``num_slots`` rows on the layer's device (float64 ones with ``reference``)."""
        H, D, N, R, S = self.nheads, self.headdim, self.d_state, self.mimo_rank, self.num_rope_angles
        st, kv, x = (torch.float64,) * 3 if reference else self.dtypes[:3]
        dev = self.D.device
        return LayerPools(torch.zeros(num_slots, H, D, N, dtype=st, device=dev),
                          torch.zeros(num_slots, R, H, N, dtype=kv, device=dev),
                          torch.zeros(num_slots, H, D, dtype=x, device=dev),
                          torch.zeros(num_slots, H, S, dtype=torch.int64, device=dev))

    def step_weights(self, *, reference: bool = False) -> dict:
        """The step's weights in its layouts: ``D`` (H,), ``xproj``/``zproj``/``outproj`` (R, H, D) (mimo_x/z/o,
        upstream's (H, R, D), transposed; ones for SISO) and ``B_bias``/``C_bias`` (R, H, N); fp32 (the
        projections in ``dtypes.proj``), or float64 with ``reference``."""
        fp = torch.float64 if reference else torch.float32
        proj = torch.float64 if reference else self.dtypes.proj
        if self.is_mimo:
            xproj, zproj, outproj = (p.detach().transpose(0, 1).to(proj).contiguous()
                                     for p in (self.mimo_x, self.mimo_z, self.mimo_o))
        else:
            xproj = zproj = outproj = torch.ones(1, self.nheads, self.headdim, dtype=proj, device=self.D.device)
        return dict(D=self.D.detach().to(fp), xproj=xproj, zproj=zproj, outproj=outproj,
                    B_bias=self.B_bias.detach().transpose(0, 1).to(fp).contiguous(),
                    C_bias=self.C_bias.detach().transpose(0, 1).to(fp).contiguous())

    # ---- the decode -------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, hidden: Tensor, *, reference: bool = False) -> StepInputs:
        """``in_proj`` and the element-wise preparation of ``hidden`` (B, d_model): the step's per-lane
        inputs, computed in fp32 and stored in ``dtypes`` (everything float64 with ``reference``)."""
        cd = torch.float64 if reference else torch.float32
        kv, xd = (cd, cd) if reference else (self.dtypes.kv, self.dtypes.x)
        W = self.in_proj.weight
        W = W.to(cd) if reference else W
        zxbc = F.linear(hidden.to(W.dtype), W).to(cd)
        z, x, B, C, dd_dt, dd_A, trap, angle = torch.split(zxbc, self._split, dim=-1)
        n, H, bc = hidden.shape[0], self.nheads, (self.mimo_rank, self.num_bc_heads, self.d_state)
        return StepInputs(
            A=(-heavy_tail(dd_A)).clamp(max=-self.A_floor),
            dt=F.softplus(dd_dt + self.dt_bias.to(cd)),
            trap=torch.sigmoid(trap),
            B=self.B_norm(B.reshape(n, *bc), cd).to(kv),
            C=self.C_norm(C.reshape(n, *bc), cd).to(kv),
            x=x.reshape(n, H, self.headdim).to(xd),
            z=z.reshape(n, H, self.headdim).to(xd),
            angle_proj=angle[:, None, :].expand(n, H, self.num_rope_angles),
        )

    def step_tensors(self, inputs: StepInputs, pools: LayerPools, slots: Tensor, dst_slots: Optional[Tensor] = None,
                     *, null_slot_id: Optional[int] = None, out: Optional[Tensor] = None,
                     reference: bool = False) -> StepTensors:
        """The pool-mode step call as a :class:`~mamba3_step.tensors.StepTensors` (what :meth:`decode` runs)."""
        return StepTensors(*pools[:3], **inputs._asdict(), **self.step_weights(reference=reference), out=out,
                           state_batch_indices=slots, dst_state_batch_indices=dst_slots, null_slot_id=null_slot_id,
                           angle_state=pools.angle_state)

    @torch.no_grad()
    def finish(self, step_out: Tensor) -> Tensor:
        """``out_proj`` of the step's out (B, H, D): (B, d_model), in the parameters' dtype (float64 for a
        float64 ``step_out``)."""
        W = self.out_proj.weight
        W = W.to(torch.float64) if step_out.dtype == torch.float64 else W
        return F.linear(step_out.reshape(step_out.shape[0], self.d_inner).to(W.dtype), W)

    @torch.no_grad()
    def decode_traced(self, hidden: Tensor, pools: LayerPools, slots: Tensor, dst_slots: Optional[Tensor] = None, *,
                      null_slot_id: Optional[int] = None, step_out: Optional[Tensor] = None) -> DecodeTrace:
        """:meth:`decode`, returning the step's out and the prepared inputs too."""
        inputs = self.prepare(hidden)
        t = self.step_tensors(inputs, pools, slots, dst_slots, null_slot_id=null_slot_id, out=step_out)
        y = mamba3_step_fn(**t._asdict(), update_kv_state=True, rotate_pairwise=self.rotate_pairwise)  # the one step
        return DecodeTrace(self.finish(y), y, inputs)

    def decode(self, hidden: Tensor, pools: LayerPools, slots: Tensor, dst_slots: Optional[Tensor] = None, *,
               null_slot_id: Optional[int] = None, step_out: Optional[Tensor] = None) -> Tensor:
        """One decode token for ``B`` lanes: ``hidden`` (B, d_model) -> (B, d_model).

        Lane b reads its rows ``slots[b]`` (int32, (B,)) of ``pools`` and writes the new state, the rotated B,
        x and the advanced angle to row ``dst_slots[b]`` (default: ``slots[b]``; prefix caching reads a cached
        row and writes the request's own). A slot that is negative, ``>= P`` or ``null_slot_id`` is padding:
        its output is zeros and it touches no row. Live lanes must not share a destination. ``step_out``
        (B, H, D) in ``dtypes.x`` optionally receives the step's out (a static buffer, for CUDA graphs).
        One ``mamba3_step_fn`` call; capturable in a CUDA graph (no host synchronisation).
        """
        return self.decode_traced(hidden, pools, slots, dst_slots, null_slot_id=null_slot_id, step_out=step_out).out

    @torch.no_grad()
    def decode_reference(self, hidden: Tensor, pools: LayerPools, slots: Tensor, dst_slots: Optional[Tensor] = None,
                         *, null_slot_id: Optional[int] = None) -> Tensor:
        """:meth:`decode` in float64 on float64 ``pools`` (:meth:`LayerPools.reference`): the same
        preparation in float64 and :func:`~mamba3_step.reference.mamba3_step_reference` at float64.
        Returns (B, d_model) float64; the pools are updated in place as :meth:`decode` updates its own."""
        inputs = self.prepare(hidden, reference=True)
        t = self.step_tensors(inputs, pools, slots, dst_slots, null_slot_id=null_slot_id, reference=True)
        out = torch.empty(hidden.shape[0], self.nheads, self.headdim, dtype=torch.float64, device=hidden.device)
        y = mamba3_step_reference(t._replace(out=out), update_kv_state=True, rotate_pairwise=self.rotate_pairwise,
                                  compute_dtype=torch.float64)
        return self.finish(y)

    # ---- tests and demos --------------------------------------------------------------------------
    @torch.no_grad()
    def randomize_(self, generator: Optional[torch.Generator] = None) -> "Mamba3DecodeLayer":
        """Redraw every parameter around its initial scale, from ``generator`` (CPU; default seed 0).

        Upstream's initial values (biases, norms, D and the MIMO projections all ones) make every head,
        rank and element alike, which would hide a transposed layout; tests and demos use this instead.
        in_proj's outputs have a standard deviation of about half the hidden state's RMS and ``softplus(dt_bias)``
        lies in [0.01, 0.2], so dt is mostly below 0.3: the angle turns and the state decays visibly within a
        few tokens, while the outputs stay O(1)."""
        g = generator if generator is not None else torch.Generator().manual_seed(0)

        def draw(p: Tensor, mean: float, std: float) -> None:
            p.copy_(torch.randn(p.shape, generator=g) * std + mean)

        draw(self.in_proj.weight, 0.0, 0.5 * self.d_model ** -0.5)
        draw(self.out_proj.weight, 0.0, self.d_inner ** -0.5)
        dt = torch.rand(self.nheads, generator=g) * 0.19 + 0.01
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        for p in (self.B_bias, self.C_bias):
            draw(p, 0.0, 1.0)
        for p in (self.B_norm.weight, self.C_norm.weight, self.D):
            draw(p, 1.0, 0.3)
        if self.is_mimo:
            for p, mean in ((self.mimo_x, 1 / self.mimo_rank), (self.mimo_z, 1.0), (self.mimo_o, 1 / self.mimo_rank)):
                draw(p, mean, 0.5 * mean)
        return self
