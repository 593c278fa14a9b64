"""The demo's speculative-decoding round: T-token verify steps, rollback by index, checked against
one-token-at-a-time decoding of the accepted tokens (``python -m mamba3_step demo`` runs it after
the toy decode of :mod:`mamba3_step.tools.demo`).

Letters (docs/contract.md): B lanes (requests), T tokens per verify step (rows per group), P pool
rows (slots), H heads, D head dim, N state size, R MIMO rank, L layers.

A server doing speculative decoding (vLLM's convention, docs/integration.md "Speculative decoding")
gives each request a group of T rows (``StatePool.alloc_spec``); a verify step reads the request's
committed row and writes the state after token t to the group's row t; after verification the
request continues from row ``accepted - 1`` (``StatePool.commit_accepted``: index remapping, no
copy). Here a twin pool with one slot per request decodes only the accepted tokens, one token at a
time, and everything the server keeps is compared with it bit for bit: ``out`` of every accepted
token at every layer, the state/B/x rows after every accepted token, and every row outside the
requests' groups (unchanged). On CPU both sides run the PyTorch path; on a GPU the T-token and the
one-token CuteDSL kernels (T-token steps replayed from CUDA graphs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from ...serving import CudaGraphStepRunner, StatePool, StepForm, choose_bucket, decode_step
from ...testing import LayerShape, bits_equal, lane_inputs, layer_weights, poison_pool, row_tensors

__all__ = ["SpecRecord", "SpecResult", "run_speculative_decode"]


@dataclass
class SpecRecord:
    round: int
    live: int
    bucket: int | None
    joined: int
    left: int
    accepted: list[int]
    parity: bool


@dataclass
class SpecResult:
    tokens: int
    graphs: bool
    records: list[SpecRecord] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def parity(self) -> bool:
        return bool(self.records) and not self.failures and all(r.parity for r in self.records)

    @property
    def verified(self) -> int:
        """Tokens run through verify steps (T per live request and round)."""
        return sum(r.live for r in self.records) * self.tokens

    @property
    def accepted(self) -> int:
        return sum(sum(r.accepted) for r in self.records)


_ROWS = ("state", "Bstate", "Xstate")


class _SpecRequests:
    """The speculative round's requests: a group of T rows in ``pool``, one slot in the ``plain`` twin."""

    def __init__(self, pool: StatePool, plain: StatePool, T: int, rng: random.Random, g: torch.Generator):
        self.pool, self.plain, self.T, self.rng, self.g = pool, plain, T, rng, g
        self.groups: list[torch.Tensor] = []  # (T,) rows per request
        self.slots: list[int] = []  # its slot in the twin

    def leave(self) -> int:
        """Sometimes one request finishes: its group and its twin slot are freed."""
        if len(self.groups) < 2 or self.rng.random() < 0.5:
            return 0
        i = self.rng.randrange(len(self.groups))
        self.pool.free_spec(self.groups.pop(i))
        self.plain.free(self.slots.pop(i))
        return 1

    def join(self, want: int) -> int:
        """New requests up to ``want``; their prefill state (random) goes to the group's committed row
        and to the twin's slot."""
        joined = max(0, want - len(self.groups))
        for _ in range(joined):
            group, slot = self.pool.alloc_spec(1, self.T)[0], int(self.plain.alloc(1)[0])
            row = int(self.pool.current_rows(group)[0])
            p = self.pool
            for l in range(p.num_layers):
                prefill = row_tensors(1, p.nheads, p.headdim, p.dstate, p.mimo, state_dtype=p.state_dtype,
                                      kv_dtype=p.kv_dtype, x_dtype=p.x_dtype, generator=self.g, device=p.device)
                for name, a, b in zip(_ROWS, p.layer_tensors(l), self.plain.layer_tensors(l)):
                    a[row], b[slot] = prefill[name][0], prefill[name][0]
            self.groups.append(group)
            self.slots.append(slot)
        return joined


def _verify(runners, idx, inputs: list[dict]) -> list[torch.Tensor]:
    """One T-token verify step through every layer (layer l + 1's x is layer l's out); outs per layer."""
    outs: list[torch.Tensor] = []
    for l, runner in enumerate(runners):
        inp = inputs[l] if l == 0 else dict(inputs[l], x=outs[-1])
        outs.append(runner.step(idx.state_batch_indices, dst_slots=idx.dst_state_batch_indices,
                                num_accepted_tokens=idx.num_accepted_tokens, **inp))
    return outs


def _one_token_check(req: _SpecRequests, weights, groups, accepted, inputs, outs) -> list[str]:
    """Decode the accepted tokens one at a time in the twin; every token's out and state rows must
    equal the verify step's (out[:, t] and the group's row t), bit for bit."""
    failures, dev = [], req.plain.device
    slots = torch.tensor(req.slots, dtype=torch.int32, device=dev)
    for t in range(req.T):
        lanes = torch.tensor([b for b, a in enumerate(accepted) if a > t], dtype=torch.long, device=dev)
        if not lanes.numel():
            break
        x = None
        for l, w in enumerate(weights):
            tok = {k: (None if v is None else v[lanes, t]) for k, v in inputs[l].items()}
            x = decode_step(req.plain, l, slots[lanes], tok["A"], tok["B"], tok["C"], w["D"],
                            tok["x"] if l == 0 else x, tok["dt"], tok["trap"], w["xproj"], w["outproj"],
                            z=tok["z"], zproj=w["zproj"])
            checks = {"out": bits_equal(x, outs[l][lanes, t])}
            for name, a, b in zip(_ROWS, req.pool.layer_tensors(l), req.plain.layer_tensors(l)):
                checks[f"{name} row"] = bits_equal(a[groups[lanes, t].long()], b[slots[lanes].long()])
            failures += [f"token {t} layer {l}: {what} differs from one-token decoding"
                         for what, ok in checks.items() if not ok]
    return failures


def _untouched(pool: StatePool, before: list, groups: torch.Tensor) -> list[str]:
    """Rows outside the live requests' groups must not have changed (every layer)."""
    keep = torch.ones(pool.num_slots, dtype=torch.bool, device=pool.device)
    keep[groups.reshape(-1).long()] = False
    return [f"layer {l}: {name} rows outside the groups changed" for l in range(pool.num_layers)
            for name, a, b in zip(_ROWS, pool.layer_tensors(l), before[l]) if not bits_equal(a[keep], b[keep])]


def run_speculative_decode(*, rounds: int = 4, tokens: int = 4, requests: int = 3, layers: int = 2,
                           buckets=(1, 2, 4, 8), shape: LayerShape = LayerShape(), null_slot: bool = False,
                           seed: int = 0, device="cpu", use_cuda_graph: bool | None = None,
                           log=None) -> SpecResult:
    """Speculative decoding with rollback by index, checked against one-token-at-a-time decoding.

    Every round each request verifies T = ``tokens`` tokens in one T-token step per layer
    (:class:`CudaGraphStepRunner`, form ``StepForm.speculative(T)``, padded to a bucket) from the
    indices ``StatePool.spec_indices`` builds; a random count in [1, T] is accepted and committed
    (``commit_accepted``). A twin pool decodes the accepted tokens one at a time
    (:func:`decode_step`, T-less) and :func:`_one_token_check` compares them bit for bit; rows
    outside the groups must not change. Requests finish (``free_spec``) and join (``alloc_spec``,
    prefill state written to both pools) between rounds. Both pools start from random poison.
    ``shape`` gives every layer's H, D, N, R and dtypes (default
    :class:`~mamba3_step.testing.LayerShape`: the flagship's D, N, R and dtypes, H=4 heads).
    """
    device, T = torch.device(device), tokens
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    H, D, N, R = shape.H, shape.D, shape.N, shape.R
    kw = dict(shape.storage_dtypes, device=device, reserve_null_slot=null_slot)
    pool = StatePool(layers, (requests + 1) * T + 2 + null_slot, H, D, N, R, **kw)  # spare rows stay unallocated
    plain = StatePool(layers, requests + 1 + null_slot, H, D, N, R, **kw)
    poison_pool(pool, g)
    poison_pool(plain, g)
    weights = [layer_weights(H, D, R, proj_dtype=shape.proj_dtype, device=device, generator=g)
               for _ in range(layers)]
    runners = [CudaGraphStepRunner(pool, l, buckets=buckets, with_dst=True, use_cuda_graph=use_cuda_graph,
                                   **weights[l]) for l in range(layers)]
    if runners[0].use_cuda_graph:
        for r in runners:
            r.capture(form=StepForm.speculative(T))
    result, req = SpecResult(T, runners[0].use_cuda_graph), _SpecRequests(pool, plain, T, rng, g)
    for rnd in range(rounds):
        left = req.leave()
        joined = req.join(rng.randint(max(1, requests - 1), requests))  # batch sizes vary: several buckets
        groups = torch.stack(req.groups)
        n, idx = len(req.groups), pool.spec_indices(groups)
        inputs = [lane_inputs(n, H, D, N, R, kv_dtype=kw["kv_dtype"], x_dtype=kw["x_dtype"], tokens=T,
                              device=device, generator=g) for _ in range(layers)]
        before = [tuple(t.clone() for t in pool.layer_tensors(l)) for l in range(layers)]
        outs = _verify(runners, idx, inputs)
        accepted = [rng.randint(1, T) for _ in range(n)]
        failures = _untouched(pool, before, groups)
        failures += _one_token_check(req, weights, groups.to(device), accepted, inputs, outs)
        pool.commit_accepted(groups, accepted)
        if pool.current_rows(groups).tolist() != [int(gr[a - 1]) for gr, a in zip(req.groups, accepted)]:
            failures.append("commit_accepted: current_rows is not the accepted row")
        result.failures += [f"round {rnd}: {f}" for f in failures]
        rec = SpecRecord(rnd, n, choose_bucket(n, buckets), joined, left, accepted, not failures)
        result.records.append(rec)
        if log:
            log(rec)
    return result
