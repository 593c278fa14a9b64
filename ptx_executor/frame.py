"""The state of one chunk of CTAs under execution: registers, special registers, memories.

A *chunk* is a run of consecutive CTAs (linear block index order) executed together, every
thread of every CTA a lane of the same numpy arrays: register ``%r5`` of the chunk is one
array with an element per thread. Instruction closures (:mod:`ptx_executor.isa`) read
and write a :class:`Frame` through :meth:`Frame.read` / :meth:`Frame.write`, which give
each PTX type its numpy view of the register's bits (a ``.b32`` register read as ``.f32``
is the same bits viewed as float32).

``idx`` everywhere is the set of executing threads: ``None`` for all threads of the chunk
(the common case, which avoids fancy indexing) or a sorted int64 array of thread indices.
"""

from __future__ import annotations

import numpy as np

from .errors import PTXError
from .memory import AccessLog, GlobalMemory, VarLayout
from .ir import Entry, Imm, Reg, Special, Sym

#: numpy view dtype of every PTX type (16-bit floats are handled as raw bits)
VIEW = {
    "pred": np.bool_, "b8": np.uint8, "u8": np.uint8, "s8": np.int8,
    "b16": np.uint16, "u16": np.uint16, "s16": np.int16, "f16": np.uint16, "bf16": np.uint16,
    "b32": np.uint32, "u32": np.uint32, "s32": np.int32, "f32": np.float32,
    "f16x2": np.uint32, "bf16x2": np.uint32,
    "b64": np.uint64, "u64": np.uint64, "s64": np.int64, "f64": np.float64,
}
_STORAGE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_POISON = {np.uint8: 0xAD, np.uint16: 0xF00D, np.uint32: 0xBAADF00D, np.uint64: 0xBAADF00DBAADF00D}


def view_of(ptx_type: str):
    t = ptx_type.lstrip(".")
    if t not in VIEW:
        raise PTXError(f"unsupported PTX type .{t}")
    return VIEW[t]


def storage_of(ptx_type: str):
    v = view_of(ptx_type)
    return np.bool_ if v is np.bool_ else _STORAGE[np.dtype(v).itemsize]


def _unsigned(dtype):
    return _STORAGE[np.dtype(dtype).itemsize]


def imm_value(op: Imm, dtype):
    """A numpy scalar of ``dtype`` for an immediate (integers wrap, hex floats keep their bits)."""
    dtype = np.dtype(dtype)
    if op.bits is not None:
        if op.bits_width == 32:
            f = np.uint32(op.bits).view(np.float32)
        else:
            f = np.uint64(op.bits).view(np.float64)
        if dtype.kind == "f":
            return dtype.type(f)
        # a hex float moved into an integer/bit register keeps its bits
        raw = np.uint32(op.bits) if op.bits_width == 32 else np.uint64(op.bits)
        return _bits_to(raw, dtype)
    if dtype == np.bool_:
        return np.bool_(op.value)
    if dtype.kind == "f":
        return dtype.type(op.value)
    if isinstance(op.value, float):
        raise PTXError(f"float literal {op.value} used as an integer operand")
    bits = dtype.itemsize * 8
    return _unsigned(dtype)(op.value & ((1 << bits) - 1)).view(dtype)


def _bits_to(raw, dtype):
    u = _unsigned(dtype)
    return u(int(raw) & ((1 << (np.dtype(dtype).itemsize * 8)) - 1)).view(dtype)


class Frame:
    """Registers and memories of a chunk of ``n_cta`` CTAs of ``nt`` threads each."""

    def __init__(self, entry: Entry, *, first_cta: int, n_cta: int, grid: tuple, block: tuple,
                 memory: GlobalMemory, layout: VarLayout, params: dict,
                 log: AccessLog | None, log_shared: AccessLog | None, async_copies: str = "modelled",
                 cluster: tuple = (1, 1, 1)):
        self.entry = entry
        self.cluster = cluster  # CTAs per cluster (x, y, z); (1, 1, 1): each CTA a cluster of one
        self.first_cta = first_cta
        self.n_cta = n_cta
        self.grid = grid
        self.block = block
        self.nt = block[0] * block[1] * block[2]
        self.n = n_cta * self.nt
        self.first_thread = first_cta * self.nt  # global linear id of chunk thread 0
        self.memory = memory
        self.params = params
        self.log = log
        self.log_shared = log_shared
        self.layout = layout
        self.shared = np.zeros((n_cta, max(layout.shared_size, 1)), np.uint8)
        self.local = np.zeros((self.n, max(layout.local_size, 1)), np.uint8)
        self.serial = 0  # execution counter: one per instruction a group executes
        self.epoch = 0  # barrier epoch: bumped when the chunk's CTAs pass a barrier
        self.async_copies = async_copies  # "modelled" or "immediate" (see ptx_executor.isa_async)
        self.async_pending = 0  # cp.async copies issued and not yet landed; 0 keeps every hook idle
        self.async_state = None  # the in-flight copies, created by the first cp.async
        self.mbarriers = None  # the chunk's mbarrier objects, created by the first mbarrier.init (isa_mbar)
        self.bulk_hooks = False  # True once bulk copies need shared/global accesses checked (isa_bulk)
        self.bulk_state = None  # pending bulk copies, bulk groups, unfenced generic writes
        t = np.arange(self.n, dtype=np.int64)
        self.cta_local = t // self.nt
        self.tlin = t % self.nt
        self.lane = (self.tlin % 32).astype(np.int64)
        self.warp = self.cta_local * ((self.nt + 31) // 32) + self.tlin // 32
        self.warp_base = t - self.lane
        self.warp_size = np.minimum(32, self.nt - (self.tlin - self.lane))
        self.n_warps = n_cta * ((self.nt + 31) // 32)
        self.exited = np.zeros(self.n, bool)
        self.cluster_barrier = None  # arrivals and waits at barrier.cluster, created by the first (isa_cluster)
        self.griddep_waited = None  # per thread: passed griddepcontrol.wait (isa_griddep)
        self.regs: dict = {}
        for name, ptx_type in entry.reg_types.items():
            st = storage_of(ptx_type)
            if st is np.bool_:
                self.regs[name] = np.zeros(self.n, np.bool_)
            else:
                self.regs[name] = np.full(self.n, _POISON[st], st)
        self.special = self._specials()

    # ------------------------------------------------------------------ identities
    def _specials(self) -> dict:
        bx, by, bz = self.block
        gx, gy, gz = self.grid
        cta = self.first_cta + self.cta_local
        u32 = np.uint32
        sp = {
            "%tid.x": (self.tlin % bx).astype(u32),
            "%tid.y": ((self.tlin // bx) % by).astype(u32),
            "%tid.z": (self.tlin // (bx * by)).astype(u32),
            "%ctaid.x": (cta % gx).astype(u32),
            "%ctaid.y": ((cta // gx) % gy).astype(u32),
            "%ctaid.z": (cta // (gx * gy)).astype(u32),
            "%laneid": self.lane.astype(u32),
            "%warpid": (self.tlin // 32).astype(u32),
        }
        cx, cy, cz = self.cluster
        pos = ((cta % gx) % cx, ((cta // gx) % gy) % cy, (cta // (gx * gy)) % cz)
        for axis, c, g, p in zip("xyz", self.cluster, self.grid, pos):
            sp[f"%clusterid.{axis}"] = (sp[f"%ctaid.{axis}"] // c).astype(u32)
            sp[f"%cluster_ctaid.{axis}"] = p.astype(u32)
        sp["%cluster_ctarank"] = (pos[0] + cx * (pos[1] + cy * pos[2])).astype(u32)
        for k, v in (("%ntid.x", bx), ("%ntid.y", by), ("%ntid.z", bz), ("%nctaid.x", gx),
                     ("%nctaid.y", gy), ("%nctaid.z", gz), ("%nwarpid", (self.nt + 31) // 32),
                     ("%dynamic_smem_size", self.layout.dynamic),
                     ("%total_smem_size", self.layout.shared_size),
                     ("%nclusterid.x", gx // cx), ("%nclusterid.y", gy // cy), ("%nclusterid.z", gz // cz),
                     ("%cluster_nctaid.x", cx), ("%cluster_nctaid.y", cy), ("%cluster_nctaid.z", cz),
                     ("%cluster_nctarank", cx * cy * cz), ("%is_explicit_cluster", int(self.cluster != (1, 1, 1)))):
            sp[k] = np.full(self.n, v, u32)
        lane = self.lane.astype(np.uint64)
        one = np.uint64(1)
        sp["%lanemask_eq"] = (one << lane).astype(u32)
        sp["%lanemask_lt"] = ((one << lane) - one).astype(u32)
        sp["%lanemask_le"] = ((one << (lane + one)) - one).astype(u32)
        sp["%lanemask_ge"] = (~((one << lane) - one) & np.uint64(0xFFFFFFFF)).astype(u32)
        sp["%lanemask_gt"] = (~((one << (lane + one)) - one) & np.uint64(0xFFFFFFFF)).astype(u32)
        return sp

    def who(self, t: int) -> tuple:
        """``((ctaid x, y, z), (tid x, y, z))`` of chunk thread ``t``."""
        gx, gy, _ = self.grid
        bx, by, _ = self.block
        cta = self.first_cta + t // self.nt
        tl = t % self.nt
        return (cta % gx, (cta // gx) % gy, cta // (gx * gy)), (tl % bx, (tl // bx) % by, tl // (bx * by))

    def threads(self, idx) -> np.ndarray:
        return np.arange(self.n, dtype=np.int64) if idx is None else idx

    # ------------------------------------------------------------------ registers
    def read(self, op, dtype, idx):
        """Operand ``op`` as ``dtype`` values for the threads ``idx`` (array or numpy scalar)."""
        dtype = np.dtype(dtype)
        if isinstance(op, Reg):
            arr = self.regs[op.name]
            vals = arr if idx is None else arr[idx]
            return _convert(vals, dtype)
        if isinstance(op, Imm):
            return imm_value(op, dtype)
        if isinstance(op, Special):
            vals = self.special[op.name] if idx is None else self.special[op.name][idx]
            return _convert(vals, dtype)
        if isinstance(op, Sym):
            return _convert(np.uint64(self.symbol_address(op.name)), dtype)
        raise PTXError(f"cannot read operand {op!r} as a value")

    def write(self, op, value, dtype, idx) -> None:
        """Store ``value`` (``dtype`` semantics) into register ``op`` for threads ``idx``."""
        if op is None:
            return  # the sink "_"
        arr = self.regs[op.name]
        dtype = np.dtype(dtype)
        value = np.asarray(value)
        if value.dtype != dtype:
            value = value.astype(dtype)
        if arr.dtype == np.bool_ or arr.dtype.itemsize == dtype.itemsize:
            target = arr if arr.dtype == dtype or arr.dtype == np.bool_ else arr.view(dtype)
        else:  # narrower or wider register than the type: extend by the type's signedness
            target = arr
            value = _convert(value, arr.dtype, sign_extend=dtype.kind == "i")
        if idx is None:
            target[...] = value
        else:
            target[idx] = value

    def symbol_address(self, name: str) -> int:
        if name not in self.layout.offsets:
            raise PTXError(f"symbol {name!r} has no address (not a shared or local variable)")
        return self.layout.offsets[name]


def _convert(vals, dtype, sign_extend: bool | None = None):
    """Reinterpret or resize register bits as ``dtype`` (truncate, or extend by signedness)."""
    vals = np.asarray(vals)
    src = vals.dtype
    if src == dtype:
        return vals
    if dtype == np.bool_:
        return vals.astype(np.bool_)
    if src == np.bool_:
        return vals.astype(_unsigned(dtype)).view(dtype)
    if src.itemsize == dtype.itemsize:
        return vals.view(dtype)
    if src.itemsize > dtype.itemsize:  # truncate to the low bits
        return vals.view(_unsigned(src)).astype(_unsigned(dtype)).view(dtype)
    signed = dtype.kind == "i" if sign_extend is None else sign_extend
    if signed:
        wide = vals.view(np.dtype(f"i{src.itemsize}")).astype(np.dtype(f"i{dtype.itemsize}"))
    else:
        wide = vals.view(_unsigned(src)).astype(_unsigned(dtype))
    return wide.view(dtype)
