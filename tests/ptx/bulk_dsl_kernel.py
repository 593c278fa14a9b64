"""A small CuteDSL pipelined kernel for the PTX tier's bulk-copy tests: rows of a pool gathered
through an index tensor by a producer warp (``cpasync.CopyBulkG2SOp`` into a ring of shared stages
signalled by ``cutlass.pipeline.PipelineTmaAsync``), consumer warps doubling each row and storing
it back with ``cpasync.CopyBulkS2GOp`` after ``fence.proxy.async`` (``out[b] = 2 * pool[idx[b]]``,
rows with a negative index skipped: no copy issued, ``out[b]`` untouched).

Compiled on the CPU (``CUTE_DSL_ARCH``-independent: ``--gpu-arch sm_90a``) against fake tensors;
:func:`run_gather` executes its PTX with :mod:`ptx_executor`, the parameter structs packed from
the compiled launcher's signature. ``consumer_arrivals`` is the consumer group's arrival count
given to the pipeline: the DSL's consumers release the empty barrier once per warp, so the right
count is the number of consumer warps; the thread count deadlocks.
"""


import functools
import shutil
import tempfile

import torch

import ptx_executor as ptx

W = 64  # floats per row: 256 bytes, one bulk copy


def _gather_class(stages: int, consumer_warps: int, arrivals: int):
    """The ``@cute.jit`` launcher class of the kernel (imports cutlass)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, pipeline
    from cutlass.cute.nvgpu import cpasync

    nthreads = 32 * (1 + consumer_warps)
    consumers = 32 * consumer_warps

    class Gather:
        @cute.jit
        def __call__(self, pool: cute.Tensor, idx: cute.Tensor, out: cute.Tensor, stream):
            self.kernel(pool, idx, out).launch(grid=(1, 1, 1), block=(nthreads, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, pool: cute.Tensor, idx: cute.Tensor, out: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            smem = cutlass.memory.SmemAllocator()
            bars = smem.allocate_array(cutlass.Int64, 2 * stages)
            ring = smem.allocate_tensor(Float32, cute.make_layout((W, stages), stride=(1, W)), 128)
            result = smem.allocate_tensor(Float32, cute.make_layout((W,)), 128)
            pipe = pipeline.PipelineTmaAsync.create(
                num_stages=stages, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, arrivals),
                tx_count=W * 4, barrier_storage=bars)
            if warp == 0:
                load = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32, num_bits_per_copy=W * 32)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                with cute.arch.elect_one():
                    for b in cutlass.range(idx.shape[0]):
                        row = idx[b]
                        if row >= 0:
                            pipe.producer_acquire(state)
                            src = cute.make_tensor(pool.iterator + row * W, cute.make_layout((W,)))
                            s, d = cute.group_modes(src, 0, 1), cute.group_modes(ring[None, state.index], 0, 1)
                            cute.copy(load, s, d, mbar_ptr=pipe.producer_get_barrier(state))
                            pipe.producer_commit(state)
                            state.advance()
                    pipe.producer_tail(state)
            else:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
                t = tidx - 32
                store = cute.make_copy_atom(cpasync.CopyBulkS2GOp(), Float32, num_bits_per_copy=W * 32)
                for b in cutlass.range(idx.shape[0]):
                    row = idx[b]
                    if row >= 0:
                        pipe.consumer_wait(state)
                        v = Float32(0.0)
                        if t < W:
                            v = ring[t, state.index]
                        cute.arch.barrier(barrier_id=1, number_of_threads=consumers)
                        if t < W:
                            result[t] = v + v
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=1, number_of_threads=consumers)
                        pipe.consumer_release(state)
                        if t == 0:
                            dst = cute.make_tensor(out.iterator + b * W, cute.make_layout((W,)))
                            s, d = cute.group_modes(result, 0, 1), cute.group_modes(dst, 0, 1)
                            cute.copy(store, s, d)
                            cute.arch.cp_async_bulk_commit_group()
                            cute.arch.cp_async_bulk_wait_group(0, read=True)
                        cute.arch.barrier(barrier_id=1, number_of_threads=consumers)
                        state.advance()

    return Gather


@functools.lru_cache(maxsize=None)
def compile_gather(stages: int = 3, consumer_warps: int = 2, consumer_arrivals: int | None = None):
    """``(PTX text, host signature, dynamic masks, block, dynamic shared bytes)`` of the kernel
    (imports cutlass on first use)."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    arrivals = consumer_warps if consumer_arrivals is None else consumer_arrivals
    Gather = _gather_class(stages, consumer_warps, arrivals)
    P, B = cute.sym_int(), cute.sym_int()
    fakes = (cute.runtime.make_fake_tensor(Float32, (P, W), stride=(W, 1), assumed_align=16),
             cute.runtime.make_fake_tensor(Int32, (B,), stride=(1,), assumed_align=4),
             cute.runtime.make_fake_tensor(Float32, (B, W), stride=(W, 1), assumed_align=16))
    dump = tempfile.mkdtemp(prefix="bulk-ptx-")
    try:
        compiled = cute.compile(Gather(), *fakes, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                                options=f"--enable-tvm-ffi --gpu-arch sm_90a --keep-ptx --dump-dir {dump}")
        text = compiled.__ptx__
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    ir_text = str(compiled.ir_module)
    host = ptx.host_signature(ir_text, compiled.function_name)[:3]
    smem = max(ptx.launch_config(ir_text)["smem"], default=0)
    masks = tuple((tuple(bool(m) for m in f.dynamic_shapes_mask), tuple(bool(m) for m in f.dynamic_strides_mask))
                  for f in fakes)
    return text, tuple(host), masks, (32 * (1 + consumer_warps), 1, 1), smem


def run_gather(pool: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, *, async_copies: str = "modelled",
               **compile_args) -> ptx.RunResult:
    """Execute the compiled kernel's PTX on CPU tensors (pool and idx read-only)."""
    text, host, masks, block, smem = compile_gather(**compile_args)
    memory = ptx.GlobalMemory()
    params = []
    for name, t, ltype, (shapes, strides) in zip(("pool", "idx", "out"), (pool, idx, out), host, masks):
        memory.add(name, t, writable=name == "out")
        leaves = ([t.data_ptr()] + [s for s, d in zip(t.shape, shapes) if d]
                  + [s for s, d in zip(t.stride(), strides) if d])
        params.append(ptx.pack(ltype, leaves))
    return ptx.run(text, grid=(1, 1, 1), block=block, params=params, memory=memory, dynamic_smem=smem,
                   async_copies=async_copies)
