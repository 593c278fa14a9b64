"""Shared test helpers: pool indices, poisoning, bit-exact assertions and the parity check.

Import them with ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path`` through
its conftest). The input factory and the bit helpers live in the package
(:mod:`mamba3_step.testing`, shared with the demo); they are re-exported here.

Letters (docs/contract.md): B batch lanes, P pool rows, H heads, D head dim, N state size,
R MIMO rank.

* :func:`make_inputs` - a dict of fresh random step inputs, keyed like ``mamba3_step_fn``'s
  arguments (``state``, ``Bstate``, ..., ``z``, ``zproj``; ``outproj``/``z``/``zproj`` are None
  when disabled), ready for ``mamba3_step_fn(**inputs)``.
* :func:`make_pool_indices` / :func:`build_pool_indices` - race-free int32 pool indices with
  live lanes and padding lanes of the three kinds (negative, ``>= P``, ``null_slot_id``), and
  live lanes whose destination is padding.
* :func:`poison_` / :func:`poison_rows_` - fill a tensor (or some of its rows) with random bit
  patterns (NaN, inf, huge and tiny values included), in place.
* :func:`bits` / :func:`assert_bits_equal` - NaN-safe bit-for-bit comparison.
* :func:`gather_dense_scatter` - the expected result of a pool-mode call, computed as
  docs/contract.md defines it (``mamba3_step.serving.gather_dense_scatter`` on copies).
* :func:`check_pool_parity` - poison, run a pool-mode call and assert it bit-identical to
  :func:`gather_dense_scatter` (padding zeros, untouched rows, read-only inputs included);
  ``step_fn`` lets GPU tests run it on the kernel.
* :func:`replay_call` / :func:`replay_fn` / :func:`replay_spec` - a replay step of a bundle: as
  ``mamba3_step_fn``'s bundles, run through ``mamba3_step_fn``, or validated
  (:func:`mamba3_step.replay_validation.check_replay_inputs`, what every device's path checks).
* :func:`count_calls` - replace a module's function with one that records each call.
* :func:`run_threads` / :func:`fast_thread_switching` / :class:`YieldingHeapq` - the race tests'
  harness: callables in threads with the interpreter switching threads as often as it can, and
  a ``heapq`` that gives the GIL away before every operation.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import random
import sys
import threading
import time
from typing import Callable, Iterable

import pytest
import torch

from mamba3_step import mamba3_step_fn
from mamba3_step.contract import lane_is_live, source_rows
from mamba3_step.serving import gather_dense_scatter as _gather_dense_scatter
from mamba3_step.replay_validation import check_replay_inputs
from mamba3_step.signature import StepOptions
from mamba3_step.tensors import StepTensors
from mamba3_step.tools.replay_reference import append_reference
from mamba3_step.tools.verify.step import tolerance
from mamba3_step.testing import SPECULATIVE_PAD_KINDS, bits, bits_equal, make_inputs, poison_  # noqa: F401 (re-exported)

PAD_KINDS = ("negative", "oob", "null")
LANE_KINDS = ("live", "live_nodst") + PAD_KINDS


def replay_call(tensors: StepTensors, ring, flush_length, **kwargs) -> tuple:
    """``(StepTensors, StepOptions)`` of a replay step of the pool-mode bundle ``tensors`` with ``ring``
    and ``flush_length``: ``num_accepted_tokens`` in ``kwargs`` goes to the tensors, the rest are
    ``mamba3_step_fn``'s options (``update_kv_state`` True and ``stochastic_rounding`` as ``rand_seed``
    says unless given)."""
    extra = {"num_accepted_tokens": kwargs.pop("num_accepted_tokens")} if "num_accepted_tokens" in kwargs else {}
    options = dict(update_kv_state=True, stochastic_rounding=tensors.rand_seed is not None,
                   replay_flush_length=flush_length)
    options.update(kwargs)
    return tensors._replace(replay_ring=ring, **extra), StepOptions(**options)


def replay_fn(tensors: StepTensors, ring, flush_length, **kwargs) -> torch.Tensor:
    """:func:`replay_call` through ``mamba3_step_fn`` (its replay mode); returns ``out``."""
    t, options = replay_call(tensors, ring, flush_length, **kwargs)
    return mamba3_step_fn(**t._asdict(), **options._asdict())


def replay_spec(tensors: StepTensors, ring, flush_length, **kwargs):
    """:func:`replay_call`'s checks, those of every device's path: the replay specialisation, or the
    named error."""
    return check_replay_inputs(*replay_call(tensors, ring, flush_length, **kwargs))


def clone_inputs(inputs: dict) -> dict:
    """A deep copy of an inputs dict (None stays None)."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def poison_rows_(t: torch.Tensor, rows, seed: int = 4321) -> torch.Tensor:
    """Poison (random bits) rows ``rows`` (indices along dim 0) of ``t`` in place; returns ``t``."""
    rows = torch.as_tensor(list(rows) if not isinstance(rows, torch.Tensor) else rows,
                           dtype=torch.int64, device=t.device)
    if rows.numel():
        t[rows] = poison_(torch.empty((rows.numel(),) + tuple(t.shape[1:]), dtype=t.dtype), seed).to(t.device)
    return t


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Assert same dtype, shape and identical bits; the message counts the differing elements."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = bits(actual).cpu(), bits(expected).cpu()
    if not torch.equal(a, e):
        diff = (a != e)
        first = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(diff.sum())} of {diff.numel()} elements differ in their bits; first at "
            f"{first}: {actual.cpu()[first].item()!r} != {expected.cpu()[first].item()!r}"
        )


def _pad_value(kind: str, P: int, null_slot_id, rng: random.Random) -> int:
    if kind == "negative":
        return rng.choice([-1, -1, -2, -7, -(2**31)])
    if kind == "oob":
        return rng.choice([P, P, P + 1, P + 13, 2**31 - 1])
    if kind == "null":
        assert null_slot_id is not None, "padding kind 'null' needs a null_slot_id"
        return null_slot_id
    raise AssertionError(f"unknown padding kind {kind!r}")


def build_pool_indices(
    kinds: list[str],
    P: int,
    *,
    null_slot_id: int | None = None,
    with_dst: bool = False,
    seed: int = 0,
    device="cpu",
):
    """Race-free pool indices with one lane per entry of ``kinds``.

    Lane kinds: ``"live"`` (reads a real row and writes one), ``"live_nodst"`` (reads a real row,
    its destination is padding so it writes nothing; only with ``with_dst``), and the padding
    kinds ``"negative"``, ``"oob"`` (``>= P``), ``"null"`` (``== null_slot_id``). Live lanes get
    distinct destination rows; a live lane reads either its own destination row (in place) or a
    row no lane writes (shared reads allowed), so no lane writes a row another live lane reads.
    Live lanes that do not fit in the pool become ``"negative"`` padding. Padding lanes' dst are
    random values, in range or not, as a padded batch may leave them: they must write nothing.

    Returns ``(src, dst, kinds)``: int32 (B,) tensors (``dst`` None without ``with_dst``) and the
    lane kinds actually used.
    """
    rng = random.Random(seed)
    kinds = list(kinds)
    usable = [r for r in range(P) if r != null_slot_id]
    rng.shuffle(usable)
    if not with_dst:
        kinds = ["live" if k == "live_nodst" else k for k in kinds]
    writers = [b for b, k in enumerate(kinds) if k == "live"]
    for b in writers[len(usable):]:
        kinds[b] = "negative"
    writers = writers[: len(usable)]
    dst_rows = {b: usable[i] for i, b in enumerate(writers)}
    readonly = usable[len(writers):]  # rows nobody writes

    src, dst = [0] * len(kinds), [0] * len(kinds)
    for b, k in enumerate(kinds):
        if k == "live":
            dst[b] = dst_rows[b]
            src[b] = dst[b] if (not with_dst or not readonly or rng.random() < 0.5) else rng.choice(readonly)
        elif k == "live_nodst":
            if readonly:
                src[b] = rng.choice(readonly)
                dst[b] = _pad_value(rng.choice([p for p in PAD_KINDS if p != "null" or null_slot_id is not None]),
                                    P, null_slot_id, rng)
            else:
                kinds[b] = "negative"
        if kinds[b] in PAD_KINDS:
            src[b] = _pad_value(kinds[b], P, null_slot_id, rng)
            dst[b] = rng.choice([rng.randrange(-3, P + 3) if P else -1, src[b]])
    src_t = torch.tensor(src, dtype=torch.int32, device=device)
    dst_t = torch.tensor(dst, dtype=torch.int32, device=device) if with_dst else None
    return src_t, dst_t, kinds


def make_pool_indices(
    B: int,
    P: int,
    *,
    n_pad: int,
    layout: str = "interleaved",
    pad_kinds=PAD_KINDS,
    null_slot_id: int | None = None,
    with_dst: bool = False,
    nodst_fraction: float = 0.2,
    seed: int = 0,
    device="cpu",
):
    """Pool indices for ``B`` lanes, ``n_pad`` of them padding (cycling through ``pad_kinds``).

    ``layout``: ``"trailing"`` puts the padding lanes after the live ones (a padded CUDA-graph
    batch), ``"interleaved"`` shuffles them among the live lanes. With ``with_dst`` about
    ``nodst_fraction`` of the live lanes get a padding destination. Returns what
    :func:`build_pool_indices` returns.
    """
    rng = random.Random(seed)
    n_live = B - n_pad
    live = ["live_nodst" if with_dst and rng.random() < nodst_fraction else "live" for _ in range(n_live)]
    pads = [pad_kinds[i % len(pad_kinds)] for i in range(n_pad)]
    if layout == "trailing":
        kinds = live + pads
    elif layout == "interleaved":
        kinds = live + pads
        rng.shuffle(kinds)
    else:
        raise AssertionError(f"unknown layout {layout!r}")
    return build_pool_indices(kinds, P, null_slot_id=null_slot_id, with_dst=with_dst,
                              seed=seed + 1, device=device)


def read_rows(src: torch.Tensor, P: int, null_slot_id=None, num_accepted_tokens=None) -> set[int]:
    """The pool rows live lanes read (``src`` (B,), or (B, K) with ``num_accepted_tokens``)."""
    return {v for v in source_rows(src, num_accepted_tokens).tolist() if lane_is_live(v, P, null_slot_id)}


def written_rows(src: torch.Tensor, dst: torch.Tensor | None, P: int, null_slot_id=None,
                 num_accepted_tokens=None) -> set[int]:
    """The pool rows live lanes write: their real destination rows (every token's with a (B, T) dst)."""
    rows = source_rows(src, num_accepted_tokens)
    targets = rows.unsqueeze(1) if dst is None else (dst.long().unsqueeze(1) if dst.dim() == 1 else dst.long())
    return {r for b, lane in enumerate(targets.tolist()) if lane_is_live(int(rows[b]), P, null_slot_id)
            for r in lane if lane_is_live(r, P, null_slot_id)}


def gather_dense_scatter(
    inputs: dict,
    src: torch.Tensor,
    dst: torch.Tensor | None,
    *,
    null_slot_id: int | None = None,
    update_kv_state: bool = False,
    step_fn=None,
    num_accepted_tokens: torch.Tensor | None = None,
) -> dict:
    """Expected pool-mode result, the way docs/contract.md defines it, without touching ``inputs``.

    Runs :func:`mamba3_step.serving.gather_dense_scatter` (``step_fn``, default
    ``mamba3_step_fn``, does the dense step) on copies of the pools. Returns a dict with
    ``out``, ``state``, ``Bstate``, ``Xstate``, ``angle_state``, ``state_scale`` (the expected
    tensors; None where absent).
    """
    fields = {k: v for k, v in clone_inputs(inputs).items() if k in StepTensors._fields}
    fields.update(out=None, state_batch_indices=src, dst_state_batch_indices=dst, null_slot_id=null_slot_id,
                  num_accepted_tokens=num_accepted_tokens)
    tensors = StepTensors(**fields)
    out = _gather_dense_scatter(tensors, update_kv_state=update_kv_state, step_fn=step_fn or mamba3_step_fn)
    return {"out": out, "state": tensors.state, "Bstate": tensors.Bstate, "Xstate": tensors.Xstate,
            "angle_state": tensors.angle_state, "state_scale": tensors.state_scale}


POOL_STATE_KEYS = ("state", "Bstate", "Xstate")


def pool_keys(inputs: dict) -> tuple:
    """The per-row tensors of a call: ``POOL_STATE_KEYS``, and ``angle_state`` / ``state_scale`` when given."""
    return POOL_STATE_KEYS + tuple(k for k in ("angle_state", "state_scale") if inputs.get(k) is not None)


def check_pool_parity(
    inputs: dict,
    src: torch.Tensor,
    dst: torch.Tensor | None,
    kinds: list[str],
    *,
    null_slot_id: int | None = None,
    update_kv_state: bool = False,
    seed: int = 0,
    step_fn=None,
    num_accepted_tokens: torch.Tensor | None = None,
    rotate_pairwise: bool = False,
) -> None:
    """Assert that a pool-mode call is bit-identical to :func:`gather_dense_scatter`.

    ``inputs`` (from :func:`make_inputs`), ``src``/``dst``/``kinds`` (from
    :func:`make_pool_indices` or :func:`build_pool_indices`) are not modified. Rows that no
    live lane reads are poisoned first (random bits), ``out`` is poisoned before the call. Then,
    bit for bit: out, state, Bstate, Xstate equal the gather -> dense -> scatter result;
    padding lanes' out is +0.0; rows no live lane writes are unchanged (and Bstate/Xstate
    entirely without ``update_kv_state``); indices and per-lane inputs are unchanged.
    ``step_fn`` (default ``mamba3_step_fn``) runs both the pool call and the dense twin.
    A T-token step (``inputs`` from ``make_inputs(tokens=T)``, indices from
    :func:`mamba3_step.testing.speculative_indices`) is checked against T one-token dense steps.
    """
    step_fn = functools.partial(step_fn or mamba3_step_fn, rotate_pairwise=rotate_pairwise)
    inputs = clone_inputs(inputs)
    keys = pool_keys(inputs)
    P = inputs["state"].shape[0]
    unread = sorted(set(range(P)) - read_rows(src, P, null_slot_id, num_accepted_tokens))
    for i, key in enumerate(keys):
        poison_rows_(inputs[key], unread, seed=seed * 7 + i)
    before = clone_inputs(inputs)

    expected = gather_dense_scatter(inputs, src, dst, null_slot_id=null_slot_id, update_kv_state=update_kv_state,
                                    step_fn=step_fn, num_accepted_tokens=num_accepted_tokens)

    out = poison_(torch.empty_like(expected["out"]), seed=seed + 99)
    indices = {"state_batch_indices": src, "dst_state_batch_indices": dst}
    if num_accepted_tokens is not None:
        indices["num_accepted_tokens"] = num_accepted_tokens
    indices_before = {k: None if v is None else v.clone() for k, v in indices.items()}
    ret = step_fn(**inputs, out=out, **indices, null_slot_id=null_slot_id, update_kv_state=update_kv_state)
    assert ret is out, "the function must return the out it was given"

    assert_bits_equal(out, expected["out"], "out")
    for key in keys:
        assert_bits_equal(inputs[key], expected[key], key)

    # Independent of the twin: padding lanes give +0.0 bits, unwritten rows keep their bits.
    pad = torch.tensor([k in PAD_KINDS + SPECULATIVE_PAD_KINDS for k in kinds], dtype=torch.bool,
                       device=out.device)
    assert_bits_equal(out[pad], torch.zeros_like(out[pad]), "padding lanes' out")
    written = written_rows(src, dst, P, null_slot_id, num_accepted_tokens)
    untouched = torch.tensor(sorted(set(range(P)) - written), dtype=torch.int64, device=out.device)
    for key in keys:
        if key in ("Bstate", "Xstate") and not update_kv_state:
            assert_bits_equal(inputs[key], before[key], f"{key} (no update_kv_state)")
        assert_bits_equal(inputs[key][untouched], before[key][untouched], f"{key} untouched rows")
    for key, value in indices.items():
        if value is not None:
            assert torch.equal(value, indices_before[key]), f"{key} was modified"
    for key, value in inputs.items():
        if key not in keys and value is not None:
            assert_bits_equal(value, before[key], f"{key} (read-only input)")


def assert_accurate(where: str, got: torch.Tensor, want64: torch.Tensor, torch32: torch.Tensor, scale: float,
                    *, near_cpu: bool = False) -> None:
    """``got`` within :func:`mamba3_step.tools.verify.tolerance` of the float64 ``want64``: at most twice
    the error of ``torch32`` (PyTorch float32 on the same inputs) plus 1e-6 of ``scale``; with
    ``near_cpu`` also within three times that error of ``torch32`` itself."""
    budget = (torch32.double() - want64).abs().max().item()
    err = (got.double() - want64).abs().max().item()
    assert err <= tolerance(budget, scale), f"{where}: error {err:.3g} vs PyTorch-fp32's {budget:.3g}"
    if near_cpu:
        diff = (got.double() - torch32.double()).abs().max().item()
        assert diff <= tolerance(1.5 * budget, scale), f"{where}: differs from the CPU path by {diff:.3g}"


def assert_append_accurate(where: str, got: torch.Tensor, call: StepTensors, rows: dict, ring: dict, row: int, b: int,
                           angles=None, pairwise: bool = False) -> None:
    """Lane ``b``'s ``out`` of a replay append from the checkpoint (row ``row``) within
    :func:`assert_accurate` of the float64 algebra from the stored checkpoint
    (:func:`mamba3_step.tools.replay_reference.append_reference`): ``rows`` the pools before the step (state,
    Bstate, Xstate, state_scale where present), ``ring`` the ring's fields before it; with rotary
    ``angles`` the ring's angles after it (the token's angle is the one the step stored with its
    entry)."""
    base = tuple(rows[k] for k in ("state", "Bstate", "Xstate", "state_scale") if k in rows)
    angle = None if angles is None else angles[row, int(ring["length"][row, 0])]
    want64, torch32 = (append_reference(call, base, ring, row, b, cd, angle, pairwise)
                       for cd in (torch.float64, torch.float32))
    assert_accurate(where, got, want64, torch32.to(got.dtype), want64.abs().max().item())


@contextlib.contextmanager
def fast_thread_switching():
    """Inside, the interpreter switches threads as often as it can: races show up at once."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def run_threads(targets: Iterable[Callable[[], None]]) -> None:
    """Each callable in a thread of its own, all started, then all joined, with
    :func:`fast_thread_switching`. The callables record their own errors."""
    with fast_thread_switching():
        threads = [threading.Thread(target=t) for t in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


class YieldingHeapq:
    """``heapq`` whose operations first give the GIL away: a thread switch lands between the
    allocator's check and its update as often as possible (what a busy server does sometimes)."""

    def __getattr__(self, name):
        fn = getattr(heapq, name)

        def wrapped(*args):
            time.sleep(0)
            return fn(*args)
        return wrapped


class RecordingKernel:
    """A stand-in for a compiled kernel: records the arguments of each launch (tests of the launch
    paths without a GPU)."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def count_calls(monkeypatch, module, name: str) -> list:
    """``module.name`` replaced (for the test) by a wrapper appending one entry per call to the
    returned list, then calling the real function."""
    calls = []
    real = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls



def assert_refused_and_unchanged(what: str, fn, call: dict, inputs: dict, exc, message: str, **extra) -> None:
    """``fn(**call, **extra)`` raises ``exc`` matching ``message``, and every tensor of ``inputs``
    keeps its bits (a failed call changes nothing)."""
    before = clone_inputs(inputs)
    with pytest.raises(exc, match=message):
        fn(**call, **extra)
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            assert bits_equal(value, before[key]), f"{what}: {key} changed"


#: the row operations :func:`reset_copy_fork` applies to a pool with 7 allocated slots ``s`` = 0..6
#: and 10 rows: rows 1 and 3 reset, and each other row's source row afterwards
RESET_ROWS = (1, 3)
COPIED_FROM = {0: 0, 2: 6, 6: 2, 4: 0, 5: 0, 7: 0, 8: 0}


def reset_copy_fork(pool) -> None:
    """Reset, copy (a broadcast and a permutation, sources read before any write) and fork on ``pool``:
    afterwards row r holds what row ``COPIED_FROM.get(r, r)`` held, rows ``RESET_ROWS`` are zero."""
    s = pool.alloc(7)
    pool.reset(s[list(RESET_ROWS)])
    pool.copy(s[0], s[4:6])  # broadcast: one parent, two children
    pool.copy([2, 6], [6, 2])  # a permutation
    kids = pool.fork(int(s[0]), 2)
    assert kids.tolist() == [7, 8]
