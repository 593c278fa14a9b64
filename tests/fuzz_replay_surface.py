"""The fuzz harness's replay surface, run by ``tests/fuzz_surface_worker.py replay``.

Hypothesis draws a replay entry point (``mamba3_step_fn``'s replay mode, ``check_replay_inputs`` --
the validation every device's path runs first --, ``materialize_fn`` (its checks, then the CPU
path), a replay plan's ``StepPlan.run``, ``decode_step`` and the graph runner's ``step`` (its CPU
path) on a :class:`~mamba3_step.serving.ReplayStatePool`, and the pool's ``materialize``, ``reset``,
``copy`` and ``fork``, which move rings), one of its arguments (a field of the step's tensors, a
field of the ring, ``num_accepted_tokens``, ``replay_flush_length``, an option, or the ring bundle
itself) and an odd value for it (the worker's odd tensors and scalars), calls it with otherwise
valid arguments, and records a failure when the call raises anything but a named
``TypeError``/``ValueError`` or, refused, changed a byte of the pool's rows, its ring or its
allocator, the runner's buffers, the weights or the odd value itself (every tensor reachable from
the call's arguments). Valid calls are one-token steps and T = 2 verify steps (with ``num_accepted_tokens``) on
a pool made for 2 drafts, so the rings move through appends, flushes and commits while the harness
runs.

Letters (docs/contract.md): B lanes, T drafts, P pool rows, H heads, D head dim, N state size,
R MIMO rank, K the flush length.
"""

from __future__ import annotations

import torch

from mamba3_step import mamba3_step_fn, materialize_fn, plan_step
from mamba3_step.replay_validation import check_replay_inputs
from mamba3_step.serving import CudaGraphStepRunner, ReplayStatePool, decode_step
from mamba3_step.signature import StepOptions
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import lane_inputs, layer_weights, poison_pool

from fuzz_helper_surface import judged_reachable  # noqa: E402  (tests/ is the script's folder)

H, D, N, R, P, B, K, T = 2, 32, 32, 2, 6, 3, 3, 2

STEP_FIELDS = ("state", "Bstate", "Xstate", "A", "B", "C", "D", "x", "dt", "trap", "xproj", "outproj", "out", "z",
               "zproj", "state_batch_indices", "dst_state_batch_indices", "angle_state", "rand_seed")
RING_FIELDS = ("ring.B", "ring.x", "ring.coef", "ring.length", "ring.offset", "ring.angle")
CALL_ARGS = ("replay_ring", "replay_flush_length", "num_accepted_tokens", "null_slot_id", "replay_from_checkpoint",
             "rotate_pairwise", "tile_D", "num_warps")
LANE = ("A", "B", "C", "x", "dt", "trap", "z")
WEIGHTS = ("D", "xproj", "zproj", "outproj")
#: entry -> the arguments it takes (materialize: the slots and the layer's weights)
ENTRIES = {
    "mamba3_step_fn replay": STEP_FIELDS + RING_FIELDS + CALL_ARGS,
    "check_replay_inputs": STEP_FIELDS + RING_FIELDS + CALL_ARGS,
    "replay plan.run": STEP_FIELDS + RING_FIELDS + ("replay_ring", "num_accepted_tokens", "null_slot_id"),
    "decode_step": LANE + WEIGHTS + ("out", "state_batch_indices", "dst_state_batch_indices", "num_accepted_tokens",
                                     "tile_D", "num_warps"),
    "materialize": WEIGHTS + ("slots", "rotate_pairwise"),
    "materialize_fn": ("state", "Bstate", "Xstate", "D", "xproj", "angle_state", "rand_seed") + RING_FIELDS
    + ("tensors", "ring", "rows", "rotate_pairwise"),
    "runner": LANE + ("state_batch_indices", "dst_state_batch_indices", "num_accepted_tokens"),
    "reset": ("slots",),
    "copy": ("src", "dst"),
    "fork": ("src", "n"),
}


class ReplaySurface:
    """A replay pool (one layer, K = 3, made for 2 drafts), its weights, and a plan per step form."""

    def __init__(self):
        self.pool = ReplayStatePool(1, P, H, D, N, R, reserve_null_slot=True, replay_ring=K, replay_draft=T)
        poison_pool(self.pool, torch.Generator().manual_seed(11))
        self.mine = self.pool.alloc(3).tolist()
        self.g = torch.Generator().manual_seed(12)
        self.weights = layer_weights(H, D, R, generator=self.g)
        self.slots = torch.tensor([self.mine[0], -1, self.mine[1]], dtype=torch.int32)
        self.runner = CudaGraphStepRunner(self.pool, 0, buckets=(4,), **self.weights)
        self.plans = {}
        for tokens in (None, T):
            t = self.tensors(tokens)._replace(replay_ring=self.pool.ring(0), num_accepted_tokens=self.accepted(tokens))
            self.plans[tokens] = plan_step(**t._asdict(), update_kv_state=True, replay_flush_length=K)

    def tensors(self, tokens) -> StepTensors:
        lane = lane_inputs(B, H, D, N, R, tokens=tokens, generator=self.g)
        return StepTensors(**self.pool.layer_rows(0), **{k: lane[k] for k in LANE}, **self.weights,
                           state_batch_indices=self.slots, null_slot_id=self.pool.null_slot_id)

    def accepted(self, tokens):
        """A verify step's ``num_accepted_tokens``: as many of each lane's drafts as the ring can still commit
        (at most T), so the valid call stays valid while odd calls that succeed move the rings."""
        if not tokens:
            return None
        ring = self.pool.ring(0)
        room = ring.B.shape[1] - ring.length[self.slots.clamp(min=0).long(), 0]
        return room.clamp(0, T).to(torch.int32)

    def call(self, entry: str, name: str, value, tokens):
        """``entry`` with argument ``name`` replaced by ``value`` (``tokens``: None, a one-token step,
        or ``T``, a verify step committing ``accepted`` first)."""
        if entry in _POOL_METHODS:
            return self._pool_method(entry, name, value)
        t, ring = self.tensors(tokens), self.pool.ring(0)
        args = {"replay_flush_length": K, "num_accepted_tokens": self.accepted(tokens)}
        if name == "-":  # the valid call
            pass
        elif name in STEP_FIELDS or name == "null_slot_id":
            t = t._replace(**{name: value})
        elif name in RING_FIELDS:
            ring = ring._replace(**{name[len("ring."):]: value})
        elif name == "tensors":
            t = value
        elif name in ("ring", "replay_ring"):  # materialize_fn's, the step's
            ring = value
        else:
            args[name] = value
        if entry == "decode_step":
            return self._decode(t, args)
        if entry == "runner":
            return self.runner.step(t.state_batch_indices, **{k: getattr(t, k) for k in LANE},
                                    dst_slots=t.dst_state_batch_indices, num_accepted_tokens=args["num_accepted_tokens"])
        if entry == "replay plan.run":
            return self.plans[tokens].run(**t._replace(replay_ring=ring,
                                                       num_accepted_tokens=args["num_accepted_tokens"])._asdict())
        if entry == "materialize_fn":
            return materialize_fn(t, ring, args.get("rows", self.mine[:2]),
                                  rotate_pairwise=args.get("rotate_pairwise", False))
        t = t._replace(replay_ring=ring, num_accepted_tokens=args.pop("num_accepted_tokens"))
        options = StepOptions(update_kv_state=True, **args)
        if entry == "check_replay_inputs":
            return check_replay_inputs(t, options)
        return mamba3_step_fn(**t._asdict(), **options._asdict())

    def _pool_method(self, entry: str, name: str, value):
        """``materialize``, ``reset``, ``copy`` or ``fork`` with argument ``name`` replaced (a fork's new
        slots are freed again, so the surface keeps its slots)."""
        kw = dict(_POOL_METHODS[entry](self))
        if name != "-":
            kw[name] = value
        if entry == "materialize":
            return self.pool.materialize(0, kw.pop("slots"), **kw)
        got = getattr(self.pool, entry)(*kw.values())
        if entry == "fork":
            self.pool.free(got)
        return got

    def _decode(self, t: StepTensors, args: dict):
        options = {k: args[k] for k in ("tile_D", "num_warps") if k in args}
        return decode_step(self.pool, 0, t.state_batch_indices, **{k: getattr(t, k) for k in LANE + WEIGHTS + ("out",)},
                           dst_slots=t.dst_state_batch_indices, num_accepted_tokens=args["num_accepted_tokens"],
                           **options)


#: the pool methods the surface calls, with their valid arguments by name, in order (a free slot
#: receives a copy: the surface's own three slots keep their rows)
_POOL_METHODS = {
    "materialize": lambda s: dict(s.weights, slots=s.mine[:2]),
    "reset": lambda s: {"slots": [s.mine[2]]},
    "copy": lambda s: {"src": [s.mine[0]], "dst": [s.mine[2]]},
    "fork": lambda s: {"src": s.mine[1], "n": 1},
}


def replay_example(surface: ReplaySurface, arg: int, odd_value, judged) -> tuple:
    """One example: ``(label, problem)`` for the entry, argument and step form ``arg`` picks, given
    ``odd_value(base)`` (the drawn odd value, for an argument whose valid value is ``base``) and
    ``judged(fn, snapshot, unchanged)`` (the worker's judge of one call)."""
    entry = sorted(ENTRIES)[arg % len(ENTRIES)]
    names = ENTRIES[entry]
    name = names[arg // len(ENTRIES) % len(names)]
    tokens = T if arg // 7919 % 2 and entry not in (*_POOL_METHODS, "materialize_fn") else None
    value = odd_value(_valid(surface, name, tokens))
    label = f"{entry} {name}" + (f" (verify step, T = {tokens})" if tokens else "")
    problem = judged_reachable(judged, lambda: surface.call(entry, name, value, tokens),
                               (surface.pool, surface.runner, surface.weights, value),
                               lambda: (surface.pool.num_free, tuple(surface.pool.allocated_slots())))
    return label, problem


def _valid(surface: ReplaySurface, name: str, tokens):
    """The valid value of argument ``name`` (None where the call leaves it out)."""
    if name in surface.weights:
        return surface.weights[name]
    if name.startswith("ring."):
        return getattr(surface.pool.ring(0), name[len("ring."):])
    if name in ("state_batch_indices", "slots", "src", "dst"):
        return surface.slots
    if name == "rows":
        return torch.tensor(surface.mine[:2])
    if name == "num_accepted_tokens":
        return surface.accepted(T)
    if name in StepTensors._fields:
        return getattr(surface.tensors(tokens), name)
    return None
