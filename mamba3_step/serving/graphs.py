"""``CudaGraphStepRunner``: a layer's decode step captured per batch-size bucket, replayed padded.

Letters (docs/contract.md): ``n`` live lanes, ``B`` bucket size, ``P`` pool rows (slots),
``H`` heads, ``D`` head dim, ``N`` state size, ``R`` MIMO rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..tensors import StepTensors
from ..validation import check_step_inputs
from .hook import decode_step, kv_update_in_kernel
from .pool import StatePool

__all__ = ["CudaGraphStepRunner", "DEFAULT_BUCKETS", "choose_bucket", "pad_lanes", "pad_slots"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def choose_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket ``>= n``, or None when ``n`` exceeds the largest (run eagerly)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n: expected a non-negative int, got {n!r}")
    for b in sorted(buckets):
        if b >= n:
            return b
    return None


def _check_buckets(buckets) -> tuple[int, ...]:
    bs = tuple(buckets)
    if not bs:
        raise ValueError("buckets: expected at least one batch size, got none")
    for b in bs:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"buckets: expected positive ints, got {b!r}")
    if len(set(bs)) != len(bs):
        raise ValueError(f"buckets: expected distinct batch sizes, got {bs}")
    return tuple(sorted(bs))


def pad_slots(slots: torch.Tensor, bucket: int, pad_id: int) -> torch.Tensor:
    """``(bucket,)`` int32: ``slots`` followed by ``pad_id`` (a new tensor on ``slots``' device)."""
    n = slots.shape[0]
    if n > bucket:
        raise ValueError(f"slots: expected at most bucket={bucket} slots, got {n}")
    padded = torch.full((bucket,), pad_id, dtype=torch.int32, device=slots.device)
    padded[:n] = slots
    return padded


def pad_lanes(t: torch.Tensor, bucket: int) -> torch.Tensor:
    """``t`` (``(n, ...)``) padded with zero lanes to ``(bucket, ...)`` (a new tensor)."""
    n = t.shape[0]
    if n > bucket:
        raise ValueError(f"expected at most bucket={bucket} lanes, got {n}")
    padded = torch.zeros((bucket,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[:n] = t
    return padded


class CudaGraphStepRunner:
    """Runs :func:`decode_step` for one layer at a fixed set of batch-size buckets.

    On CUDA (``use_cuda_graph`` default: the pool is on CUDA) each bucket's step is captured
    once into a CUDA graph over static buffers; :meth:`step` copies the live lanes' inputs
    into the smallest bucket ``>= n``, pads the slot list with ``pool.pad_id`` and the
    inputs with zeros, replays, and returns the first ``n`` lanes of ``out``. Padded lanes
    are padding to the kernel (``-1``, or the reserved null slot), so they touch no pool row.
    A step larger than the largest bucket runs eagerly, unpadded. On CPU the same static
    buffers and padding are used, without graphs, so server logic is testable anywhere.

    The layer's weights (``D`` ``(H,)`` fp32; ``xproj``/``zproj``/``outproj`` ``(R, H, D)``) are
    fixed at construction (the graph reads their storage: update them in place). Per-step
    inputs: ``A``, ``dt``, ``trap`` ``(n, H)`` fp32; ``B``, ``C`` ``(n, R, H, N)``; ``x`` (and ``z``
    when ``zproj`` is given) ``(n, H, D)``. With ``with_dst=True`` a static destination-slot
    buffer is captured too and :meth:`step` takes ``dst_slots`` (prefix caching).
    Capture happens lazily on first use of a bucket, or eagerly with :meth:`capture`.
    """

    def __init__(
        self,
        pool: StatePool,
        layer: int,
        *,
        D: torch.Tensor,
        xproj: torch.Tensor,
        outproj: torch.Tensor | None = None,
        zproj: torch.Tensor | None = None,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        with_dst: bool = False,
        tile_D: int | None = None,
        num_warps: int | None = None,
        use_cuda_graph: bool | None = None,
        graph_pool=None,
    ):
        pool._layer(layer)
        self.pool = pool
        self.layer = layer
        self.D, self.xproj, self.outproj, self.zproj = D, xproj, outproj, zproj
        self.buckets = _check_buckets(buckets)
        self.with_dst = bool(with_dst)
        self.tile_D, self.num_warps = tile_D, num_warps
        is_cuda = pool.device.type == "cuda"
        if use_cuda_graph is None:
            use_cuda_graph = is_cuda
        if use_cuda_graph and not is_cuda:
            raise ValueError(f"use_cuda_graph: CUDA graphs need a CUDA pool, got device {pool.device}")
        self.use_cuda_graph = bool(use_cuda_graph)
        self.graph_pool = graph_pool
        if self.use_cuda_graph and self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        self._static: dict[int, dict[str, torch.Tensor]] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _check_step(self, bucket: int, n: int, inputs: dict, with_dst: bool) -> None:
        """Validate the caller's lane tensors with the pool and weights, as ``mamba3_step_fn`` would.

        The index tensors stand in for the caller's slots (already checked to be ``(n,)`` int32,
        possibly on another device): the bucket's static slot buffer, or a fresh one before the
        bucket's first capture. Metadata only.
        """
        p, s = self.pool, self._static.get(bucket)
        idx = s["slots"][:n] if s is not None else torch.empty(n, dtype=torch.int32, device=p.device)
        dst = None
        if with_dst:
            dst = s["dst"][:n] if s is not None else torch.empty(n, dtype=torch.int32, device=p.device)
        tensors = StepTensors(
            *p.layer_tensors(self.layer), inputs["A"], inputs["B"], inputs["C"], self.D, inputs["x"], inputs["dt"],
            inputs["trap"], self.xproj, self.outproj, None, None if s is None else s["out"][:n], inputs.get("z"),
            self.zproj, idx, dst, p.null_slot_id,
        )
        in_kernel = kv_update_in_kernel(p.headdim, p.dstate, p.mimo, p.state_dtype, self.tile_D)
        check_step_inputs(tensors, update_kv_state=in_kernel, tile_D=self.tile_D, num_warps=self.num_warps)

    # static buffers -------------------------------------------------------------------
    def _make_static(self, bucket: int) -> dict[str, torch.Tensor]:
        p, dev = self.pool, self.pool.device
        H, Dh, N, R = p.nheads, p.headdim, p.dstate, p.mimo
        f32 = torch.float32
        s = {
            "slots": torch.full((bucket,), p.pad_id, dtype=torch.int32, device=dev),
            "A": torch.zeros((bucket, H), dtype=f32, device=dev),
            "dt": torch.zeros((bucket, H), dtype=f32, device=dev),
            "trap": torch.zeros((bucket, H), dtype=f32, device=dev),
            "B": torch.zeros((bucket, R, H, N), dtype=p.kv_dtype, device=dev),
            "C": torch.zeros((bucket, R, H, N), dtype=p.kv_dtype, device=dev),
            "x": torch.zeros((bucket, H, Dh), dtype=p.x_dtype, device=dev),
        }
        if self.zproj is not None:
            s["z"] = torch.zeros((bucket, H, Dh), dtype=p.x_dtype, device=dev)
        if self.with_dst:
            s["dst"] = torch.full((bucket,), p.pad_id, dtype=torch.int32, device=dev)
        lane_shape = (bucket, H, Dh) if self.outproj is not None else (bucket, R, H, Dh)
        s["out"] = torch.zeros(lane_shape, dtype=p.x_dtype, device=dev)
        return s

    def _run(self, s: dict[str, torch.Tensor]) -> torch.Tensor:
        return decode_step(
            self.pool, self.layer, s["slots"], s["A"], s["B"], s["C"], self.D, s["x"], s["dt"],
            s["trap"], self.xproj, self.outproj, z=s.get("z"), zproj=self.zproj,
            dst_slots=s.get("dst"), out=s["out"], tile_D=self.tile_D, num_warps=self.num_warps,
        )

    def capture(self, buckets: Sequence[int] | None = None) -> None:
        """Build static buffers (and, on CUDA, capture graphs) for ``buckets`` (default: all).

        During capture every slot is the pad id, so the warm-up and capture runs touch no
        pool row. The warm-up runs outside the graph (it compiles the kernel).
        """
        for b in self.buckets if buckets is None else buckets:
            if b not in self.buckets:
                raise ValueError(f"buckets: {b} is not one of this runner's buckets {self.buckets}")
            if b in self._static:
                continue
            s = self._make_static(b)
            if self.use_cuda_graph:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._run(s)  # warm-up: compiles the kernel, all lanes padding
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.graph_pool):
                    self._run(s)
                self._graphs[b] = g
            self._static[b] = s

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs if self.use_cuda_graph else self._static))

    def step(
        self,
        slots: torch.Tensor,
        *,
        A: torch.Tensor,
        dt: torch.Tensor,
        trap: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        x: torch.Tensor,
        z: torch.Tensor | None = None,
        dst_slots: torch.Tensor | None = None,
        clone: bool = True,
    ) -> torch.Tensor:
        """One padded step for ``n = len(slots)`` live lanes; returns their ``out`` ``(n, ...)``.

        ``slots`` (and ``dst_slots``) are ``(n,)`` int32, on any device (copied into the
        static buffer). With ``clone=False`` the result is a view of the static output
        buffer, overwritten by the next step of the same bucket.

        Every input is validated as the eager path (``mamba3_step_fn``) validates it, before
        anything is copied: exact shapes, dtypes and device, never broadcast or cast into the
        static buffers. A refused step changes nothing.
        """
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1:
            raise ValueError(f"slots: expected a 1-d int32 tensor, got {getattr(slots, 'shape', type(slots))}")
        if slots.dtype != torch.int32:
            raise TypeError(f"slots: expected dtype torch.int32, got {slots.dtype}")
        if (z is None) != (self.zproj is None):
            raise ValueError(
                "z: expected a (n, H, D) tensor because the runner has zproj"
                if z is None
                else "z: this runner was built without zproj, so z must be None"
            )
        if dst_slots is not None and not self.with_dst:
            raise ValueError("dst_slots: this runner was built with with_dst=False; pass with_dst=True")
        n = slots.shape[0]
        inputs = {"A": A, "dt": dt, "trap": trap, "B": B, "C": C, "x": x}
        if z is not None:
            inputs["z"] = z
        for name, t in inputs.items():
            if not isinstance(t, torch.Tensor) or t.shape[:1] != (n,):
                raise ValueError(f"{name}: expected {n} lanes (len(slots)), got shape {tuple(getattr(t, 'shape', ()))}")
        if dst_slots is not None:
            if dst_slots.dtype != torch.int32 or tuple(dst_slots.shape) != (n,):
                raise ValueError(f"dst_slots: expected ({n},) int32, got {tuple(dst_slots.shape)} {dst_slots.dtype}")
        bucket = choose_bucket(n, self.buckets)
        if bucket is None:  # too big for any bucket: run eagerly, unpadded
            dev = self.pool.device
            return decode_step(
                self.pool, self.layer, slots.to(dev), A, B, C, self.D, x, dt, trap, self.xproj,
                self.outproj, z=z, zproj=self.zproj,
                dst_slots=None if not self.with_dst else (slots if dst_slots is None else dst_slots).to(dev),
                tile_D=self.tile_D, num_warps=self.num_warps,
            )
        self._check_step(bucket, n, inputs, dst_slots is not None or self.with_dst)
        if bucket not in self._static:
            self.capture([bucket])
        s = self._static[bucket]
        s["slots"][:n].copy_(slots)
        s["slots"][n:].fill_(self.pool.pad_id)
        if self.with_dst:
            s["dst"][:n].copy_(slots if dst_slots is None else dst_slots)
            s["dst"][n:].fill_(self.pool.pad_id)
        for name, t in inputs.items():
            s[name][:n].copy_(t)
            s[name][n:].zero_()
        if self.use_cuda_graph:
            self._graphs[bucket].replay()
        else:
            self._run(s)
        res = s["out"][:n]
        return res.clone() if clone else res
