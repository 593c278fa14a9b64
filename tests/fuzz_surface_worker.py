"""The fuzz harness's worker (run by tests/contract/test_fuzz_surface.py in a subprocess: a crash must not
take the test runner with it).

    python tests/fuzz_surface_worker.py EXAMPLES SEED [step|replay|helpers]

Hypothesis draws an entry point of the public surface (``mamba3_step_fn``, ``mamba3_step_op``,
``plan_step`` / ``StepPlan.run``, ``decode_step``, ``CudaGraphStepRunner.step`` on its CPU path, a
``StatePool`` method, or one option of the ``demo``, ``inspect``, ``precompile`` (and, in the long
run, ``verify``) subcommands with an odd string: exit 0, 1 or 2 without a traceback), one of its
arguments and an odd value for it (an odd tensor kind, dtype, rank, size, stride or view, or an
odd scalar), calls it with otherwise valid arguments, and
records a failure when the call raises anything but a named ``TypeError``/``ValueError`` (the
pool's ``SlotError``/``PoolExhaustedError`` included) or, refused, changed a byte of the pool or
of the allocator or of any tensor reachable from the call's arguments (the runner's buffers and
fixed tensors, the odd value itself). Prints ``RESULT {"examples": n, "failures": [...]}``. With ``replay`` as the
third argument it fuzzes replay's surface instead (``tests/fuzz_replay_surface.py``), with ``helpers`` the
ring's helpers, a replay pool's allocator, the runner's methods and stochastic steps
(``tests/fuzz_helper_surface.py``, whose judge compares every tensor reachable from the arguments).

The surface's pool has an angle pool (S = 8), so the rotary arguments are fuzzed with the rest.

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank,
S rotary angles.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tempfile

import torch
from hypothesis import HealthCheck, assume, given, seed, settings
from hypothesis import strategies as st

import mamba3_step.ops  # noqa: F401  (registers the op)
from mamba3_step.tools import cli
from mamba3_step import mamba3_step_fn, mamba3_step_op, plan_step
from mamba3_step.serving import CudaGraphStepRunner, PoolExhaustedError, StatePool, decode_step
from mamba3_step.testing import lane_inputs, layer_weights, poison_pool

# tests/ is the script's folder
from fuzz_helper_surface import HelperSurface, helper_example, judged_reachable  # noqa: E402
from fuzz_replay_surface import ReplaySurface, replay_example  # noqa: E402

H, D, N, R, P, B = 2, 32, 32, 2, 6, 3
NAMED = re.compile(r"^[A-Za-z_][\w/\[\].]*[:\s]")  # a message that starts by naming something


def _freed(t):
    u = t.clone()
    u.untyped_storage().resize_(0)
    return u


#: odd replacements for a tensor argument (each a function of the valid tensor)
ODD_TENSORS = {
    "nested": lambda t: torch.nested.nested_tensor([t.reshape(-1)[:2].float(), t.reshape(-1)[:3].float()]),
    "sparse": lambda t: t.float().to_sparse(),
    "mkldnn": lambda t: t.float().to_mkldnn(),
    "quantized": lambda t: torch.quantize_per_tensor(t.float(), 0.1, 0, torch.qint8),
    "meta": lambda t: torch.empty_like(t, device="meta"),
    "freed": _freed,
    "complex": lambda t: t.to(torch.complex64),
    "bool": lambda t: t.to(torch.bool),
    "int64": lambda t: t.to(torch.int64),
    "float64": lambda t: t.to(torch.float64),
    "zero-size": lambda t: t[:0],
    "extra dim": lambda t: t.unsqueeze(0),
    "one dim less": lambda t: t[0],
    "transposed": lambda t: t.transpose(0, -1) if t.dim() > 1 else t.flip(0),
    "zero strides": lambda t: t.as_strided(t.shape, (0,) * t.dim()),
    "offset view": lambda t: torch.cat([t.reshape(-1), t.reshape(-1)[:1]])[1:].view(t.shape),
    "requires grad": lambda t: t.float().requires_grad_(True) if t.is_floating_point() else t,
    "subclass": lambda t: torch.nn.Parameter(t.clone(), requires_grad=False),
}
#: odd values for a scalar (or any) argument
ODD_SCALARS = [None, 0, -1, 1, 2**31, 2**63, 2**70, -2**70, 1.5, float("nan"), True, False, "0", b"x",
               object(), (), [1]]
#: an odd value, drawn: ("tensor", a kind of ODD_TENSORS) or ("scalar", an index into ODD_SCALARS)
ODD = st.one_of(st.sampled_from(sorted(ODD_TENSORS)).map(lambda k: ("tensor", k)),
                st.sampled_from(range(len(ODD_SCALARS))).map(lambda i: ("scalar", i)))
TENSOR_ARGS = ("state", "Bstate", "Xstate", "A", "B", "C", "D", "x", "dt", "trap", "xproj", "outproj", "out",
               "z", "zproj", "state_batch_indices", "dst_state_batch_indices", "num_accepted_tokens", "angle_state",
               "angle_proj", "B_bias", "C_bias")
OPTIONS = ("null_slot_id", "update_kv_state", "tile_D", "num_warps", "validate_indices", "rotate_pairwise")
S = 8  # rotary angles per head: the surface's pool carries an angle pool
POOL_CALLS = {  # method -> its valid arguments, by position (mine: three slots; groups: two of T = 2)
    "alloc": lambda mine, groups: (1,),
    "free": lambda mine, groups: ([mine[0]],),
    "reset": lambda mine, groups: ([mine[0]],),
    "copy": lambda mine, groups: ([mine[0]], [mine[1]]),
    "fork": lambda mine, groups: (mine[0], 1),
    "alloc_spec": lambda mine, groups: (1, 2),
    "free_spec": lambda mine, groups: (groups[:1],),
    "commit_accepted": lambda mine, groups: (groups, [2, 1]),
    "spec_indices": lambda mine, groups: (groups,),
    "current_rows": lambda mine, groups: (groups,),
    "is_allocated": lambda mine, groups: (mine[0],),
    "layer_tensors": lambda mine, groups: (0,),
}


def _odd_tensor(kind: str, t: torch.Tensor):
    """The odd replacement, or a skipped example when this kind cannot be made from ``t``."""
    try:
        return ODD_TENSORS[kind](t)
    except (RuntimeError, IndexError, ValueError, TypeError, NotImplementedError):
        assume(False)


def _bookkeeping(pool: StatePool, groups) -> tuple:
    """The allocator and, while its groups live, each group's committed row."""
    alive = groups is not None and all(pool.is_allocated(int(r)) for r in groups.reshape(-1))
    return pool.num_free, tuple(pool.allocated_slots()), tuple(pool.current_rows(groups).tolist()) if alive else ()


#: CLI subcommands, their value-taking options, and what keeps a valid run short
CLI = {
    "demo": (("--steps", "--layers", "--slots", "--max-batch", "--heads", "--seed", "--spec-tokens",
              "--spec-rounds", "--buckets", "--device", "--tile-d", "--num-warps", "--config", "--state-dtype",
              "--kv-dtype", "--arch", "--tokens", "--mode"), ["--quiet"]),
    # a valid run compiles: a small configuration keeps it short (the odd option, last, adds to it or replaces it)
    "inspect": (("--arch", "--config", "--tile-d", "--num-warps", "--tokens", "--mode", "--batch", "--heads",
                 "--state-dtype", "--replay-ring", "--replay-draft", "--materialize-ring"),
                ["--json", "--config", "32,32,1"]),
    "precompile": (("--arch", "--config", "--tile-d", "--num-warps", "--tokens", "--state-dtype", "--replay-ring",
                    "--replay-draft", "--materialize-ring"), ["--json", "--config", "32,32,1"]),
    # a valid run compiles and executes a small specialisation's PTX: kept small by these flags (the odd one comes last)
    "verify": (("--arch", "--config", "--batch", "--heads", "--seed", "--tile-d", "--num-warps", "--rope-angles",
                "--replay-ring"),
               ["--json", "--config", "32,32,1", "--batch", "2", "--heads", "1"]),
}
ODD_STRINGS = ["-1", "0", "1", "abc", "", "nan", "inf", "1.5", "1e9", "99999999999999999999", "-99999999999999999999",
               "0x10", " 1", "1,2", "sm_", "sm_90a", "cuda", "meta", "float32", "int8", "flagship", "all", "32,32,1",
               "\x00", "--json"]


def _cli_outcome(argv: list) -> str | None:
    """None when the subcommand returned 0 or 2 (a usage error) without a traceback."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    except Exception as e:  # noqa: BLE001 - the point: a traceback is a finding
        return f"{type(e).__name__}: {str(e)[:160]}"
    if rc not in (0, 1, 2) or "Traceback" in err.getvalue():
        return f"exit {rc}: {err.getvalue().strip()[-160:]}"
    return None


class Surface:
    """One pool, its layer's weights and lane inputs, and a plan and a runner built on them."""

    def __init__(self):
        self.pool = StatePool(1, P, H, D, N, R, reserve_null_slot=True, rope_angles=S)
        poison_pool(self.pool, torch.Generator().manual_seed(1))
        self.mine = self.pool.alloc(3).tolist()
        g = torch.Generator().manual_seed(2)
        self.weights = dict(layer_weights(H, D, R, generator=g), B_bias=torch.randn(R, H, N, generator=g),
                            C_bias=torch.randn(R, H, N, generator=g))
        self.lanes = dict(lane_inputs(B, H, D, N, R, generator=torch.Generator().manual_seed(3)),
                          angle_proj=torch.randn(B, H, S, generator=g))
        self.slots = torch.tensor([self.mine[0], -1, self.mine[1]], dtype=torch.int32)
        self.valid = dict(**self.pool.layer_rows(0), **self.lanes, **self.weights,
                          state_batch_indices=self.slots, null_slot_id=self.pool.null_slot_id)
        self.plan = plan_step(**self.valid, update_kv_state=True)
        self.runner = CudaGraphStepRunner(self.pool, 0, buckets=(4,), **self.weights)

    def call(self, entry: str, name: str, value):
        kw = dict(self.valid)
        if name != "-":
            kw[name] = value
        options = {k: kw.pop(k) for k in OPTIONS if k in kw and k != "null_slot_id"}
        if entry == "fn":
            return mamba3_step_fn(**kw, **{"update_kv_state": True, **options})
        if entry == "op":
            return mamba3_step_op(**kw, **{"update_kv_state": True, **options})
        if entry == "plan.run":
            kw.pop("null_slot_id")
            return self.plan.run(**kw, null_slot_id=self.pool.null_slot_id if name != "null_slot_id" else value)
        lane = {k: kw.get(k) for k in ("A", "B", "C", "x", "dt", "trap", "z", "angle_proj")}
        if entry == "decode_step":
            return decode_step(self.pool, 0, kw["state_batch_indices"], **lane,
                               **{k: kw.get(k) for k in ("D", "xproj", "outproj", "zproj", "out", "B_bias", "C_bias")},
                               dst_slots=kw.get("dst_state_batch_indices"),
                               num_accepted_tokens=kw.get("num_accepted_tokens"),
                               **{k: v for k, v in options.items() if k != "update_kv_state"})
        if entry == "runner":
            return self.runner.step(kw["state_batch_indices"], **lane, dst_slots=kw.get("dst_state_batch_indices"),
                                    num_accepted_tokens=kw.get("num_accepted_tokens"))
        raise AssertionError(entry)


def _judged(fn, snapshot, unchanged) -> str | None:
    """None when ``fn()`` succeeded or was refused cleanly (a named TypeError/ValueError, and
    ``unchanged(snapshot())`` from before the call still holds); else what went wrong."""
    snap = snapshot()
    try:
        fn()
        return None
    except (TypeError, ValueError, PoolExhaustedError) as e:
        if not NAMED.match(str(e)):
            return f"unnamed {type(e).__name__}: {str(e)[:160]}"
        if not unchanged(snap):
            return f"refused ({type(e).__name__}: {str(e)[:80]}) but changed the pool"
        return None
    except Exception as e:  # noqa: BLE001 - the point: anything else is a finding
        return f"{type(e).__name__}: {str(e)[:160]}"


#: the CLI families the short run draws from (a valid ``verify`` compiles and executes a kernel: the
#: long run only, where it gets its share without dominating the default suite's time)
LONG_RUN = 5000


def _report(examples: int, failures: list) -> None:
    print("RESULT " + json.dumps({"examples": examples, "failures": sorted(set(failures))}))


def main(examples: int, seed_value: int) -> None:
    s = Surface()
    cli_families = sorted(CLI) if examples >= LONG_RUN else sorted(set(CLI) - {"verify"})
    failures, count = [], [0]
    step_entries = ("fn", "op", "plan.run", "decode_step", "runner")


    # a CLI run costs a hundred library calls: one example in twenty
    entries = step_entries * 3 + ("pool",) * 4 + ("cli",)

    @seed(seed_value)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(entry=st.sampled_from(entries), arg=st.integers(0, 10**6), odd=ODD)
    def run(entry, arg, odd):
        count[0] += 1
        kind, which = odd
        if entry == "cli":
            sub = cli_families[arg % len(cli_families)]
            options, short = CLI[sub]
            option = options[arg // len(cli_families) % len(options)]
            argv = [sub, *short, option, ODD_STRINGS[arg // 97 % len(ODD_STRINGS)]]
            problem = _cli_outcome(argv)
            if problem:
                failures.append(f"cli {' '.join(argv)}: {problem}")
            return
        pool, groups = s.pool, None
        if entry == "pool":  # a fresh pool each time: a successful odd call may take or free slots
            pool = StatePool(1, 2 * P, H, D, N, R, reserve_null_slot=True, rope_angles=S)
            mine = pool.alloc(3).tolist()
            groups = pool.alloc_spec(2, 2)
            method = sorted(POOL_CALLS)[arg % len(POOL_CALLS)]
            args = list(POOL_CALLS[method](mine, groups))
            pos = arg // len(POOL_CALLS) % len(args)
            args[pos] = ODD_SCALARS[which] if kind == "scalar" else \
                _odd_tensor(which, torch.as_tensor(args[pos], dtype=torch.int64))
            fn = (lambda: getattr(pool, method)(*args))
            label = f"pool.{method} arg {pos}"
        else:
            names = TENSOR_ARGS + OPTIONS
            name = names[arg % len(names)]
            if kind == "tensor":
                base = s.valid.get(name)
                if not isinstance(base, torch.Tensor):  # absent, or a scalar: a tensor in its place
                    base = s.lanes["x"] if name == "out" else s.slots
                value = _odd_tensor(which, base)
            else:
                value = ODD_SCALARS[which]
            fn = (lambda: s.call(entry, name, value))
            label = f"{entry} {name}"
        roots = (pool, args) if entry == "pool" else (pool, s.runner, s.valid, value)
        problem = judged_reachable(_judged, fn, roots, lambda: _bookkeeping(pool, groups))
        if problem:
            failures.append(f"{label} <- {kind} {which}: {problem}")

    run()
    _report(count[0], failures)


def main_replay(examples: int, seed_value: int, surface: str = "replay") -> None:
    """The replay surface (``tests/fuzz_replay_surface.py``) or the helpers' (``tests/fuzz_helper_surface.py``),
    with the same odd values and judge."""
    rs = ReplaySurface() if surface == "replay" else HelperSurface()
    example = replay_example if surface == "replay" else helper_example
    failures, count = [], [0]

    @seed(seed_value)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(arg=st.integers(0, 10**6), odd=ODD)
    def run(arg, odd):
        count[0] += 1
        kind, which = odd

        def odd_value(base):
            if kind == "scalar":
                return ODD_SCALARS[which]
            return _odd_tensor(which, base if isinstance(base, torch.Tensor) else rs.slots)

        label, problem = example(rs, arg, odd_value, _judged)
        if problem:
            failures.append(f"{label} <- {kind} {which}: {problem}")

    run()
    _report(count[0], failures)


if __name__ == "__main__":
    os.environ["MAMBA3_STEP_CACHE_DIR"] = tempfile.mkdtemp(prefix="mamba3-fuzz-cache-")  # precompile writes
    surface = sys.argv[3] if len(sys.argv) > 3 else "step"
    if surface == "step":
        main(int(sys.argv[1]), int(sys.argv[2]))
    else:
        main_replay(int(sys.argv[1]), int(sys.argv[2]), surface)
