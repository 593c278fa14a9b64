"""Serving pieces around ``mamba3_step_fn``'s pool mode.

Letters (docs/contract.md): ``B`` lanes this step, ``P`` pool rows (slots), ``H`` heads,
``D`` head dim, ``N`` state size, ``R`` MIMO rank, ``L`` layers, ``T`` tokens per lane (a
speculative verify step).

===============  ========================================================================
``pool``         :class:`StatePool`: per-layer state pools and the slot allocator
``replay_pool``  :class:`ReplayStatePool`: a pool of checkpoints with a replay ring per layer
``hook``         :func:`decode_step`: one layer's step over the pool (the decode hook)
``graphs``       :class:`CudaGraphStepRunner`: batch-size buckets, padding, graph replay
``baseline``     :func:`gather_dense_scatter`: what pool mode must equal, byte for byte
``speculative``  :class:`SpecIndices` and the bookkeeping of ``StatePool``'s speculative groups
``slots``        what a slot argument is; :class:`SlotError`, :class:`PoolExhaustedError`
``pool_args``    the checks of ``StatePool``'s constructor arguments (sizes, dtypes, device)
===============  ========================================================================

A server's Mamba-3 layer step becomes::

    pool = StatePool(num_layers=L, num_slots=P, nheads=H, headdim=D, dstate=N, mimo=R,
                     state_dtype=torch.float32, kv_dtype=torch.bfloat16, device="cuda")
    slots = pool.alloc(1, zero=True)          # when a request arrives
    ...
    out = decode_step(pool, layer, step_slots, A, B, C, Dskip, x, dt, trap, xproj, outproj,
                      z=z, zproj=zproj)        # every decode step, every Mamba-3 layer
    ...
    pool.free(slots)                           # when it finishes

Speculative decoding (a verify step of ``T`` tokens per request)::

    groups = pool.alloc_spec(1, T)             # a request's T rows, (1, T)
    idx = pool.spec_indices(batch_groups)      # (B, T) sources + num_accepted_tokens, (B, T) destinations
    out = decode_step(pool, layer, idx.state_batch_indices, A, B, C, Dskip, x, dt, trap, xproj, outproj,
                      num_accepted_tokens=idx.num_accepted_tokens,
                      dst_slots=idx.dst_state_batch_indices)   # x (B, T, H, D) ...
    pool.commit_accepted(batch_groups, accepted)   # continue from row groups[b, accepted[b] - 1]
    pool.free_spec(groups)                     # when it finishes

See docs/integration.md for the full wiring (null block, prefix caching, CUDA graphs, speculative
decoding).
"""

from ..contract import PAD_SLOT_ID, lane_is_live
from .baseline import gather_dense_scatter, gather_scatter_step
from .graphs import (DEFAULT_BUCKETS, CudaGraphStepRunner, StepForm, check_buckets, choose_bucket, pad_lanes,
                     pad_slots)
from .hook import decode_step, kv_update_in_kernel
from .pool import StatePool
from .replay_pool import ReplayStatePool
from .slots import PoolExhaustedError, SlotError
from .speculative import SpecIndices

__all__ = [
    "DEFAULT_BUCKETS", "PAD_SLOT_ID", "CudaGraphStepRunner", "PoolExhaustedError", "ReplayStatePool", "SlotError",
    "SpecIndices", "StatePool", "StepForm", "check_buckets", "choose_bucket", "decode_step", "gather_dense_scatter", "gather_scatter_step",
    "kv_update_in_kernel", "lane_is_live", "pad_lanes", "pad_slots",
]
