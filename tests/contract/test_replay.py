"""Replay's CPU path (mamba3_step.replay; docs/contract.md, "Replay"): long random decodes in which
requests join, leave and fork, each step run twice, stepwise (the pool-mode CPU path with
update_kv_state) and with replay, on pools that start equal.

* Every row's materialised state (checkpoint + ring) equals the stepwise pool's row bit for bit
  after every step (state, Bstate, Xstate), and a row whose ring is empty holds it as its checkpoint.
* A flushing lane's out equals the stepwise out bit for bit.
* An appending lane's out is within twice PyTorch-float32's error of a float64 evaluation of the
  recurrence from the stored checkpoint over the ring's tokens (verify.tolerance).
* Padding lanes write zeros and no pool byte; rows no lane reads keep their bits.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank, K flush length.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_accurate

from mamba3_step.reference import mamba3_step_reference
from mamba3_step.replay import Ring, fork_row, materialize, new_ring, replay_step
from mamba3_step.rounding import dequantize_rows
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import lane_inputs, layer_weights, row_tensors, with_rotary

NULL = 5


class Decode:
    """Two copies of one layer's pools, decoded stepwise and with replay."""

    def __init__(self, P, H, D, N, R, K, state_dtype, seed, io_dtype="float32", draft=0, stochastic=False,
                 kv_dtype=None):
        self.g = torch.Generator().manual_seed(seed)
        self.sizes = (H, D, N, R)
        self.io = dict(kv_dtype=kv_dtype or io_dtype, x_dtype=io_dtype)
        rows = row_tensors(P, H, D, N, R, state_dtype=state_dtype, generator=self.g, **self.io)
        self.weights = layer_weights(H, D, R, generator=self.g)
        self.step_pools = {k: v.clone() for k, v in rows.items()}
        self.replay_pools = {k: v.clone() for k, v in rows.items()}
        self.ring = new_ring(P, K, R, H, N, D, kv_dtype=rows["Bstate"].dtype, x_dtype=rows["Xstate"].dtype, draft=draft,
                             stochastic=stochastic)
        self.rand_seed = torch.tensor([seed * 1009 + 7, 2**33 + seed], dtype=torch.int64) if stochastic else None
        self.P, self.K = P, K

    def tensors(self, pools, lane, indices) -> StepTensors:
        return StepTensors(pools["state"], pools["Bstate"], pools["Xstate"], lane["A"], lane["B"], lane["C"],
                           self.weights["D"], lane["x"], lane["dt"], lane["trap"], self.weights["xproj"],
                           outproj=self.weights["outproj"], z=lane["z"], zproj=self.weights["zproj"],
                           state_batch_indices=indices, null_slot_id=NULL, state_scale=pools.get("state_scale"),
                           rand_seed=self.rand_seed)

    def stepwise(self, lane, indices) -> torch.Tensor:
        """The stepwise pools' step (the caller advances the offset after it, :meth:`advance`)."""
        return mamba3_step_reference(self.tensors(self.step_pools, lane, indices), update_kv_state=True,
                                     stochastic_rounding=self.rand_seed is not None)

    def advance(self, tokens: int = 1) -> None:
        """The server's offset after a step of ``tokens`` tokens (each draws at offset + t)."""
        if self.rand_seed is not None:
            self.rand_seed[1] += tokens

    def step(self, indices: torch.Tensor):
        H, D, N, R = self.sizes
        lane = lane_inputs(len(indices), H, D, N, R, generator=self.g, **self.io)
        before = {k: v.clone() for k, v in self.replay_pools.items()}
        ring_before = Ring(*(None if v is None else v.clone() for v in self.ring))
        want = self.stepwise(lane, indices)
        got = replay_step(self.tensors(self.replay_pools, lane, indices), self.ring, self.K)
        self.advance()
        return lane, want, got, before, ring_before


def _checkpoint(base: dict, row: int, dtype) -> list:
    """Row ``row``'s checkpoint as a reference step reads it (copies: the call writes them): the state
    in ``dtype`` (an 8-bit one as q * scale), Bstate in its own dtype, so the reference rounds each
    token's B~ to it for the next token, as the step's math does, Xstate in ``dtype``."""
    state = base["state"][row:row + 1]
    if "state_scale" in base:
        state = dequantize_rows(state, base["state_scale"][row:row + 1])
    return [state.to(dtype, copy=True), base["Bstate"][row:row + 1].clone(),
            base["Xstate"][row:row + 1].to(dtype, copy=True)]


def _reference(d: Decode, base: dict, row: int, tokens: dict, C, z, dtype) -> torch.Tensor:
    """The out of the last of ``tokens`` (dicts of (k, ...) tensors: A, dt, trap, B per head, x) from
    row ``row`` of the checkpoints ``base``, in ``dtype`` with the state kept in ``dtype`` in between."""
    k = tokens["x"].shape[0]
    Cs = torch.zeros((1, k) + tuple(C.shape), dtype=dtype)
    Cs[0, -1] = C
    zs = torch.zeros((1, k) + tuple(z.shape), dtype=dtype)
    zs[0, -1] = z
    w = {name: (v.to(dtype) if v is not None else None) for name, v in d.weights.items()}
    tok = {f: v.to(dtype)[None] for f, v in tokens.items()}
    rows = _checkpoint(base, row, dtype)
    dense = StepTensors(*rows, tok["A"], tok["B"], Cs, w["D"], tok["x"], tok["dt"], tok["trap"], w["xproj"],
                        outproj=w["outproj"], z=zs, zproj=w["zproj"])
    return mamba3_step_reference(dense, update_kv_state=True, compute_dtype=dtype)[0, -1]


def _ring_part(ring: Ring, row: int, count: int) -> dict:
    c = ring.coef[row, :count]
    return {"A": c[..., 0], "dt": c[..., 1], "trap": c[..., 2], "B": ring.B[row, :count], "x": ring.x[row, :count]}



def _check_step(d: Decode, indices, lane, want, got, before, ring_before):
    P = d.P
    live = [(b, int(r)) for b, r in enumerate(indices.tolist()) if 0 <= r < P and r != NULL]
    for b in range(len(indices)):
        if b not in dict(live):
            assert torch.equal(got[b], torch.zeros_like(got[b])), f"padding lane {b} wrote out"
    for b, row in live:
        if int(ring_before.length[row, 0]) == d.K - 1:  # flushed
            assert torch.equal(got[b], want[b]), f"lane {b}: flush out differs from stepwise"
            assert int(d.ring.length[row, 0]) == 0
        else:  # appended
            assert int(d.ring.length[row, 0]) == int(ring_before.length[row, 0]) + 1
            now = {f: lane[f][b][None] for f in ("A", "dt", "trap", "x")}
            now["B"] = lane["B"][b][None].expand(-1, -1, d.sizes[0], -1)
            part = _ring_part(ring_before, row, int(ring_before.length[row, 0]))
            tokens = {f: torch.cat([part[f].to(v.dtype), v]) for f, v in now.items()}
            args = (d, before, row, tokens, lane["C"][b], lane["z"][b])
            want64, torch32 = _reference(*args, torch.float64), _reference(*args, torch.float32).to(got.dtype)
            assert_accurate(f"lane {b}", got[b], want64, torch32, want64.abs().max().item())
    touched = {row for _, row in live}
    for row in range(P):
        if row not in touched:
            for k in d.replay_pools:
                assert torch.equal(d.replay_pools[k][row], before[k][row]), f"row {row} of {k} written"
            for name, pool in zip(Ring._fields, d.ring):
                if pool is not None:
                    assert torch.equal(pool[row], getattr(ring_before, name)[row]), f"row {row} of ring.{name} written"
    _check_current(d, lane, indices, range(P))
    empty = d.ring.length[:, 0] == 0
    for k in d.replay_pools:
        assert torch.equal(d.replay_pools[k][empty], d.step_pools[k][empty]), k


def _check_current(d: Decode, lane, indices, rows) -> None:
    """materialize() of ``rows`` equals the stepwise pools' rows bit for bit."""
    current = materialize(d.tensors(d.replay_pools, lane, indices), d.ring, list(rows))._asdict()
    for k, pool in d.step_pools.items():
        assert torch.equal(current[k], pool[torch.as_tensor(list(rows))]), f"materialised {k} differs from stepwise"


@pytest.mark.parametrize("state_dtype,K,R,io,sr", [
    ("float32", 4, 2, "float32", False), ("bfloat16", 4, 4, "float32", False), ("float16", 3, 1, "float32", False),
    ("float32", 2, 2, "bfloat16", False), ("bfloat16", 4, 2, "float32", True), ("int8", 3, 2, "float32", True)])
def test_replay_equals_stepwise_decoding_with_joins_leaves_and_forks(state_dtype, K, R, io, sr):
    """bf16 B, x and out in the fourth case (out compared after its rounding to bf16); stochastic
    rounding (the offset advanced every step) in the last two, an 8-bit state with scales in the last."""
    P, B, steps = 8, 4, 18
    d = Decode(P, 2, 32, 32, R, K, state_dtype, seed=K * 10 + R, io_dtype=io, stochastic=sr)
    g = torch.Generator().manual_seed(99)
    rows = torch.randperm(P, generator=g)[:B]  # the lanes' requests
    flushes = appends = 0
    for step in range(steps):
        if step % 5 == 4:  # a request leaves; a fork of another takes its slot (pools copied in both)
            fork_row(d.tensors(d.replay_pools, lane_inputs(1, 2, 32, 32, R, generator=g, **d.io), rows), d.ring,
                     int(rows[0]), int(rows[1]))
            for k in d.step_pools:
                d.step_pools[k][rows[1]] = d.step_pools[k][rows[0]]
        if step % 7 == 6:  # a new request joins in a free slot: a fresh state, an empty ring
            free = [r for r in range(P) if r not in rows.tolist() and r != NULL]
            new = free[step % len(free)]
            fresh = row_tensors(1, 2, 32, 32, R, state_dtype=state_dtype, generator=g, **d.io)
            for k in d.step_pools:
                d.step_pools[k][new] = fresh[k][0]
                d.replay_pools[k][new] = fresh[k][0]
            d.ring.length[new] = 0
            rows[2] = new
        indices = rows.clone().to(torch.int32)
        if step % 3 == 1:
            indices[3] = [-1, NULL, P + 2][step % 3 - 1]  # padding kinds
        flushes += sum(int(d.ring.length[r, 0]) == K - 1 for r in indices.tolist() if 0 <= r < P and r != NULL)
        appends += sum(int(d.ring.length[r, 0]) < K - 1 for r in indices.tolist() if 0 <= r < P and r != NULL)
        _check_step(d, indices, *d.step(indices))
    assert flushes >= 4 and appends >= 4


def test_replay_refuses_what_it_does_not_take_yet_and_bad_ring_lengths():
    d = Decode(6, 2, 32, 32, 2, 4, "float32", seed=1)
    lane = lane_inputs(2, 2, 32, 32, 2, generator=d.g, **d.io)
    indices = torch.tensor([0, 1], dtype=torch.int32)
    t = d.tensors(d.replay_pools, lane, indices)
    drafts = lane_inputs(2, 2, 32, 32, 2, tokens=2, generator=d.g, **d.io)
    with pytest.raises(ValueError, match="dst_state_batch_indices with a verify step"):
        replay_step(d.tensors(d.replay_pools, drafts, indices)._replace(dst_state_batch_indices=indices),
                    new_ring(6, 4, 2, 2, 32, 32, kv_dtype=torch.float32, x_dtype=torch.float32, draft=2), 4)
    with pytest.raises(ValueError, match="pool-mode"):
        replay_step(t._replace(state=t.state[:2].clone(), Bstate=t.Bstate[:2].clone(), Xstate=t.Xstate[:2].clone(),
                               state_batch_indices=None, null_slot_id=None), d.ring, 4)
    with pytest.raises(ValueError, match="ring.x"):
        replay_step(t, d.ring._replace(x=d.ring.x[:, :2]), 4)
    with pytest.raises(ValueError, match="ring.coef"):
        replay_step(t, d.ring._replace(coef=d.ring.coef.double()), 4)
    d.ring.length[1] = torch.tensor([1, 2], dtype=torch.int32)  # one count per row: every head holds it
    with pytest.raises(ValueError, match=r"ring.length must hold one value per row .* got \[\[1, 2\]\] at rows \[1\]"):
        replay_step(t, d.ring, 4)
    d.ring.length[1] = 4  # K = 4 without drafts: a ring of 3 entries
    before = {k: v.clone() for k, v in d.replay_pools.items()}
    ring_before = [None if v is None else v.clone() for v in d.ring]
    with pytest.raises(ValueError, match=r"ring.length \(plus accepted\) must be in \[0, 3\]"):
        replay_step(t, d.ring, 4)
    for k, v in before.items():  # a failed call changes nothing
        assert torch.equal(d.replay_pools[k], v)
    for a, b in zip(d.ring, ring_before):
        assert (a is None and b is None) or torch.equal(a, b)
    with pytest.raises(ValueError, match=r"flush_length: expected an int in \[2, 16\]"):
        new_ring(4, 1, 2, 2, 32, 32, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows must be"):
        materialize(t, d.ring, [6])


@pytest.mark.parametrize("kind", ["quantized", "bool", "float", "complex", "meta", "2-D"])
def test_materialize_refuses_rows_of_every_other_kind_by_name_and_changes_nothing(kind):
    """``rows`` a tensor of any kind but an integer vector holding data: the named TypeError, before
    anything is read or written (a quantized tensor included: it never reaches ``.to(int64)``)."""
    d = Decode(6, 2, 32, 32, 2, 4, "float32", seed=3)
    t = d.tensors(d.replay_pools, lane_inputs(2, 2, 32, 32, 2, generator=d.g, **d.io),
                  torch.tensor([0, 1], dtype=torch.int32))
    rows = {"quantized": torch.quantize_per_tensor(torch.tensor([0.0, 1.0]), 1.0, 0, torch.qint8),
            "bool": torch.tensor([True]), "float": torch.tensor([1.0]), "complex": torch.tensor([1j]),
            "meta": torch.empty(2, dtype=torch.int64, device="meta"),
            "2-D": torch.zeros(1, 2, dtype=torch.int64)}[kind]
    before = {k: v.clone() for k, v in d.replay_pools.items()}
    with pytest.raises(TypeError, match=r"^rows: expected an integer tensor of at most one dimension"):
        materialize(t, d.ring, rows)
    assert all(torch.equal(d.replay_pools[k], v) for k, v in before.items())


def _advance_stepwise(d: Decode, lane: dict, indices, accepted: list):
    """The stepwise pools after each lane's first ``accepted[b]`` draft tokens (a dense T-token step on
    the lane's row, which equals that many one-token steps)."""
    for b, row in enumerate(indices.tolist()):
        a = accepted[b]
        if a == 0:
            continue
        p = d.step_pools
        scale = p.get("state_scale")
        dense = StepTensors(p["state"][row:row + 1].clone(), p["Bstate"][row:row + 1].clone(),
                            p["Xstate"][row:row + 1].clone(), lane["A"][b:b + 1, :a], lane["B"][b:b + 1, :a],
                            lane["C"][b:b + 1, :a], d.weights["D"], lane["x"][b:b + 1, :a], lane["dt"][b:b + 1, :a],
                            lane["trap"][b:b + 1, :a], d.weights["xproj"], outproj=d.weights["outproj"],
                            z=lane["z"][b:b + 1, :a], zproj=d.weights["zproj"],
                            state_scale=None if scale is None else scale[row:row + 1].clone(),
                            rand_seed=d.rand_seed, rand_rows=None if d.rand_seed is None else torch.tensor([row]).int())
        mamba3_step_reference(dense, update_kv_state=True, stochastic_rounding=d.rand_seed is not None)
        for k in p:
            p[k][row] = getattr(dense, k)[0]


@pytest.mark.parametrize("state_dtype,K,T,sr", [("float32", 4, 3, False), ("bfloat16", 3, 2, False),
                                                ("float16", 4, 3, True)])
def test_verify_steps_and_rollback_by_the_cursor_equal_stepwise_speculative_decoding(state_dtype, K, T, sr):
    """Verify steps (T drafts) and plain steps, the accepted count of each verify passed to the next
    step (0 to T, every lane its own): after every step the materialised state equals stepwise
    decoding of the accepted tokens bit for bit; each draft's out is within twice PyTorch-float32's
    error of float64 from the stored checkpoint over the committed tokens and the drafts up to it."""
    P, H, D, N, R = 6, 2, 32, 32, 2
    d = Decode(P, H, D, N, R, K, state_dtype, seed=T, draft=T, stochastic=sr)
    indices = torch.tensor([3, 0, 4], dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    pending, flushed_before_verify = None, 0
    for kind in "VPVVPVVVPPVV":
        if kind == "P":
            lane = lane_inputs(3, H, D, N, R, generator=d.g, **d.io)
            d.stepwise(lane, indices)
            replay_step(d.tensors(d.replay_pools, lane, indices), d.ring, K, num_accepted_tokens=pending)
            d.advance()
        else:
            lane = lane_inputs(3, H, D, N, R, tokens=T, generator=d.g, **d.io)
            before = {k: v.clone() for k, v in d.replay_pools.items()}
            ring_before = Ring(*(None if v is None else v.clone() for v in d.ring))
            got = replay_step(d.tensors(d.replay_pools, lane, indices), d.ring, K, num_accepted_tokens=pending)
            for b, row in enumerate(indices.tolist()):
                m = int(ring_before.length[row, 0]) + (0 if pending is None else int(pending[b]))
                flushed_before_verify += m >= K
                base, committed = (d.replay_pools, 0) if m >= K else (before, m)
                assert int(d.ring.length[row, 0]) == committed  # the drafts wait uncommitted
                for i in range(T):
                    draft = {f: lane[f][b, :i + 1] for f in ("A", "dt", "trap", "x")}
                    draft["B"] = lane["B"][b, :i + 1].expand(-1, -1, H, -1)
                    tokens = {f: torch.cat([_ring_part(ring_before, row, committed)[f].to(v.dtype), v])
                              for f, v in draft.items()}
                    args = (d, base, row, tokens, lane["C"][b, i], lane["z"][b, i])
                    want64, torch32 = _reference(*args, torch.float64), _reference(*args, torch.float32)
                    assert_accurate(f"lane {b} draft {i}", got[b, i], want64, torch32.to(got.dtype),
                                    want64.abs().max().item())
            accepted = [int(v) for v in torch.randint(0, T + 1, (3,), generator=g)]
            _advance_stepwise(d, lane, indices, accepted)  # drafts drew at the verify's offset + t
            d.advance(T)
            pending = torch.tensor(accepted, dtype=torch.int32)
            continue
        pending = None
        _check_current(d, lane, indices, indices.tolist())
    assert flushed_before_verify >= 1


@pytest.mark.parametrize("state_dtype,sr", [("float32", False), ("bfloat16", True)])
def test_a_destination_row_gets_the_flushed_state_and_a_padding_destination_nothing(state_dtype, sr):
    """dst_state_batch_indices: a lane whose destination is another live row flushes into it (the
    prefix-caching pattern: read a cached row, write the request's own); its source keeps its
    checkpoint and ring; a padding destination writes nothing. Against stepwise decoding with the
    same destinations: materialised rows bit for bit, the flushing lane's out bit for bit."""
    P, H, D, N, R, K = 8, 2, 32, 32, 2, 4
    d = Decode(P, H, D, N, R, K, state_dtype, seed=11, stochastic=sr)
    src = torch.tensor([1, 2, 3], dtype=torch.int32)
    for _ in range(2):  # two tokens in every ring
        d.step(src)
    lane = lane_inputs(3, H, D, N, R, generator=d.g, **d.io)
    dst = torch.tensor([6, 2, NULL], dtype=torch.int32)
    step_t = d.tensors(d.step_pools, lane, src)._replace(dst_state_batch_indices=dst)
    want = mamba3_step_reference(step_t, update_kv_state=True, stochastic_rounding=sr)
    ring_before = Ring(*(None if v is None else v.clone() for v in d.ring))
    got = replay_step(d.tensors(d.replay_pools, lane, src)._replace(dst_state_batch_indices=dst), d.ring, K)
    d.advance()
    assert torch.equal(got[0], want[0])  # flushed into row 6
    assert int(d.ring.length[6, 0]) == 0 and int(d.ring.length[1, 0]) == int(ring_before.length[1, 0]) == 2
    assert int(d.ring.length[3, 0]) == 2  # the padding destination's lane wrote nothing
    for name, pool in zip(Ring._fields, d.ring):
        if pool is not None:
            assert torch.equal(pool[3], getattr(ring_before, name)[3]), f"ring.{name} of row 3 written"
    _check_current(d, lane, src, [1, 2, 3, 6])


@pytest.mark.parametrize("state_dtype,sr,pairwise,shared,kv", [("float32", False, False, True, "float32"),
                                                               ("bfloat16", True, True, False, "bfloat16")])
def test_rotary_replay_equals_stepwise_decoding(state_dtype, sr, pairwise, shared, kv):
    """With the rotary angle (S = N/4, biases; B/C shared by the heads or not; pairs split or
    adjacent): the ring keeps each token's B as received and its angle; after every step the
    materialised state, Bstate, Xstate and angle equal stepwise decoding bit for bit; a flush's out
    too; an append's out is within twice PyTorch-float32's error of float64 from the stored
    checkpoint over the tokens since (the test keeps their inputs, independently of the ring). A bf16
    Bstate in the second case: a token's own update reads its unrounded B~, the next token the
    rounded one."""
    P, H, D, N, R, K, S = 6, 2, 32, 32, 2, 3, 8
    d = Decode(P, H, D, N, R, K, state_dtype, seed=5, stochastic=sr, kv_dtype=kv)  # fp32 x and out
    d.ring = new_ring(P, K, R, H, N, D, kv_dtype=d.ring.B.dtype, x_dtype=d.ring.x.dtype, stochastic=sr, rope_angles=S)
    rot = with_rotary(dict(d.step_pools, x=torch.zeros(1, H, D), B=torch.zeros(1, R, H, N)), S, seed=9)
    for pools in (d.step_pools, d.replay_pools):
        pools["angle_state"] = rot["angle_state"].clone()
    d.weights.update(B_bias=rot["B_bias"], C_bias=rot["C_bias"])
    indices = torch.tensor([4, 1], dtype=torch.int32)
    history = {4: [], 1: []}
    flushes = 0

    def call(pools, lane):
        return d.tensors(pools, lane, indices)._replace(angle_state=pools["angle_state"], angle_proj=lane["angle_proj"],
                                                        B_bias=d.weights["B_bias"], C_bias=d.weights["C_bias"])

    for _ in range(8):
        lane = with_rotary(lane_inputs(2, H, D, N, R, generator=d.g, **d.io) | {"state": d.step_pools["state"]}, S,
                           shared_bc=shared, seed=d.g)
        before = {k: v.clone() for k, v in d.replay_pools.items()}
        lengths = [int(d.ring.length[r, 0]) for r in indices.tolist()]
        want = mamba3_step_reference(call(d.step_pools, lane), update_kv_state=True, rotate_pairwise=pairwise,
                                     stochastic_rounding=sr)
        got = replay_step(call(d.replay_pools, lane), d.ring, K, rotate_pairwise=pairwise)
        d.advance()
        for b, row in enumerate(indices.tolist()):
            token = {f: lane[f][b] for f in ("A", "dt", "trap", "B", "C", "x", "z", "angle_proj")}
            if lengths[b] == K - 1:
                flushes += 1
                assert torch.equal(got[b], want[b]), f"lane {b}: flush out differs from stepwise"
                history[row] = []
                continue
            seq = history[row] + [token]
            outs = [_rotary_reference(d, before, row, seq, pairwise, dt) for dt in (torch.float64, torch.float32)]
            assert_accurate(f"lane {b}", got[b], outs[0], outs[1].to(got.dtype), outs[0].abs().max().item())
            history[row] = seq
        current = materialize(call(d.replay_pools, lane), d.ring, indices.tolist(), rotate_pairwise=pairwise)._asdict()
        for k, pool in d.step_pools.items():
            assert torch.equal(current[k], pool[indices.long()]), f"materialised {k} differs from stepwise"
    assert flushes >= 4


def _rotary_reference(d: Decode, base: dict, row: int, seq: list, pairwise: bool, dtype) -> torch.Tensor:
    """The out of the last token of ``seq`` (their inputs as the lanes received them) from row ``row``
    of the checkpoints ``base`` with the rotary T-token CPU path, in ``dtype`` (state kept in it)."""
    tok = {f: torch.stack([t[f] for t in seq])[None] for f in seq[0]}
    tok = {f: (v if f == "angle_proj" else v.to(dtype)) for f, v in tok.items()}
    tok["C"][:, :-1] = 0  # only the last token's output is read
    w = {name: (v.to(dtype) if v is not None else None) for name, v in d.weights.items()}
    rows = _checkpoint(base, row, dtype)
    dense = StepTensors(*rows, tok["A"], tok["B"], tok["C"], w["D"], tok["x"], tok["dt"], tok["trap"], w["xproj"],
                        outproj=w["outproj"], z=tok["z"], zproj=w["zproj"], angle_state=base["angle_state"][row:row + 1]
                        .clone(), angle_proj=tok["angle_proj"], B_bias=w["B_bias"], C_bias=w["C_bias"])
    return mamba3_step_reference(dense, update_kv_state=True, rotate_pairwise=pairwise, compute_dtype=dtype)[0, -1]
