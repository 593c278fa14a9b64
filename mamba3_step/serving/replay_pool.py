"""``ReplayStatePool``: a :class:`~mamba3_step.serving.pool.StatePool` whose rows are checkpoints, with a
replay ring per layer (docs/contract.md, "Replay"; docs/integration.md, section 11).

Letters (docs/contract.md): ``P`` pool rows (slots), ``H`` heads, ``D`` head dim, ``N`` state size,
``R`` MIMO rank, ``L`` layers, ``F`` the flush length.
"""

from __future__ import annotations

import torch

from ..contract import SCALED_STATE_DTYPES, dtype_name, shown
from ..materialize import materialize_fn
from ..replay import Current, Ring, new_ring
from ..tensors import StepTensors
from ..validation.step import check_weights
from .pool import StatePool
from .slots import is_int

__all__ = ["ReplayStatePool"]


class ReplayStatePool(StatePool):
    """A :class:`StatePool` (same arguments) plus ``replay_ring=F`` (an int in ``[2, 16]``) and
    ``replay_draft=T`` (an int in ``[0, 16]``, default 0: the most draft tokens of a verify step): per
    layer ``l`` a :class:`~mamba3_step.replay.Ring`, ``ring(l)``, of ``F - 1 + T`` entries a row, with
    draw offsets for an 8-bit state and angles with ``rope_angles``. The ``state`` rows are checkpoints;
    :meth:`materialize` gives a row's current state, and ``decode_step`` (and the graph runner) step
    the pool through the step's replay mode (``replay_ring``): one-token steps, or verify steps of up to ``T`` drafts (kept in
    the ring; the next step's ``num_accepted_tokens`` commits some, a rollback is committing none), every
    ``out`` stepwise decoding's.

    The rings are one ``(L, P, ...)`` allocation per field, among the pool's row allocations: ``reset``
    empties a row's ring with its checkpoint, ``copy``/``fork`` copy it with the row (nothing is
    replayed), ``bytes_per_slot`` counts it. A slot allocated (again) always starts reset, ``zero`` or
    not: an empty ring and zero rows in every layer, so the last request's tokens never reach the next.
    A 16-bit pool's rings keep no draw offsets: its steps take no stochastic rounding (refused by name).

    Measured on an H200 (docs/performance.md 3d): replay pays for an fp32 state at F = 2; with
    ``rope_angles`` or an 8-bit state every step measured slower than a :class:`StatePool`'s.
    """

    def __init__(self, *args, replay_ring: int, replay_draft: int = 0, **kwargs):
        if not is_int(replay_ring) or not 2 <= replay_ring <= 16:
            raise ValueError(f"replay_ring: expected an int F in [2, 16] (the state written every F tokens, a ring "
                             f"of the F - 1 tokens since), got {shown(replay_ring)}")
        if not is_int(replay_draft) or not 0 <= replay_draft <= 16:
            raise ValueError(f"replay_draft: expected an int T in [0, 16] (the most draft tokens of a verify step), "
                             f"got {shown(replay_draft)}")
        super().__init__(*args, **kwargs)
        self.replay_ring, self.replay_draft = int(replay_ring), int(replay_draft)
        L, P = self.num_layers, self.num_slots
        flat = new_ring(L * P, self.replay_ring, self.mimo, self.nheads, self.dstate, self.headdim,
                        kv_dtype=self.kv_dtype, x_dtype=self.x_dtype, draft=self.replay_draft,
                        stochastic=dtype_name(self.state_dtype) in SCALED_STATE_DTYPES, rope_angles=self.rope_angles,
                        device=self.device)
        self._ring = Ring(*(None if t is None else t.view((L, P) + tuple(t.shape[1:])) for t in flat))

    def _alloc_locked(self, n: int, zero: bool) -> torch.Tensor:
        """Every slot handed out (``alloc``, ``alloc_spec``, ``fork``) is reset first, ``zero`` or not: its ring
        is empty and its rows zero, whatever the caller writes next (a prefill written into the state rows
        is then the current state, not a checkpoint behind the last request's tokens)."""
        return super()._alloc_locked(n, True)

    def ring(self, layer: int) -> Ring:
        """Layer ``layer``'s ring: views of the pool's ring allocations."""
        layer = self._layer(layer)
        return Ring(*(None if t is None else t[layer] for t in self._ring))

    def materialize(self, layer: int, slots, *, xproj: torch.Tensor, D: torch.Tensor, zproj=None, outproj=None,
                    B_bias=None, C_bias=None, rand_seed=None, rotate_pairwise: bool = False) -> Current:
        """The current state of ``slots`` (allocated) in layer ``layer``: each row's checkpoint advanced by
        its ring's committed tokens with the step's math and rounding (:func:`mamba3_step.materialize_fn`;
        prefix caching, export): bit for bit what stepwise decoding holds, on CPU tensors the CPU path's,
        on CUDA the stepwise kernel's (the replay kernel's flush form). The layer's weights
        (``xproj``, ``D``, ``zproj``/``outproj`` as the steps took them; ``B_bias``/``C_bias`` with rotary)
        and, with an 8-bit state, ``rand_seed`` (its seed) are what the steps used. Writes nothing.

        Raises TypeError/ValueError naming the argument: a weight that is not a strided tensor of the
        step's shape, dtype and device (the table's row for it), and what
        :func:`~mamba3_step.materialize_fn` refuses; :class:`SlotError` for slots not allocated.
        """
        with self._lock:
            rows = self._checked_allocated(slots, "slots", what="materialize")
        dims = {"R": self.mimo, "H": self.nheads, "D": self.headdim, "N": self.dstate}
        check_weights(dict(xproj=xproj, D=D, zproj=zproj, outproj=outproj, B_bias=B_bias, C_bias=C_bias,
                           rand_seed=rand_seed), dims, self.device, "(the layer's weights as the steps took them)")
        t = StepTensors(**self.layer_rows(layer), A=None, B=None, C=None, D=D, x=None, dt=None, trap=None,
                        xproj=xproj, zproj=zproj, outproj=outproj, B_bias=B_bias, C_bias=C_bias, rand_seed=rand_seed)
        return materialize_fn(t, self.ring(layer), rows, rotate_pairwise=rotate_pairwise)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", replay_ring={self.replay_ring}, replay_draft={self.replay_draft})"
