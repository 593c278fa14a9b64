"""Every tensor kind gets a named refusal on every path, and the process survives.

A nested tensor on a call signature that was already validated used to reach torch's C++ tensor
guard and abort the interpreter; a tensor whose storage was freed (``resize_(0)``) passed the
cached checks and was read. The calls run in a subprocess (a defect here kills the process):
each kind replaces one argument of a valid call, on each entry point, after the signature was
validated; the subprocess reports, per case, the exception type and whether every argument and
the pool kept their bytes.

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mamba3_step.tensors import StepTensors

REPO = Path(__file__).resolve().parents[2]
KINDS = ("nested", "sparse", "mkldnn", "quantized", "meta", "freed", "complex", "bool")
PATHS = ("fn", "fn cached", "plan.run", "op", "decode_step", "runner", "replay fn", "replay plan.run")
ARGS = ("x", "A", "state", "state_batch_indices", "D", "angle_state", "angle_proj", "B_bias")

SCRIPT = r"""
import json, sys, torch
import mamba3_step.ops
from mamba3_step import mamba3_step_fn, mamba3_step_op, new_ring, plan_step
from mamba3_step.serving import CudaGraphStepRunner, StatePool, decode_step
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, poison_, poison_pool

H, D, N, R, P, B, S = 2, 32, 32, 2, 6, 3, 4
pool = StatePool(1, P, H, D, N, R, rope_angles=S)
poison_pool(pool, torch.Generator().manual_seed(1))
poison_(pool.angle_state(0), seed=4)
lanes = lane_inputs(B, H, D, N, R, generator=torch.Generator().manual_seed(2))
lanes["angle_proj"] = torch.randn(B, H, S, generator=torch.Generator().manual_seed(5))
weights = layer_weights(H, D, R, generator=torch.Generator().manual_seed(3))
weights.update(B_bias=torch.ones(R, H, N), C_bias=torch.ones(R, H, N))
slots = torch.tensor([0, 4, -1], dtype=torch.int32)
rows = pool.layer_rows(0)
WEIGHTS = ("D", "xproj", "outproj", "zproj", "B_bias", "C_bias")


def odd(kind, t):
    if kind == "nested":
        return torch.nested.nested_tensor([t[0].float(), t[-1].float()])
    if kind == "sparse":
        return t.float().to_sparse()
    if kind == "mkldnn":
        return t.float().to_mkldnn()
    if kind == "quantized":
        return torch.quantize_per_tensor(t.float(), 0.1, 0, torch.qint8)
    if kind == "meta":
        return torch.empty_like(t, device="meta")
    if kind == "freed":
        u = t.clone()
        u.untyped_storage().resize_(0)
        return u
    if kind == "complex":
        return t.to(torch.complex64)
    if kind == "bool":
        return t.to(torch.bool)
    raise AssertionError(kind)


def call(path, args):
    kw = dict(args)
    if path in ("fn", "fn cached"):
        return mamba3_step_fn(**kw, update_kv_state=True)
    if path == "plan.run":
        return PLAN.run(**kw)
    if path == "op":
        return mamba3_step_op(**kw, update_kv_state=True)
    if path == "decode_step":
        return decode_step(pool, 0, kw["state_batch_indices"], **{k: kw[k] for k in (*lanes, *WEIGHTS)})
    if path == "runner":
        return RUNNER.step(kw["state_batch_indices"], **{k: kw[k] for k in lanes})
    if path == "replay fn":
        return mamba3_step_fn(**kw, replay_ring=RING, update_kv_state=True, replay_flush_length=2)
    if path == "replay plan.run":
        return REPLAY_PLAN.run(**kw, replay_ring=RING)
    raise AssertionError(path)


valid = dict(**rows, **lanes, **weights, state_batch_indices=slots)
PLAN = plan_step(**valid, update_kv_state=True)
RUNNER = CudaGraphStepRunner(pool, 0, buckets=(4,), **weights)
RING = new_ring(P, 2, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16, rope_angles=S)
REPLAY_PLAN = plan_step(**valid, replay_ring=RING, update_kv_state=True, replay_flush_length=2)
for path in ("fn", "plan.run", "runner", "replay plan.run"):  # validated once: later calls take the cached paths
    call(path, valid)
results = {}
for path in sys.argv[1].split(","):
    for kind in sys.argv[2].split(","):
        for name in sys.argv[3].split(","):
            if name in rows and path in ("runner", "decode_step") or (path == "runner" and name in WEIGHTS):
                continue  # the pool supplies the rows; the runner fixes its weights at construction
            if path == "fn" and name != "x":
                mamba3_step.validation.VALIDATION_CACHE.clear()  # a first call: the full validation
            args = dict(valid)
            args[name] = odd(kind, valid[name])
            before = [t.clone() for t in pool.layer_rows(0).values()]
            try:
                call(path, args)
                got = "accepted"
            except (TypeError, ValueError) as e:
                got = type(e).__name__ + ": " + str(e).split(":")[0]
            except Exception as e:
                got = "UNNAMED " + type(e).__name__ + ": " + str(e)[:120]
            kept = all(bits_equal(a, b) for a, b in zip(pool.layer_rows(0).values(), before))
            results[f"{path}|{kind}|{name}"] = [got, kept]
print("RESULT " + json.dumps(results))
"""


def _run(paths, kinds, names) -> dict:
    r = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(paths), ",".join(kinds), ",".join(names)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"the process died (exit {r.returncode}):\n{r.stderr[-3000:]}"
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("path", PATHS)
def test_every_tensor_kind_is_refused_by_name_and_changes_nothing(path):
    results = _run([path], KINDS, ARGS)
    bad = {case: got for case, (got, kept) in results.items()
           if not (got.startswith(("TypeError", "ValueError")) and kept)}
    assert not bad, json.dumps(bad, indent=1)
    named = set(StepTensors._fields) | {"slots", "dst_slots"}
    for case, (got, _) in results.items():
        assert got.split(": ", 1)[1] in named, (case, got)  # the message starts with the argument's name
