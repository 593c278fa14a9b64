"""Serving pieces around ``mamba3_step_fn``'s pool mode.

Letters (docs/contract.md): ``B`` lanes this step, ``P`` pool rows (slots), ``H`` heads,
``D`` head dim, ``N`` state size, ``R`` MIMO rank, ``L`` layers.

=============  ==========================================================================
``pool``       :class:`StatePool`: per-layer state pools and the slot allocator
``hook``       :func:`decode_step`: one layer's step over the pool (the decode hook)
``graphs``     :class:`CudaGraphStepRunner`: batch-size buckets, padding, graph replay
``baseline``   :func:`gather_dense_scatter`: what pool mode must equal, byte for byte
=============  ==========================================================================

A server's Mamba-3 layer step becomes::

    pool = StatePool(num_layers=L, num_slots=P, nheads=H, headdim=D, dstate=N, mimo=R,
                     state_dtype=torch.float32, kv_dtype=torch.bfloat16, device="cuda")
    slots = pool.alloc(1, zero=True)          # when a request arrives
    ...
    out = decode_step(pool, layer, step_slots, A, B, C, Dskip, x, dt, trap, xproj, outproj,
                      z=z, zproj=zproj)        # every decode step, every Mamba-3 layer
    ...
    pool.free(slots)                           # when it finishes

See docs/integration.md for the full wiring (null block, prefix caching, CUDA graphs).
"""

from ..contract import PAD_SLOT_ID, lane_is_live
from .baseline import gather_dense_scatter, gather_scatter_step
from .graphs import DEFAULT_BUCKETS, CudaGraphStepRunner, choose_bucket, pad_lanes, pad_slots
from .hook import decode_step, kv_update_in_kernel
from .pool import PoolExhaustedError, SlotError, StatePool

__all__ = [
    "DEFAULT_BUCKETS", "PAD_SLOT_ID", "CudaGraphStepRunner", "PoolExhaustedError", "SlotError", "StatePool",
    "choose_bucket", "decode_step", "gather_dense_scatter", "gather_scatter_step", "kv_update_in_kernel",
    "lane_is_live", "pad_lanes", "pad_slots",
]
