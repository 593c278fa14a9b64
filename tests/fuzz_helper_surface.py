"""The fuzz harness's helper surface, run by ``tests/fuzz_surface_worker.py helpers``.

Hypothesis draws one of the ring's helpers (``new_ring``, ``fork_row``), an allocator method of a
:class:`~mamba3_step.serving.ReplayStatePool` (``alloc``, ``alloc_spec``, with ``zero``), a graph
runner method (``capture``, and ``step`` with stochastic rounding on a 16-bit pool), or ``decode_step``
with stochastic rounding (``rand_seed``, ``stochastic_rounding``, ``dst_slots`` and a verify step's
drafts on a replay pool), one of its arguments and an odd value for it (the worker's odd tensors and
scalars, plus a tensor made under ``torch.inference_mode()``), calls it with otherwise valid
arguments, and records a failure when the call raises anything but a named ``TypeError``/``ValueError``
or, refused, changed a byte of any tensor reachable from its arguments (the pool's row and ring
allocations, the runner's static buffers and fixed tensors, the seed, the odd value itself) or the
allocator.

Letters (docs/contract.md): B lanes, T drafts, P pool rows, H heads, D head dim, N state size,
R MIMO rank, S rotary angles, K flush length.
"""

from __future__ import annotations

import torch

from mamba3_step.replay import Ring, fork_row, new_ring
from mamba3_step.serving import CudaGraphStepRunner, ReplayStatePool, StatePool, StepForm, decode_step
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import lane_inputs, layer_weights, poison_pool

H, D, N, R, P, B, K, T, S = 2, 32, 32, 2, 6, 3, 2, 2, 4

NEW_RING = dict(rows=P, flush_length=K, mimo=R, heads=H, dstate=N, headdim=D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16,
                draft=T, stochastic=True, rope_angles=S, device="cpu")
ROW_FIELDS = ("state", "Bstate", "Xstate", "state_scale", "angle_state")
RING_FIELDS = tuple(f"ring.{f}" for f in Ring._fields)
LANE = ("A", "B", "C", "x", "dt", "trap", "z")
#: entry -> the arguments it takes
ENTRIES = {
    "new_ring": tuple(NEW_RING),
    "fork_row": ROW_FIELDS + RING_FIELDS + ("tensors", "ring", "null_slot_id", "src", "dst"),
    "alloc": ("n", "zero"),
    "alloc_spec": ("n", "T", "zero"),
    "runner.capture": ("buckets", "form"),
    "runner.step": LANE + ("slots", "dst_slots"),
    "decode_step": LANE + ("slots", "dst_slots", "rand_seed", "stochastic_rounding", "drafts"),
}


def reachable(*roots) -> list:
    """Every tensor reachable from ``roots``: tensors, and the tensors inside tuples, lists, dicts,
    pools (their row and ring allocations) and runners (their pool, fixed tensors and static buffers)."""
    found, stack = [], list(roots)
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, StatePool):
            stack.extend(obj._pools())
        elif isinstance(obj, CudaGraphStepRunner):
            stack.extend([obj.pool, obj._weights, *obj._static.values()])
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (tuple, list)):
            stack.extend(obj)
    return found


def as_bytes(t: torch.Tensor):
    """``t``'s elements as bytes (a copy), or None for a tensor that has none to compare (meta, freed,
    nested, sparse, mkldnn, quantized)."""
    try:
        if t.layout is not torch.strided or t.is_quantized or t.is_meta or t.is_nested:
            return None
        if t.numel() and t.untyped_storage().nbytes() == 0:
            return None
        return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()
    except (RuntimeError, TypeError, NotImplementedError):
        return None


class HelperSurface:
    """A replay pool with angles and an 8-bit state (its rings keep offsets and angles), a 16-bit pool,
    a runner on each, the layer's weights and a seed."""

    def __init__(self):
        self.g = torch.Generator().manual_seed(31)
        self.weights = layer_weights(H, D, R, generator=self.g)
        self.weights.update(B_bias=torch.randn(R, H, N, generator=self.g),
                            C_bias=torch.randn(R, H, N, generator=self.g))
        self.replay = ReplayStatePool(1, P, H, D, N, R, state_dtype=torch.int8, rope_angles=S, replay_ring=K,
                                      replay_draft=T, reserve_null_slot=True)
        self.half = StatePool(1, P, H, D, N, R, state_dtype=torch.bfloat16, reserve_null_slot=True)
        for pool in (self.replay, self.half):
            poison_pool(pool, torch.Generator().manual_seed(32))
            pool.alloc(3)
        self.seed = torch.tensor([2026, 5], dtype=torch.int64)
        plain = {k: v for k, v in self.weights.items() if k not in ("B_bias", "C_bias")}
        self.runner = CudaGraphStepRunner(self.half, 0, buckets=(2, 4), with_dst=True, stochastic_rounding=True,
                                          rand_seed=self.seed, **plain)
        self.ring = new_ring(**NEW_RING)
        self.rows = StepTensors(**{k: torch.randn(P, *s, generator=self.g) for k, s in
                                   (("state", (H, D, N)), ("Bstate", (R, H, N)), ("Xstate", (H, D)),
                                    ("state_scale", (H, D)))},
                                angle_state=torch.randint(-2**40, 2**40, (P, H, S), generator=self.g),
                                A=None, B=None, C=None, D=None, x=None, dt=None, trap=None, xproj=None, null_slot_id=0)
        self.slots = torch.tensor([1, 0, 2], dtype=torch.int32)  # 0: the null slot, padding

    def lane(self, pool, tokens=None, rotary=False) -> dict:
        lane = lane_inputs(B, H, D, N, R, tokens=tokens, generator=self.g, kv_dtype=pool.kv_dtype,
                           x_dtype=pool.x_dtype)
        if rotary:
            lane["angle_proj"] = torch.randn(*lane["A"].shape, S, generator=self.g)
        return lane

    def call(self, entry: str, name: str, value):
        """``entry`` with argument ``name`` replaced by ``value``; returns ``(fn, roots)``: the call and
        what its arguments reach."""
        if entry == "new_ring":
            kw = dict(NEW_RING, **{name: value})
            return (lambda: new_ring(**kw)), (value,)
        if entry == "fork_row":
            return self._fork_row(name, value)
        if entry in ("alloc", "alloc_spec"):
            kw = {"n": 1, **({"T": 1} if entry == "alloc_spec" else {}), "zero": False, name: value}

            def alloc():
                got = getattr(self.replay, entry)(*[v for k, v in kw.items() if k != "zero"], zero=kw["zero"])
                if entry == "alloc":
                    self.replay.free(got)
                else:
                    self.replay.free_spec(got)
            return alloc, (self.replay, value)
        if entry == "runner.capture":
            kw = {"buckets": [2], "form": StepForm(), name: value}
            return (lambda: self.runner.capture(**kw)), (self.runner, value)
        if entry == "runner.step":
            kw = {"slots": self.slots, "dst_slots": None, **self.lane(self.half), name: value}
            return (lambda: self.runner.step(**kw)), (self.runner, kw)
        return self._decode(name, value)

    def _fork_row(self, name, value):
        t, ring, rows = self.rows, self.ring, {"src": 1, "dst": 3}
        if name in ROW_FIELDS or name == "null_slot_id":
            t = t._replace(**{name: value})
        elif name in RING_FIELDS:
            ring = ring._replace(**{name[len("ring."):]: value})
        elif name == "tensors":
            t = value
        elif name == "ring":
            ring = value
        else:
            rows[name] = value
        return (lambda: fork_row(t, ring, rows["src"], rows["dst"])), (t, ring, value)

    def _decode(self, name, value):
        drafts = name == "drafts"
        lane = self.lane(self.replay, tokens=T if drafts else None, rotary=True)
        kw = {"slots": self.slots, **lane, **self.weights, "dst_slots": None, "stochastic_rounding": True,
              "rand_seed": self.seed}
        if drafts:  # a verify step's drafts, given a destination the verify step takes none of
            kw["dst_slots"] = value
        else:
            kw[name] = value
        return (lambda: decode_step(self.replay, 0, **kw)), (self.replay, kw)


def _inference_copy(t):
    with torch.inference_mode():
        return t.clone()


def helper_example(surface: HelperSurface, arg: int, odd_value, judged) -> tuple:
    """One example: ``(label, problem)`` for the entry and argument ``arg`` picks, given ``odd_value(base)``
    (the drawn odd value for an argument whose valid value is ``base``; one draw in seven an inference-mode
    copy of ``base`` instead) and ``judged(fn, snapshot, unchanged)`` (the worker's judge of one call)."""
    entry = sorted(ENTRIES)[arg % len(ENTRIES)]
    names = ENTRIES[entry]
    name = names[arg // len(ENTRIES) % len(names)]
    base = _valid(surface, entry, name)
    inference = arg // 7919 % 7 == 0 and isinstance(base, torch.Tensor)
    value = _inference_copy(base) if inference else odd_value(base)
    fn, roots = surface.call(entry, name, value)
    label = f"{entry} {name}" + (" (an inference-mode copy)" if inference else "")
    return label, judged_reachable(judged, fn, roots,
                                   lambda: (surface.replay.num_free, tuple(surface.replay.allocated_slots())))


def judged_reachable(judged, fn, roots, bookkeeping):
    """``judged(fn, snapshot, unchanged)`` with the snapshot of every tensor reachable from ``roots``
    (:func:`reachable`, as bytes) and ``bookkeeping()`` (the allocator's state), compared after a refusal."""
    tensors = reachable(*roots)

    def snapshot():
        return [as_bytes(t) for t in tensors], bookkeeping()

    def unchanged(snap):
        before, book = snap
        now = [as_bytes(t) for t in tensors]
        return book == bookkeeping() and all(a is None or b is None or torch.equal(a, b) for a, b in zip(before, now))

    return judged(fn, snapshot, unchanged)


def _valid(surface: HelperSurface, entry: str, name: str):
    """The valid value of ``entry``'s argument ``name`` (None where the call leaves it out)."""
    if entry == "new_ring":
        return NEW_RING[name]
    if entry == "fork_row":
        if name.startswith("ring."):
            return getattr(surface.ring, name[len("ring."):])
        return getattr(surface.rows, name, None) if name in ROW_FIELDS else None
    if name in ("slots", "dst_slots", "drafts"):
        return surface.slots
    if name == "rand_seed":
        return surface.seed
    if name in LANE:
        return surface.lane(surface.half)[name]
    return None
