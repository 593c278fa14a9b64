"""bench/: the model benchmark's figures against an independent hand count, the static
comparison on two real compiles, the GPU benchmark's CPU-testable parts (every suite's plumbing on
the CPU path, the no-CUDA exit, its correctness gates refusing to report, the set rotation, the table
arithmetic), the reading of its result beside the models (``--measured``, on tables written here),
and the drift benchmark on a short run."""

from __future__ import annotations

import argparse
import functools

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mamba3_step.tools.bytes_model import bytes_per_step, replay_bytes
from mamba3_step.tools.issue_model import GPUS, REPLAY_STATES_EXECUTED, replay_states_issue_model
from mamba3_step.spec import flagship_spec
from mamba3_step.testing import bits_equal

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


def _load(name):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


model_bench = _load("model_bench")
angle_bench = _load("angle_bench")
static_bench = _load("static_bench")
gpu_bench = _load("gpu_bench")
gpu_replay_probe = _load("gpu_replay_probe")
gpu_async_probe = _load("gpu_async_probe")
gpu_results = _load("gpu_results")
drift_bench = _load("drift_bench")

from gpu_suites import replay as replay_suite  # noqa: E402  (bench/ is on sys.path now)
from gpu_suites import replay_plot, step_checks, timing  # noqa: E402
from gpu_suites import replay_states as states_suite  # noqa: E402
from gpu_suites import replay_verify as verify_suite  # noqa: E402


def _hand_bytes(batch, heads, mode):
    """The flagship's bytes per step, summed tensor by tensor from docs/contract.md's shapes.
    N=128, D=64, R=4; fp32 state; bf16 Bstate/B/C/x/z/Xstate/out/projections; update_kv_state."""
    N, D, R, H, B = 128, 64, 4, heads, batch
    state = B * H * D * N * 4
    bstate = B * R * H * N * 2
    xstate = B * H * D * 2
    kernel = (
        2 * state + 2 * bstate + 2 * xstate  # read old rows, write new state and this step's B/x
        + 2 * (B * R * H * N * 2)  # B, C
        + 2 * (B * H * D * 2)  # x, z
        + B * H * D * 2  # out (with outproj)
        + 3 * (B * H * 4) + H * 4  # A, dt, trap; D
        + 3 * (R * H * D * 2)  # xproj, zproj, outproj
    )
    if mode == "dense":
        return kernel
    if mode == "pool":
        return kernel + B * 4
    # gather (read pool rows, write dense copies) and scatter (read dense, write pool rows) of
    # all three state tensors, and an index read per gather / scatter
    return kernel + 2 * 2 * (state + bstate + xstate) + 6 * B * 4


# ----------------------------------------------------------------------------- model benchmark
def test_model_bench_bytes_equal_hand_count(tmp_path, capsys):
    rc = model_bench.main(["--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.startswith("flagship (N=128 D=64 R=4, fp32 state), H=48")
    payload = json.loads((tmp_path / "model_bench.json").read_text())
    assert "modelled" in payload["what"]
    flag = [r for r in payload["rows"] if r["config"].startswith("flagship (")]
    assert [r["batch"] for r in flag] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    for r in flag:
        for mode in ("pool", "gather_scatter", "dense"):
            assert r[f"bytes_{mode}"] == _hand_bytes(r["batch"], 48, mode), (r["batch"], mode)
            for gpu, bw in (("H100", 3.35e12), ("H200", 4.8e12), ("GH200", 4.0e12)):
                assert r[f"us_{mode}_{gpu}"] == pytest.approx(r[f"bytes_{mode}"] / bw * 1e6, rel=1e-12)
        assert r["speedup_pool_vs_gather_scatter"] == pytest.approx(
            _hand_bytes(r["batch"], 48, "gather_scatter") / _hand_bytes(r["batch"], 48, "pool"), rel=1e-12)
    # the printed table carries the same numbers (B=256 row, MiB with one decimal)
    row256 = next(line for line in text.splitlines() if line.strip().startswith("256 "))
    assert f"{_hand_bytes(256, 48, 'pool') / 2**20:.1f}" in row256.split()
    assert f"{_hand_bytes(256, 48, 'gather_scatter') / 2**20:.1f}" in row256.split()
    assert len(payload["configs"]) == len(model_bench.configurations()) >= 4
    # the speculative table: T = 1 is the one-token step; the state is read once per T tokens
    tokens = payload["tokens"]
    for r in tokens:
        state = 48 * 64 * 128 * 4 * r["batch"]  # one read of every lane's state
        saved = (r["tokens"] - 1) * state  # T one-token steps read it T times
        assert (r["mib_one_token_steps"] - r["mib_t_token"]) * 2**20 >= saved, r
        assert (r["saving"] == 1.0) == (r["tokens"] == 1)
    assert "speculative verify step" in text


def _hand_rotary(batch, heads):
    """(fused, upstream with pools) bytes of the flagship rotary decode, summed by hand: S=32 angles,
    biases, B/C shared by the heads; fused: the pool step with update_kv_state, an int64 angle;
    upstream (Mamba3.step): gather 4 rows, rotary launch, dense step, 3 copies, scatter 4 rows."""
    N, D, R, H, B, S = 128, 64, 4, heads, batch, 32
    state, bstate, xstate = B * H * D * N * 4, B * R * H * N * 2, B * H * D * 2
    bias = R * H * N * 4
    common = (2 * state + 2 * (B * H * D * 2) + B * H * D * 2  # state r + w; x, z; out
              + 3 * (B * H * 4) + H * 4 + 3 * (R * H * D * 2))  # A, dt, trap; D; projections
    fused = (common + 2 * bstate + 2 * xstate + 2 * (B * R * N * 2)  # kv rows r + w; one B/C row per lane
             + 2 * B * H * S * 8 + B * H * S * 4 + 2 * bias + B * 4)  # angle r + w, angle_proj, biases, index
    angle = B * H * S * 4  # upstream: fp32
    rotary = (2 * (B * R * N * 2) + 2 * 2 * bias + 2 * bias  # B, C; bias relayout copies; biases
              + 2 * angle + B * S * 2 + B * H * 4 + 2 * bstate)  # angle in + out, angle_proj, dt; B~, C~
    step = common + bstate + xstate + 2 * bstate  # k, v read; B~, C~ read
    copies = 2 * (angle + bstate + xstate)
    moves = 2 * 2 * (state + bstate + xstate + angle) + 8 * B * 4  # gather + scatter, indices
    return fused, rotary + step + copies + moves


def test_model_bench_rotary_equals_hand_count(tmp_path, capsys):
    assert model_bench.main(["--out", str(tmp_path), "--no-plot"]) == 0
    text = capsys.readouterr().out
    rotary = json.loads((tmp_path / "model_bench.json").read_text())["rotary"]
    assert [r["batch"] for r in rotary["rows"]] == [1, 64, 256]
    assert rotary["spec"]["rope_angles"] == 32 and rotary["spec"]["shared_bc"] and rotary["spec"]["has_bc_bias"]
    for r in rotary["rows"]:
        fused, upstream = _hand_rotary(r["batch"], 48)
        assert r["bytes_fused"] == fused and r["bytes_upstream_pools"] == upstream, r["batch"]
        assert sum(r["stages_fused"].values()) == fused and sum(r["stages_upstream_pools"].values()) == upstream
        assert r["stages_fused"]["gather"] == r["stages_fused"]["scatter"] == r["stages_fused"]["copies"] == 0
        assert r["ratio_pools"] == pytest.approx(upstream / fused, rel=1e-12)
        assert r["us_fused_H100"] == pytest.approx(fused / 3.35e12 * 1e6, rel=1e-12)
        assert r["launches_fused"] == 1 and r["launches_upstream_pools"] == 15 and r["launches_upstream_dense"] == 7
    assert "rotary decode step" in text and "assumptions:" in text and "e9594ce" in text
    row = next(line for line in text.split("rotary decode step")[1].splitlines() if line.strip().startswith("256 "))
    assert f"{_hand_rotary(256, 48)[0] / 2**20:.2f}" in row.split()


def test_angle_bench_short_run(tmp_path, capsys):
    """2 x 10^4 steps, 2 trials: the table and JSON, the emulations' self-check passed, our int64
    angle at float64's floor, upstream's unreduced fp32 angle drifting as it grows."""
    assert angle_bench.main(["--out", str(tmp_path), "--steps", "20000", "--trials", "2", "--no-plot"]) == 0
    text = capsys.readouterr().out
    payload = json.loads((tmp_path / "angle_bench.json").read_text())
    assert payload["checkpoints"] == [1000, 10000] and payload["methods"] == list(angle_bench.METHODS)
    res = payload["regimes"]
    for regime in angle_bench.REGIMES:
        ours = res[regime]["int64 fixed point (ours)"]
        assert max(ours["f64"]) < 1e-14 and max(ours["f32"]) < 2e-7, (regime, ours)
        assert res[regime]["int32 fixed point"]["f64"][-1] > ours["f64"][-1]
    upstream = res["one sign"]["fp32 unreduced (upstream)"]["f64"]
    assert upstream[1] > 3 * upstream[0] > 1e-6  # the fp32 angle grows, its resolution falls
    adv = res["adversarial"]
    assert adv["fp32 unreduced (upstream)"]["f64"][-1] > adv["int32 fixed point"]["f64"][-1]
    assert "int64 fixed point (ours)" in text and "1e4 steps" in text


def test_angle_bench_fp32_reduced_emulation_is_the_step_loop():
    rng = np.random.default_rng(0)
    inc = (rng.standard_normal((1, 3000)) * 0.3 + 0.2).astype(np.float32)  # wraps every ~30 steps
    angle_bench.self_check(inc, 3000)  # raises when the vectorised emulation differs from the loop


def test_angle_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    results = {r: angle_bench.regime_errors(r, 1, 2000) for r in angle_bench.REGIMES}
    png = tmp_path / "a.png"
    assert angle_bench.plot(results, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = model_bench.model_rows(batches=(1, 8, 64))
    png = tmp_path / "m.png"
    assert model_bench.plot(rows, png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_format_table_alignment():
    text = model_bench._util.format_table(
        [{"a": 1, "b": 2.345, "c": "x"}, {"a": 100, "b": None, "c": "long"}],
        [("a", "A", ">d"), ("b", "bee", ">.1f"), ("c", "C", "<")],
    )
    assert text.splitlines() == ["  A  bee  C", "---  ---  ----", "  1  2.3  x", "100    -  long"]


# ----------------------------------------------------------------------------- static comparison
def _kernel_and_nvdisasm():
    try:
        from mamba3_step.tools.inspection import find_nvdisasm
        from mamba3_step.kernel import compile_step_kernel  # noqa: F401
    except Exception:
        return False
    return find_nvdisasm() is not None


@pytest.mark.skipif(not _kernel_and_nvdisasm(), reason="kernel or nvdisasm unavailable")
def test_static_bench_two_modes(capsys):
    from mamba3_step.tools.inspection import count_sass

    specs = [("flagship", "dense", flagship_spec(pool=False, update_kv_state=False)),
             ("flagship", "pool", flagship_spec(update_kv_state=False))]
    rows = static_bench.measure(specs, "sm_90a")
    assert [r.get("error") for r in rows] == [None, None]
    dense, pool = rows
    for r in rows:
        assert r["spill_bytes"] == 0 and r["registers"] * r["threads"] <= 65536 and r["registers"] <= 255
        assert r["total"] == sum(v for k, v in r["sass"].items() if k not in ("total", "NOP"))
        assert r["stg128"] == count_sass(r["sass"], "STG", 128)
        assert r["ldg_narrow"] == count_sass(r["sass"], "LDG") - count_sass(r["sass"], "LDG", 128)
    assert dense["extra_vs_dense"] is None
    assert pool["extra_vs_dense"] == pool["total"] - dense["total"]
    text = static_bench.format_rows(rows)
    assert "flagship" in text and f"{pool['extra_vs_dense']:+d}" in text


def test_static_bench_plan_and_delta_arithmetic():
    plan = static_bench.plan()
    assert plan[0][:2] == ("flagship N=128 D=64 R=4 fp32", "dense")
    assert len(plan) == len(static_bench.MODES) + 2 * (len(static_bench.CONFIGS) - 1)
    assert all(s.tile_D and s.num_warps for _, _, s in plan)
    rows = [{"config": "c", "mode": "dense", "total": 100}, {"config": "c", "mode": "dense+kv", "total": 110},
            {"config": "c", "mode": "pool", "total": 104}, {"config": "c", "mode": "pool+kv", "total": 117},
            {"config": "d", "mode": "dense", "total": 50}, {"config": "d", "mode": "pool+kv", "total": 58},
            {"config": "e", "mode": "pool", "error": "x"}]
    static_bench.add_pool_delta(rows)
    assert [r["extra_vs_dense"] for r in rows] == [None, 10, 4, 7, None, 8, None]


# ----------------------------------------------------------------------------- GPU benchmark, CPU parts
def _suite_result(out_dir, suite):
    return json.loads((out_dir / "gpu_bench.json").read_text())["suites"][suite]


def _with_graph_times(out_dir):
    """The result in ``out_dir`` read by ``gpu_results``, every row's eager time given as its graph time too
    (the CPU path has no graphs): what the models' --measured reads, from the suites' own rows."""
    payload = gpu_results.load(out_dir / "gpu_bench.json")
    for suite in payload["suites"].values():
        for row in suite["rows"]:
            row["us_graph"] = row["us_eager"]
    return payload


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device exists")
@pytest.mark.parametrize("suite", ["step", "replay", "replay-verify", "replay-states", "all", "replay,step"])
def test_gpu_benchmark_without_cuda_says_so(suite, tmp_path, capsys):
    assert gpu_bench.main(["--suite", suite, "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "no CUDA device: GPU benchmark not run"
    assert not (tmp_path / "gpu_bench.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--suite", "replays"], "--suite: expected all or a comma-separated subset of step,replay,replay-verify,"
                             "replay-states, got 'replays'"),
    (["--suite", ""], "--suite: expected all"),
    (["--batches", "1,x"], "--batches: expected comma-separated ints, got '1,x'"),
    (["--batches", "0"], "--batches: expected positive ints, got '0'"),
    (["--heads", "0"], "--heads: expected an int >= 1, got 0"),
    (["--suite", "replay", "--ks", "2,four"], "--ks: expected comma-separated ints"),
    (["--suite", "replay", "--replay-warps", "8,"], None),
    (["--suite", "replay-states", "--forms", "int8,int4"], "--forms: expected some of rotary,bf16-sr,int8,int8-F4"),
    (["--suite", "replay-verify", "--tokens", "1"], "--tokens: expected an int in [2, 16], got 1"),
    (["--suite", "replay-verify", "--outputs", "replayed,stepped"], "--outputs: expected a comma-separated subset"),
])
def test_gpu_bench_refuses_bad_options_naming_them(argv, message, tmp_path, capsys):
    """Every option is checked before anything runs (no CUDA needed): argparse's exit 2 with the
    option's name, expected and got; a trailing comma in a list is no error."""
    if message is None:
        args = gpu_bench.parser().parse_args(argv)
        assert gpu_bench.configure(args)["replay"].replay_warps == (8,)
        return
    with pytest.raises(SystemExit) as exc:
        gpu_bench.main(argv + ["--device", "cpu", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "gpu_bench.json").exists()


def test_gpu_bench_suite_all_is_every_suite_in_order():
    assert gpu_bench.suite_names("all") == ["step", "replay", "replay-verify", "replay-states"]
    assert gpu_bench.suite_names("replay-verify,step") == ["replay-verify", "step"]
    options = gpu_bench.configure(gpu_bench.parser().parse_args(["--suite", "all", "--device", "cpu"]))
    assert {name: o.batches for name, o in options.items()} == {
        "step": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), "replay": (1, 64, 256), "replay-verify": (1, 64, 256),
        "replay-states": (256,)}
    assert len({id(o.run) for o in options.values()}) == 1  # one run's settings, shared
    run = options["step"].run
    assert (run.target_s(60.0, 60.0), run.target_s(200.0, 50.0)) == (0.06, 0.05)  # each suite's own default
    given = gpu_bench.configure(gpu_bench.parser().parse_args(["--suite", "all", "--batches", "3", "--target-ms", "7"]))
    assert all(o.batches == (3,) for o in given.values()) and given["replay"].run.target_s(200.0, 50.0) == 0.007


REPLAY_ARGS = ["--suite", "replay", "--device", "cpu", "--heads", "1", "--batches", "2", "--ks", "2", "--replay-warps",
               "8", "--checkpoint-warps", "4", "--min-ctas", "3", "--no-graph", "--no-plot"]


def test_gpu_bench_replay_suite_plumbing_on_cpu(tmp_path, capsys, monkeypatch):
    """Suite replay on CPU tensors: its correctness check passes (and fails on a corrupted replay step,
    with no timing), every step kind is timed, the bytes ratio is the model's."""
    args = REPLAY_ARGS + ["--out", str(tmp_path)]
    assert gpu_bench.main(args) == 0
    assert "replay K=2" in capsys.readouterr().out
    rows = _suite_result(tmp_path, "replay")["rows"]
    assert [(r["step"], r["outputs"], r["num_warps"], r["min_ctas"]) for r in rows] == [
        ("stepwise", None, None, None), ("replay K=2", "replayed", None, None),
        ("replay K=2", "from checkpoint", None, None), ("replay K=2", "replayed", 8, None),
        ("replay K=2", "from checkpoint", 4, None), ("replay K=2", "replayed", None, 3)]
    assert rows[1]["bytes_ratio"] == pytest.approx(replay_bytes(flagship_spec(), 2, 2, 1)["total"]
                                                   / bytes_per_step(flagship_spec(), 2, 1)["total"])
    assert all(r["us_eager"] > 0 for r in rows)
    x = [r["us_eager"] / rows[0]["us_eager"] for r in rows]  # the models' reader, on this suite's own rows
    assert gpu_results.replay_times(_with_graph_times(tmp_path), batch=2) == {
        (2, False): pytest.approx(x[1]), (2, True): pytest.approx(x[2])}
    original = replay_suite.Layer.replay
    monkeypatch.setattr(replay_suite.Layer, "replay",
                        lambda self, fc=False, w=None, m=0: original(self, fc, w, m).add_(1.0))
    assert gpu_bench.main(args[:-2] + ["--out", str(tmp_path / "bad")]) == 1
    assert "CORRECTNESS FAILURE" in capsys.readouterr().out
    assert not (tmp_path / "bad" / "gpu_bench.json").exists()
    # from the checkpoint an append's out is checked within 2% of the stepwise kernel's, a flush's bit for bit
    monkeypatch.setattr(replay_suite.Layer, "replay", original)
    assert replay_suite.check_one(2, 1, 2, "cpu", 4, True) is None
    monkeypatch.setattr(replay_suite.Layer, "replay",
                        lambda self, fc=False, w=None, m=0: original(self, fc, w, m).mul_(1.05))
    assert "out differs" in replay_suite.check_one(2, 1, 2, "cpu", 4, True)
    monkeypatch.setattr(replay_suite.Layer, "replay",
                        lambda self, fc=False, w=None, m=0:
                        original(self, fc, w, m).add_(0.0 if self.ring.length[0, 0] else 1e-3))
    assert "step 1: out differs" in replay_suite.check_one(2, 1, 2, "cpu", 4, True)  # the first flush, exact


def test_gpu_bench_checks_every_suite_before_timing_any(tmp_path, capsys, monkeypatch):
    """A failed check in the second suite leaves the first one untimed: no table, no JSON."""
    original = replay_suite.Layer.replay
    monkeypatch.setattr(replay_suite.Layer, "replay",
                        lambda self, fc=False, w=None, m=0: original(self, fc, w, m).add_(1.0))
    args = ["--suite", "step,replay", "--device", "cpu", "--heads", "1", "--batches", "2", "--ks", "2",
            "--target-ms", "1", "--no-plot", "--out", str(tmp_path)]
    assert gpu_bench.main(args) == 1
    text = capsys.readouterr().out
    assert "CORRECTNESS FAILURE in suite replay" in text and "no timing is reported" in text
    assert "MiB/step" not in text and "== suite" not in text
    assert not (tmp_path / "gpu_bench.json").exists()


def test_gpu_bench_replay_states_suite_plumbing_on_cpu(tmp_path, capsys, monkeypatch):
    """Suite replay-states on CPU tensors: its checks pass for the int8 form (and fail on a corrupted
    replay step, with no timing), every step kind is timed, each row carries the issue model's ratio of
    its REPLAY_STATES_EXECUTED entry."""
    args = ["--suite", "replay-states", "--device", "cpu", "--heads", "1", "--batches", "2", "--forms", "int8",
            "--min-ctas", "3", "--no-graph", "--no-plot", "--out", str(tmp_path)]
    assert gpu_bench.main(args) == 0
    rows = _suite_result(tmp_path, "replay-states")["rows"]
    assert [(r["step"], r["outputs"]) for r in rows] == [
        ("stepwise", None), ("replay", "replayed"), ("replay", "from checkpoint"), ("replay", "replayed, 3 CTAs")]
    assert rows[2]["modelled_h200"] == pytest.approx(replay_states_issue_model(
        "int8 state, from the checkpoint", GPUS["H200"], 2, 1)["time"])
    assert all(r["us_eager"] > 0 for r in rows)
    assert [r["time_x"] for r in rows] == pytest.approx([r["us_eager"] / rows[0]["us_eager"] for r in rows])
    assert gpu_results.states_times(_with_graph_times(tmp_path), batch=2) == {
        "int8 state": pytest.approx(rows[1]["time_x"]),
        "int8 state, from the checkpoint": pytest.approx(rows[2]["time_x"])}
    original = states_suite.Layer.replay
    # a flush differing by one code's worth fails the exact check; an append 10% off fails the 5% rule
    monkeypatch.setattr(states_suite.Layer, "replay",
                        lambda self, fc=False, m=0: original(self, fc, m).add_(0.0 if self.ring.length[0, 0] else 1e-3))
    assert gpu_bench.main(args[:-2] + ["--out", str(tmp_path / "bad")]) == 1
    assert "CORRECTNESS FAILURE" in capsys.readouterr().out
    assert not (tmp_path / "bad" / "gpu_bench.json").exists()
    monkeypatch.setattr(states_suite.Layer, "replay",
                        lambda self, fc=False, m=0:
                        original(self, fc, m).mul_(1.0 if not self.ring.length[0, 0] else 1.1))
    assert "not within 5%" in states_suite.check_one("int8 state", 2, 1, "cpu", True)


def test_gpu_bench_replay_verify_suite_plumbing_on_cpu(tmp_path, capsys, monkeypatch):
    """Suite replay-verify on CPU tensors: its check passes (and fails on a corrupted replay step, with
    no timing), every step kind is timed, the bytes ratio is the model's against today's verify step."""
    args = ["--suite", "replay-verify", "--device", "cpu", "--heads", "1", "--batches", "2", "--ks", "2,4", "--tokens",
            "2", "--no-graph", "--no-plot", "--out", str(tmp_path)]
    assert gpu_bench.main(args) == 0
    assert "replay K=4 from the checkpoint" in capsys.readouterr().out
    rows = _suite_result(tmp_path, "replay-verify")["rows"]
    assert [(r["step"], r["K"], r["tokens"], r["from_checkpoint"]) for r in rows] == [
        ("stepwise", None, 2, False), ("replay K=2", 2, 2, False), ("replay K=4", 4, 2, False),
        ("replay K=2 from the checkpoint", 2, 2, True), ("replay K=4 from the checkpoint", 4, 2, True)]
    today = flagship_spec(tokens=2, has_dst=True, dst_per_token=True, num_accepted=True)
    assert rows[2]["bytes_ratio"] == pytest.approx(replay_bytes(today, 4, 2, 1)["total"]
                                                   / bytes_per_step(today, 2, 1)["total"])
    assert all(r["us_eager"] > 0 for r in rows)
    x = [r["us_eager"] / rows[0]["us_eager"] for r in rows]
    measured = _with_graph_times(tmp_path)
    assert gpu_results.verify_times(measured, batch=2) == {2: pytest.approx(x[1]), 4: pytest.approx(x[2])}
    assert gpu_results.verify_times(measured, batch=2, from_checkpoint=True) == {
        2: pytest.approx(x[3]), 4: pytest.approx(x[4])}
    original = verify_suite.Layer.replay
    monkeypatch.setattr(verify_suite.Layer, "replay", lambda self: original(self).add_(1.0))
    assert gpu_bench.main(args[:-2] + ["--out", str(tmp_path / "bad")]) == 1
    assert "CORRECTNESS FAILURE" in capsys.readouterr().out
    assert not (tmp_path / "bad" / "gpu_bench.json").exists()
    # the outputs from the checkpoint: a sanity bound, which a 2% error fails
    monkeypatch.setattr(verify_suite.Layer, "replay",
                        lambda self: original(self).mul_(1.0 if not self.from_checkpoint else 1.02))
    assert gpu_bench.main(args[:-2] + ["--out", str(tmp_path / "bad")]) == 1
    assert gpu_bench.main(args[:-2] + ["--outputs", "replayed", "--out", str(tmp_path / "ok")]) == 0


def test_gpu_bench_replay_plot_speedups(tmp_path):
    """The replay suites' plot: a speed-up per variant and batch (graph where timed, else eager), the
    stepwise rows left out; a PNG with matplotlib."""
    rows = [{"batch": 1, "step": "stepwise", "speedup_eager": 1.0},
            {"batch": 1, "step": "replay K=2", "outputs": "replayed", "speedup_eager": 1.5, "speedup_graph": 1.25},
            {"batch": 4, "step": "replay K=2", "outputs": "replayed", "speedup_eager": 0.5},
            {"batch": 4, "step": "replay K=2", "outputs": "replayed", "num_warps": 8, "speedup_eager": 2.0},
            {"batch": 4, "form": "int8 state", "step": "replay", "outputs": "replayed, 3 CTAs", "speedup_eager": 0.75},
            {"batch": 4, "step": "replay K=4", "outputs": "replayed", "min_ctas": 3, "speedup_eager": 0.8}]
    assert replay_plot.speedups(rows) == {"replay K=2, replayed": {1: 1.25, 4: 0.5},
                                          "replay K=2, replayed, 8 warps": {4: 2.0},
                                          "int8 state, replay, replayed, 3 CTAs": {4: 0.75},
                                          "replay K=4, replayed, 3 CTAs": {4: 0.8}}
    pytest.importorskip("matplotlib")
    png = tmp_path / "r.png"
    assert replay_plot.plot_speedups({"replay": {"rows": rows}, "replay-verify": {"rows": rows[:2]}}, "t", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device exists")
def test_gpu_async_probe_without_cuda_says_so_and_refuses_unknown_kernels(capsys):
    assert gpu_async_probe.main(["--batch", "1"]) == 0
    assert capsys.readouterr().out.strip() == "no CUDA device: nothing to profile"
    with pytest.raises(SystemExit):
        gpu_async_probe.main(["--kernels", "registers,warp-specialised"])


def test_gpu_replay_probe_without_cuda_says_so(capsys):
    assert gpu_replay_probe.main(["--batch", "2"]) == 0
    assert capsys.readouterr().out.strip() == "no CUDA device: nothing to profile"


def test_gpu_replay_probe_profiles_the_variants_in_its_stated_order():
    """The order ncu's report is read in: stepwise in pool and dense mode, replayed for each K, then
    from the checkpoint; every variant runs (here on the CPU path) and returns the step's out, pool
    and dense mode the same."""
    runs = gpu_replay_probe.variants(2, 1, [2, 3], device="cpu", replay_warps=[8])
    assert [name for name, _ in runs] == ["stepwise", "stepwise dense", "replay K=2 replayed", "replay K=3 replayed",
                                          "replay K=2 replayed 8 warps", "replay K=3 replayed 8 warps",
                                          "replay K=2 from checkpoint", "replay K=3 from checkpoint"]
    assert all(tuple(fn().shape) == (2, 1, 64) for _, fn in runs)
    assert bits_equal(runs[0][1](), runs[1][1]())


@pytest.mark.parametrize("script", ["gpu_diagnose.sh", "gpu_all.sh", "gpu_async.sh"])
def test_gpu_scripts_parse(script):
    assert subprocess.run(["bash", "-n", os.path.join(BENCH, script)], capture_output=True).returncode == 0


CPU_ARGS = ["--suite", "step", "--device", "cpu", "--heads", "1", "--batches", "1,2", "--target-ms", "1", "--no-plot"]


def test_gpu_bench_plumbing_on_cpu(tmp_path, capsys):
    """Suite step on CPU tensors (PyTorch path, perf_counter): checks pass, every mode
    is timed, and the table's GB/s are the bytes model's bytes over the measured time."""
    assert gpu_bench.main(CPU_ARGS + ["--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "MiB/step" in text and "gather->dense->scatter" in text
    result = _suite_result(tmp_path, "step")
    rows = result["rows"]
    assert {(r["batch"], r["mode"], r["kind"]) for r in rows} == {
        (b, m, "eager") for b in (1, 2) for m in ("pool", "gather_scatter", "dense")}
    for r in rows:
        assert r["bytes"] == bytes_per_step(flagship_spec(), r["batch"], 1, mode=r["mode"])["total"]
        assert r["us"] > 0 and r["gbps"] == pytest.approx(r["bytes"] / (r["us"] * 1e-6) / 1e9, rel=1e-9)
    assert result["copy_bandwidth_bytes_per_s"] > 0
    for t in result["table"]:
        assert t["pct_copy_eager"] == pytest.approx(100 * t["gbps_eager"] * 1e9 / result["copy_bandwidth_bytes_per_s"])


def test_gpu_bench_step_state_dtype_runs_the_flagship_with_a_bf16_state(tmp_path, capsys):
    """--step-state-dtype bfloat16: the same modes, checked and timed, with a bf16 state's bytes."""
    assert gpu_bench.main(CPU_ARGS + ["--step-state-dtype", "bfloat16", "--batches", "1", "--out", str(tmp_path)]) == 0
    result = _suite_result(tmp_path, "step")
    assert result["spec"]["state_dtype"] == "bfloat16"
    for r in result["rows"]:
        assert r["bytes"] == bytes_per_step(flagship_spec(state_dtype="bfloat16"), 1, 1, mode=r["mode"])["total"]


def test_gpu_bench_padded_rows_times_the_run_time_stride_kernel_beside_pool_mode(tmp_path, capsys):
    """--padded-rows: a fourth mode, pool mode over state rows of a padded D stride, checked first
    (pool mode's bits, padding untouched), timed, with pool mode's bytes."""
    assert gpu_bench.main(CPU_ARGS + ["--padded-rows", "--out", str(tmp_path)]) == 0
    assert "pool, padded rows" in capsys.readouterr().out
    rows = _suite_result(tmp_path, "step")["rows"]
    padded = [r for r in rows if r["mode"] == "pool_padded"]
    assert [r["batch"] for r in padded] == [1, 2] and all(r["us"] > 0 for r in padded)
    assert all(r["bytes"] == bytes_per_step(flagship_spec(), r["batch"], 1, mode="pool")["total"] for r in padded)
    view = step_checks.padded_copy({"state": torch.randn(3, 2, 4, 8), "Bstate": torch.randn(3),
                                    "Xstate": torch.randn(3)})
    assert view["state"].stride(-2) == 12 and not view["state"].is_contiguous()


def test_gpu_bench_dense_rows_times_pool_mode_on_dense_modes_rows(tmp_path, capsys):
    """--dense-rows: pool mode whose indices name dense mode's rows in order, timed beside the
    three modes with pool mode's bytes; the indices it is given are exactly those rows."""
    from mamba3_step import mamba3_step_fn

    seen = []

    def step(*args, **kwargs):
        idx = kwargs.get("state_batch_indices")
        if idx is not None:
            seen.append(idx.tolist())
        return mamba3_step_fn(*args, **kwargs)

    assert gpu_bench.main(CPU_ARGS + ["--dense-rows", "--out", str(tmp_path)], step_fn=step) == 0
    assert "pool, dense's rows" in capsys.readouterr().out
    rows = _suite_result(tmp_path, "step")["rows"]
    mine = [r for r in rows if r["mode"] == "pool_dense_rows"]
    assert [r["batch"] for r in mine] == [1, 2] and all(r["us"] > 0 for r in mine)
    assert all(r["bytes"] == bytes_per_step(flagship_spec(), r["batch"], 1, mode="pool")["total"] for r in mine)
    for B in (1, 2):  # every in-order set of rows the mode names
        for s in range(mine[B - 1]["sets"]):
            assert list(range(s * B, (s + 1) * B)) in seen


@pytest.mark.parametrize("what", ["padded_out", "padding_column"])
def test_gpu_bench_padded_rows_check_fails_on_a_wrong_padded_step(what, tmp_path, capsys):
    from mamba3_step import mamba3_step_fn

    def step(*args, **kwargs):
        out = mamba3_step_fn(*args, **kwargs)
        state = args[0]
        if not state.is_contiguous():  # the padded copy
            if what == "padded_out":
                out.view(-1)[0] += 0.5
            else:
                state.as_strided(tuple(state.shape[:-1]) + (state.stride(-2),), state.stride())[..., -1] = 0.0
        return out

    assert gpu_bench.main(CPU_ARGS + ["--padded-rows", "--out", str(tmp_path)], step_fn=step) == 1
    text = capsys.readouterr().out
    assert ("padded-row pool mode out differs" if what == "padded_out" else "padding columns") in text
    assert not (tmp_path / "gpu_bench.json").exists()


def _corrupt(what):
    """A step function that runs the real one, then damages one thing."""
    from mamba3_step import mamba3_step_fn

    def step(*args, **kwargs):
        out = mamba3_step_fn(*args, **kwargs)
        pool_mode = kwargs.get("state_batch_indices") is not None
        if what == "pool_out" and pool_mode:
            out.view(-1)[0] += 0.5
        elif what == "pool_untouched_row" and pool_mode:
            state, idx = args[0], kwargs["state_batch_indices"].long()
            free = [r for r in range(state.shape[0]) if r not in set(idx.tolist())]
            state[free[0]].view(-1)[3] += 1.0
        elif what == "dense_scale" and not pool_mode:
            out.mul_(1.01)
        return out

    return step


@pytest.mark.parametrize("what", ["pool_out", "pool_untouched_row", "dense_scale"])
def test_gpu_bench_refuses_to_report_after_a_failed_check(what, tmp_path, capsys):
    rc = gpu_bench.main(CPU_ARGS + ["--out", str(tmp_path)], step_fn=_corrupt(what))
    assert rc == 1
    text = capsys.readouterr().out
    assert "CORRECTNESS FAILURE" in text and "no timing is reported" in text
    assert "MiB/step" not in text and " us" not in text
    assert not (tmp_path / "gpu_bench.json").exists()


def test_within_reference_bound():
    r64 = torch.linspace(-3, 3, 101, dtype=torch.float64)
    r32 = r64.float()
    assert step_checks.within_reference("x", r32.clone(), r32, r64) is None
    bad = r32.clone()
    bad[7] += 1e-3
    assert "max error" in step_checks.within_reference("x", bad, r32, r64)
    nan = r32.clone()
    nan[0] = float("nan")
    assert "non-finite" in step_checks.within_reference("x", nan, r32, r64)
    # bf16 output: one ulp at the largest magnitude (|3| -> ulp 2^-6) is allowed, four are not
    b16 = r64.bfloat16()
    assert step_checks.within_reference("y", b16, b16, r64) is None
    near = b16.clone()
    near[100] = near[100] + 2.0**-6
    assert step_checks.within_reference("y", near, b16, r64) is None
    far = b16.clone()
    far[100] = far[100] + 4 * 2.0**-6
    assert "max error" in step_checks.within_reference("y", far, b16, r64)


def test_bits_equal_is_nan_safe():
    a = torch.tensor([1.0, float("nan")])
    assert bits_equal(a, a.clone())
    assert not bits_equal(a, torch.tensor([1.0, 2.0]))
    assert not bits_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not bits_equal(a, a.double())


def test_n_sets_covers_four_times_l2():
    L2 = 50 * 2**20
    assert timing.n_sets(3_000_000, L2, max_sets=1024) == 70  # ceil(4 * 52428800 / 3e6)
    assert timing.n_sets(800 * 2**20, L2, max_sets=1024) == 2  # at least two sets
    assert timing.n_sets(1000, L2, max_sets=64) == 64  # capped by the pool
    assert timing.n_sets(1000, 0, max_sets=1) == 1
    with pytest.raises(ValueError, match="bytes_per_set"):
        timing.n_sets(0, L2, 8)


def test_gather_scatter_step_matches_pool_step_on_cpu():
    """The benchmark's gather -> dense -> scatter path gives pool mode's bits (PyTorch path)."""
    spec = flagship_spec(dstate=32, headdim=32, mimo=2)
    g = torch.Generator().manual_seed(3)
    pool = step_checks.make_pool(spec, 9, 2, "cpu", g)
    shared = step_checks.make_shared(spec, 2, "cpu", g)
    lanes = step_checks.make_lanes(spec, 4, 2, "cpu", g)
    idx = torch.tensor([5, 0, 8, 2])
    from mamba3_step import mamba3_step_fn

    p1 = {k: v.clone() for k, v in pool.items()}
    l1 = {k: (v.clone() if v is not None else None) for k, v in lanes.items()}
    step_checks.pool_step(mamba3_step_fn, spec, p1, shared, l1, idx.int())
    p2 = {k: v.clone() for k, v in pool.items()}
    l2 = {k: (v.clone() if v is not None else None) for k, v in lanes.items()}
    scratch = {k: torch.empty((4,) + tuple(v.shape[1:]), dtype=v.dtype) for k, v in pool.items()}
    step_checks.gather_scatter_step(mamba3_step_fn, spec, p2, scratch, shared, l2, idx)
    assert bits_equal(l1["out"], l2["out"])
    for k in pool:
        assert bits_equal(p1[k], p2[k]), k
        assert not bits_equal(p1[k], pool[k]), k  # the rows were updated
    untouched = [1, 3, 4, 6, 7]
    for k in pool:
        assert bits_equal(p1[k][untouched], pool[k][untouched]), k


# ----------------------------------------------------------------------------- drift benchmark
def test_drift_bench_short_run(tmp_path, capsys):
    """64 steps, 2 heads: the tables, the JSON, the float64 loop checked against step_math."""
    assert drift_bench.main(["--out", str(tmp_path), "--steps", "64", "--heads", "2", "--no-plot"]) == 0
    text = capsys.readouterr().out
    payload = json.loads((tmp_path / "drift_bench.json").read_text())
    assert payload["checkpoints"] == [1, 64] and payload["formats"] == list(drift_bench.FORMATS)
    assert payload["A"] == pytest.approx([-0.05, -8.0])
    res = payload["results"]
    assert res["steps"][0] == 1 and res["steps"][-1] == 64
    for regime in drift_bench.REGIMES:
        for f in drift_bench.FORMATS:
            assert len(res[regime][f]["state"]) == len(res["steps"]) and len(res[regime][f]["state"][0]) == 2
        assert max(max(e) for e in res[regime]["fp32"]["state"]) < 1e-6
        assert 1e-4 < res[regime]["bf16 nearest"]["state"][-1][0] < 0.2
    assert "matches step_math" in text and "step 64" in text and "stagnation from a prompt" in text
    assert "int8 + scale" in text and "vs fp32" in text


def test_drift_bench_shows_stagnation_and_its_cure():
    """384 steps, 2 heads: in the stagnation regimes nearest rounding loses the slow head (bf16 and, from a
    prompt's state, the 8-bit formats) and stochastic rounding keeps it; on fresh tokens nearest is the
    better of the two (smaller variance), within a factor of two."""
    res = drift_bench.run(384, 2)
    last = {rg: {f: res[rg][f]["state"][-1][0] for f in drift_bench.FORMATS} for rg in drift_bench.REGIMES}
    assert res["steps"][-1] == 384
    assert last["stagnation"]["bf16 nearest"] > 3 * last["stagnation"]["bf16 stochastic"]
    assert last["stagnation"]["fp16 nearest"] > 3 * last["stagnation"]["fp16 stochastic"]
    prompt = last["stagnation from a prompt"]
    for kind in ("int8+scale", "e4m3+scale"):
        assert prompt[f"{kind} nearest"] > 3 * prompt[f"{kind} stochastic"], kind
    for kind in ("bf16", "fp16", "int8+scale"):
        ratio = last["fresh"][f"{kind} stochastic"] / last["fresh"][f"{kind} nearest"]
        assert 1.0 < ratio < 2.0, (kind, ratio)


def test_drift_bench_float64_step_is_step_math():
    assert drift_bench.check_against_reference(H=2, seed=3) < 1e-12


def test_drift_bench_stores_as_the_rounding_module_does():
    from mamba3_step.rounding import dequantize_rows, quantize_rows, stochastic_round

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 128, generator=g, dtype=torch.float64)
    r = torch.randint(0, 65536, x.shape, generator=g)
    xf = x.float()
    assert torch.equal(drift_bench.store(x, "fp32", r), xf.double())
    assert torch.equal(drift_bench.store(x, "bf16 nearest", r), xf.bfloat16().double())
    assert torch.equal(drift_bench.store(x, "fp16 stochastic", r), stochastic_round(xf, r, torch.float16).double())
    q, s = quantize_rows(xf, r, "int8")
    assert torch.equal(drift_bench.store(x, "int8+scale stochastic", r), dequantize_rows(q, s).double())
    q, s = quantize_rows(xf, torch.full_like(r, 0x8000), "float8_e4m3fn")
    assert torch.equal(drift_bench.store(x, "e4m3+scale nearest", r), dequantize_rows(q, s).double())


def test_drift_bench_flagship_bytes_equal_hand_count():
    """The state is 2 x B x H x D x N x (4, 2 or 1) bytes (read + write); 8-bit adds an fp32 scale per
    (row, head, d), read + written; the rounded formats read the seed and offset (16 bytes); the rest
    of the step is the fp32 flagship's."""
    B, H, D, N = 256, 48, 64, 128
    fp32 = bytes_per_step(flagship_spec(), B, H)["total"]
    state32 = 2 * B * H * D * N * 4
    rows = {r["format"]: r for r in drift_bench.flagship_bytes()}
    assert rows["fp32"]["bytes"] == fp32
    assert rows["bf16"]["bytes"] == rows["fp16"]["bytes"] == fp32 - state32 // 2 + 16
    for name in ("int8 + scale", "e4m3 + scale"):
        assert rows[name]["bytes"] == fp32 - state32 * 3 // 4 + 2 * B * H * D * 4 + 16
        assert rows[name]["scale_mib"] == pytest.approx(6.0)
    assert rows["bf16"]["vs_fp32"] == pytest.approx((fp32 - state32 // 2) / fp32)


def test_drift_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    res = drift_bench.run(8, 2)
    png = tmp_path / "d.png"
    assert drift_bench.plot(res, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_bench_replay_table(tmp_path, capsys):
    """The replay table: stepwise and each K's bytes from bytes_model, plain and T = 4 verify steps."""
    from mamba3_step.tools.bytes_model import bytes_per_step, replay_bytes
    from mamba3_step.spec import flagship_spec
    assert model_bench.main(["--out", str(tmp_path), "--no-plot"]) == 0
    assert "replay, flagship" in capsys.readouterr().out
    rows = json.loads((tmp_path / "model_bench.json").read_text())["replay"]["rows"]
    assert [(r["batch"], r["step"]) for r in rows] == [(b, s) for b in (1, 64, 256) for s in ("plain", "verify T=4")]
    for r in rows:
        spec = flagship_spec() if r["step"] == "plain" else flagship_spec(
            tokens=4, has_dst=True, dst_per_token=True, num_accepted=True)
        assert r["bytes_stepwise"] == bytes_per_step(spec, r["batch"], 48)["total"]
        for K in (2, 4, 8):
            assert r[f"bytes_K{K}"] == pytest.approx(replay_bytes(spec, K, r["batch"], 48)["total"])
    assert rows[-2]["ratio_K4"] < 0.7  # plain decode at B = 256


def _gpu_bench_result(path, suites):
    """A bench/gpu_bench.py result holding ``suites`` ({name: rows}), as the benchmark writes it."""
    path.write_text(json.dumps({"what": "measured", "environment": {"device": "NVIDIA H200", "date_utc": "D"},
                                "suites": {name: {"rows": rows} for name, rows in suites.items()}}))
    return path


#: suite replay at B = 256 (graph times) and at B = 64, with rows at other tilings that stay out
REPLAY_ROWS = [{"batch": 256, "step": "stepwise", "K": None, "outputs": None, "num_warps": None, "min_ctas": None,
                "us_eager": 300.0, "us_graph": 200.0},
               {"batch": 256, "step": "replay K=2", "K": 2, "outputs": "replayed", "num_warps": None, "min_ctas": None,
                "us_eager": 250.0, "us_graph": 180.0},
               {"batch": 256, "step": "replay K=2", "K": 2, "outputs": "from checkpoint", "num_warps": None,
                "min_ctas": None, "us_graph": 230.0},
               {"batch": 256, "step": "replay K=4", "K": 4, "outputs": "replayed", "num_warps": 8, "min_ctas": None,
                "us_graph": 100.0},
               {"batch": 256, "step": "replay K=4", "K": 4, "outputs": "replayed", "num_warps": None, "min_ctas": 3,
                "us_graph": 120.0},
               {"batch": 64, "step": "stepwise", "K": None, "outputs": None, "us_graph": 50.0},
               {"batch": 64, "step": "replay K=8", "K": 8, "outputs": "replayed", "us_graph": 10.0}]
VERIFY_ROWS = [{"batch": 256, "K": None, "from_checkpoint": False, "us_graph": 100.0},
               {"batch": 256, "K": 4, "from_checkpoint": False, "us_graph": 90.0},
               {"batch": 256, "K": 4, "from_checkpoint": True, "us_graph": 60.0},
               {"batch": 256, "K": 8, "from_checkpoint": True, "us_eager": 1.0}]


def test_gpu_results_read_each_suites_graph_times_over_its_stepwise_step(tmp_path):
    """Replay: the default tiling's rows (no warps, no launch bound) at B = 256 over the stepwise row;
    verify: each output form's rows over today's; a suite without graph times or absent gives nothing."""
    result = gpu_results.load(_gpu_bench_result(tmp_path / "r.json", {"replay": REPLAY_ROWS,
                                                                         "replay-verify": VERIFY_ROWS}))
    assert gpu_results.describe(result) == "NVIDIA H200, D"
    assert gpu_results.replay_times(result) == {(2, False): pytest.approx(0.9), (2, True): pytest.approx(1.15)}
    assert gpu_results.replay_times(result, batch=64) == {(8, False): pytest.approx(0.2)}
    assert gpu_results.verify_times(result) == {4: pytest.approx(0.9)}
    assert gpu_results.verify_times(result, from_checkpoint=True) == {4: pytest.approx(0.6)}
    assert gpu_results.states_times(result) == {}
    eager = gpu_results.load(_gpu_bench_result(tmp_path / "e.json", {"replay": [
        {k: v for k, v in r.items() if k != "us_graph"} for r in REPLAY_ROWS]}))
    assert gpu_results.replay_times(eager) == {} and gpu_results.verify_times(eager) == {}


def test_gpu_results_states_times_name_the_issue_model_entries(tmp_path):
    """Suite replay-states: each form's replay rows over its stepwise row, named as REPLAY_STATES_EXECUTED
    names them; rows at a launch bound, at another batch or without graph timing give nothing."""
    rows = [{"form": "rotary", "batch": 256, "step": "stepwise", "outputs": None, "us_eager": 247.8, "us_graph": 200.0},
            {"form": "rotary", "batch": 256, "step": "replay", "outputs": "replayed", "us_graph": 300.0},
            {"form": "rotary", "batch": 256, "step": "replay", "outputs": "from checkpoint", "us_graph": 150.0},
            {"form": "rotary", "batch": 64, "step": "replay", "outputs": "replayed", "us_graph": 90.0},
            {"form": "rotary", "batch": 256, "step": "replay", "outputs": "replayed, 3 CTAs", "us_graph": 240.0},
            {"form": "int8 state", "batch": 256, "step": "stepwise", "outputs": None, "us_eager": 245.2},
            {"form": "int8 state", "batch": 256, "step": "replay", "outputs": "replayed", "us_eager": 464.0}]
    result = gpu_results.load(_gpu_bench_result(tmp_path / "s.json", {"replay-states": rows}))
    got = gpu_results.states_times(result)
    assert got == {"rotary": pytest.approx(1.5), "rotary, from the checkpoint": pytest.approx(0.75)}
    assert set(got) <= set(REPLAY_STATES_EXECUTED)


def test_gpu_results_refuse_a_file_that_is_not_a_result(tmp_path):
    with pytest.raises(ValueError, match="--measured: no such file"):
        gpu_results.load(tmp_path / "absent.json")
    (tmp_path / "old.json").write_text(json.dumps({"rows": VERIFY_ROWS}))
    with pytest.raises(ValueError, match="expected a bench/gpu_bench.py result"):
        gpu_results.load(tmp_path / "old.json")
    (tmp_path / "text.log").write_text("B  step\n")
    with pytest.raises(ValueError, match="is not JSON"):
        gpu_results.load(tmp_path / "text.log")


def test_model_bench_sets_a_measured_result_beside_the_replay_models(tmp_path, capsys):
    """--measured: the replay issue table's 'measured x' is suite replay's ratio for the row's K and
    output form, the verify table's suite replay-verify's; rows the result does not hold stay empty;
    without --measured the column is absent; a file that is not a result is refused (exit 2)."""
    path = _gpu_bench_result(tmp_path / "gpu_bench.json", {"replay": REPLAY_ROWS, "replay-verify": VERIFY_ROWS})
    assert model_bench.main(["--out", str(tmp_path), "--no-plot", "--measured", str(path)]) == 0
    text = capsys.readouterr().out
    assert "measured x: NVIDIA H200, D" in text
    headers = [line for line in text.splitlines() if line.startswith("K ")]  # the two replay issue tables
    assert len(headers) == 2 and all(line.rstrip().endswith("measured x") for line in headers)
    replay = json.loads((tmp_path / "model_bench.json").read_text())["replay"]
    assert replay["measured_on"] == "NVIDIA H200, D"
    assert [(r["K"], r["outputs"], r.get("measured_x")) for r in replay["issue"]] == [
        (2, "replayed (exact)", pytest.approx(0.9)), (4, "replayed (exact)", None), (8, "replayed (exact)", None),
        (2, "from checkpoint", pytest.approx(1.15)), (4, "from checkpoint", None), (8, "from checkpoint", None)]
    assert [(r["K"], r["outputs"], r.get("measured_x")) for r in replay["verify_issue"]] == [
        (K, form, pytest.approx(x) if x else None) for form, xs in
        (("replayed", {4: 0.9}), ("from the checkpoint", {4: 0.6})) for K in (2, 4, 8) for x in [xs.get(K)]]
    assert model_bench.main(["--out", str(tmp_path / "plain"), "--no-plot"]) == 0
    text = capsys.readouterr().out
    headers = [line for line in text.splitlines() if line.startswith("K ")]
    assert len(headers) == 2 and not any("measured x" in line for line in headers) and "measured x:" not in text
    plain = json.loads((tmp_path / "plain" / "model_bench.json").read_text())["replay"]
    assert not any("measured_x" in r for r in plain["issue"] + plain["verify_issue"])
    with pytest.raises(SystemExit) as exc:
        model_bench.main(["--out", str(tmp_path), "--no-plot", "--measured", str(tmp_path / "absent.json")])
    assert exc.value.code == 2 and "--measured: no such file" in capsys.readouterr().err


def test_issue_model_takes_a_measured_result_only_beside_its_replay_states_table(tmp_path, capsys):
    """bench/issue_model.py --measured: refused without --replay-states (the table it goes beside) and for
    a file that is not a bench/gpu_bench.py result, both before anything compiles (exit 2)."""
    issue_model = _load("issue_model")
    path = _gpu_bench_result(tmp_path / "gpu_bench.json", {"replay-states": []})
    with pytest.raises(SystemExit) as exc:
        issue_model.main(["--measured", str(path), "--out", str(tmp_path)])
    assert exc.value.code == 2 and "give --replay-states" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        issue_model.main(["--replay-states", "--measured", str(tmp_path / "absent.json"), "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--measured: no such file" in capsys.readouterr().err
    assert not (tmp_path / "issue_model.json").exists()


def test_gpu_bench_async_copy_check_runs_the_asynchronous_state_copy_beside_pool_mode(monkeypatch):
    """--async-copy's check: pool mode through the asynchronous state copy must write pool mode's bits;
    a copy that writes other bits is reported. On CPU tensors both kernels' PTX, executed (pool mode's
    through ptx_step_fn, as a GPU runs the register kernel)."""
    from mamba3_step.tools.ptx_tier import ptx_step_fn

    check = functools.partial(step_checks.check_batch, flagship_spec(), 2, 1, torch.device("cpu"), ptx_step_fn,
                              async_copy=True)
    assert check() == []
    real = step_checks.async_copy_step_fn

    def off_by_one_ulp(*args, **kwargs):
        out = real(*args, **kwargs)
        out.view(torch.int16)[0, 0, 0] += 1
        return out

    monkeypatch.setattr(step_checks, "async_copy_step_fn", off_by_one_ulp)
    failures = check()
    assert failures == ["B=2: the asynchronous state copy's out differs from pool mode's"]


#: a stand-in for a state-spaces/mamba checkout: its dense step is this project's CPU path, called as
#: upstream's Mamba3.step calls upstream's (positional tensors, then keywords and its tiling)
STUB_UPSTREAM = """
from mamba3_step import mamba3_step_fn as ours

CALLS = []


def mamba3_step_fn(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj=None, state_out=None, out=None,
                   z=None, zproj=None, tile_D=64, num_warps=2):
    CALLS.append((tuple(state.shape), tile_D, num_warps))
    ours(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, state_out, out, z, zproj)
"""


def _stub_checkout(root, text=STUB_UPSTREAM):
    from gpu_suites.upstream import UPSTREAM_FILE

    path = root / UPSTREAM_FILE
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return root


def test_gpu_bench_upstream_peer_is_loaded_from_the_checkout_checked_and_timed(tmp_path, capsys):
    """--upstream PATH: upstream's dense step loaded from the checkout's file, run as a server runs it
    (gather, the dense step in place, scatter, B/x stored), checked, then timed with gather/scatter's bytes."""
    checkout = _stub_checkout(tmp_path / "mamba")
    assert gpu_bench.main(CPU_ARGS + ["--upstream", str(checkout), "--out", str(tmp_path / "out")]) == 0
    assert "upstream dense, gathered/scattered" in capsys.readouterr().out
    rows = [r for r in _suite_result(tmp_path / "out", "step")["rows"] if r["mode"] == "upstream"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["us"] > 0 for r in rows)
    assert all(r["bytes"] == bytes_per_step(flagship_spec(), r["batch"], 1, mode="gather_scatter")["total"]
               for r in rows)
    calls = sys.modules["upstream_mamba3_step_fn"].CALLS
    assert calls and all(shape[1:] == (1, 64, 128) and (tD, w) == (64, 4) for shape, tD, w in calls)


@pytest.mark.parametrize("what", ["missing", "no_function", "import"])
def test_gpu_bench_upstream_refuses_a_checkout_it_cannot_use(what, tmp_path, capsys):
    if what == "missing":
        checkout, message = tmp_path / "nothing", "expected a state-spaces/mamba checkout holding"
    else:
        text = "import quack_is_not_installed_here\n" if what == "import" else "x = 1\n"
        checkout = _stub_checkout(tmp_path / "mamba", text)
        message = "needs quack_is_not_installed_here" if what == "import" else "defines no mamba3_step_fn"
    with pytest.raises(SystemExit):
        gpu_bench.main(CPU_ARGS + ["--upstream", str(checkout), "--out", str(tmp_path / "out")])
    assert message in capsys.readouterr().err


def test_the_upstream_check_fails_on_a_peer_that_computes_something_else(tmp_path):
    wrong = STUB_UPSTREAM.replace("    ours(state,", "    dt = dt * 1.01\n    ours(state,")
    from gpu_suites.upstream import load_upstream_step

    sys.modules.pop("upstream_mamba3_step_fn", None)
    fn = load_upstream_step(str(_stub_checkout(tmp_path / "mamba", wrong)))
    failures = step_checks.check_batch(flagship_spec(), 2, 1, torch.device("cpu"), upstream_fn=fn)
    assert failures and all(f.startswith("B=2: upstream's") for f in failures), failures


def test_a_peer_that_fails_its_check_is_not_timed_and_does_not_stop_this_projects_modes(tmp_path, capsys):
    """The peer is not this project's code: a wrong or crashing upstream step is reported and left out,
    pool mode and the others are still checked and timed (exit 0)."""
    crashing = STUB_UPSTREAM.replace("    ours(state,", "    raise RuntimeError('no kernel for this GPU')\n    ours(state,")
    for text, finding in ((STUB_UPSTREAM.replace("    ours(state,", "    dt = dt * 1.01\n    ours(state,"),
                           "B=1: upstream's "), (crashing, "B=1: upstream's step raised RuntimeError")):
        sys.modules.pop("upstream_mamba3_step_fn", None)
        root = tmp_path / f"m{len(finding)}"
        assert gpu_bench.main(CPU_ARGS + ["--upstream", str(_stub_checkout(root / "mamba", text)),
                                          "--out", str(root / "out")]) == 0
        printed = capsys.readouterr().out
        assert "PEER NOT TIMED" in printed and finding in printed and "not timed, it failed its check" in printed
        result = _suite_result(root / "out", "step")
        assert {r["mode"] for r in result["rows"]} == {"pool", "gather_scatter", "dense"}
        assert result["upstream_not_timed"] and result["upstream_not_timed"][0].startswith(finding)


def test_gpu_bench_launch_bounds_check_pool_modes_kernels_under_each_bound():
    """--min-ctas in suite step: the register kernel and (with --async-copy) the copy at each launch bound,
    each checked bit for bit against pool mode (on CPU tensors every kernel's PTX, executed), then timed
    as modes labelled with their bound."""
    from gpu_suites import step as step_suite
    from mamba3_step.tools.ptx_tier import ptx_step_fn

    assert list(step_checks.kernel_variants(True, (4,))) == ["pool_async_copy", "pool_bound4", "pool_async_copy_bound4"]
    assert list(step_checks.kernel_variants(False, (4, 5))) == ["pool_bound4", "pool_bound5"]
    assert step_suite.mode_label("pool_async_copy_bound5") == "pool, asynchronous state copy, launch bound 5"
    assert step_checks.check_batch(flagship_spec(), 1, 1, torch.device("cpu"), ptx_step_fn, bounds=(4,)) == []


def test_gpu_bench_load_layouts_check_each_variant_against_pool_mode(monkeypatch):
    """--unpinned-loads and --late-epilogue: pool mode through the register kernel with its loads in the
    compiler's order, and with that its epilogue's operands loaded after the update, checked bit for bit
    against pool mode (PTX executed on CPU tensors); a variant writing other bits is reported by name."""
    from gpu_suites import step as step_suite
    from mamba3_step.tools.ptx_tier import ptx_step_fn

    layouts = ("unpinned_loads", "late_epilogue")
    assert list(step_checks.kernel_variants(False, (), layouts)) == ["pool_unpinned_loads", "pool_late_epilogue"]
    assert step_suite.mode_label("pool_late_epilogue") == "pool, epilogue loaded late"
    assert step_suite.mode_label("pool_unpinned_loads") == "pool, loads unpinned"
    parser = argparse.ArgumentParser()
    step_suite.add_arguments(parser)
    args = parser.parse_args(["--late-epilogue", "--unpinned-loads"])
    assert tuple(layout for layout in step_checks.LAYOUTS if getattr(args, layout)) == layouts
    from mamba3_step.tools import ptx_tier
    launched = []
    real_run = ptx_tier.run_step_ptx

    def record(spec, *a, **kw):  # the layout fields of each variant's kernel
        launched.append((spec.unpinned_loads, spec.late_epilogue))
        return real_run(spec, *a, **kw)

    monkeypatch.setattr(ptx_tier, "run_step_ptx", record)
    check = functools.partial(step_checks.check_batch, flagship_spec(), 1, 1, torch.device("cpu"), ptx_step_fn,
                              layouts=layouts)
    assert check() == []
    assert [f for f in launched if f != (False, False)] == [(True, False), (True, True)]  # pool mode: (False, False)
    real = step_checks.variant_step_fn

    def corrupted(**kw):
        fn = real(**kw)

        def step(*args, **kwargs):
            out = fn(*args, **kwargs)
            out.view(torch.int16)[0, 0, 0] += 1
            return out
        return step

    monkeypatch.setattr(step_checks, "variant_step_fn", corrupted)
    assert check() == ["B=1: the loads unpinned's out differs from pool mode's",
                       "B=1: the late epilogue's out differs from pool mode's"]


def test_gpu_bench_slab_pipeline_is_checked_against_pool_mode(monkeypatch):
    """--pipeline-per-sm: pool mode through the slab pipeline, one variant per CTA count, checked bit for bit
    against pool mode (PTX executed on CPU tensors: fewer CTAs than slabs, so each walks several) and labelled
    with its CTAs."""
    from gpu_suites import step as step_suite
    from mamba3_step.tools import ptx_tier
    from mamba3_step.tools.ptx_tier import ptx_step_fn

    assert list(step_checks.kernel_variants(False, (), (), (264, 396))) == ["pool_pipeline264", "pool_pipeline396"]
    assert step_suite.mode_label("pool_pipeline264") == "pool, slab pipeline, 264 CTAs"
    launched = []
    real_run = ptx_tier.run_step_ptx

    def record(spec, *a, **kw):
        launched.append(spec.pipeline_ctas)
        return real_run(spec, *a, **kw)

    monkeypatch.setattr(ptx_tier, "run_step_ptx", record)
    assert step_checks.check_batch(flagship_spec(), 3, 2, torch.device("cpu"), ptx_step_fn, pipelines=(4,)) == []
    assert 4 in launched and 0 in launched


def test_gpu_bench_small_batch_forms_are_checked_against_pool_mode(monkeypatch):
    """--small-batch: pool mode through the D split over a cluster (tile_D 32, 16) and programmatic launch, alone
    and with each split, checked bit for bit against pool mode (PTX executed on CPU tensors) and labelled."""
    from gpu_suites import step as step_suite
    from mamba3_step.tools import ptx_tier
    from mamba3_step.tools.ptx_tier import ptx_step_fn

    forms = tuple(step_checks.SMALL_BATCH_FORMS)
    assert list(step_checks.kernel_variants(False, (), forms)) == [f"pool_{f}" for f in forms]
    assert list(step_checks.kernel_variants(False, (), forms, (396,)))[:2] == ["pool_pipeline396",
                                                                             "pool_pipeline396_programmatic"]
    assert step_suite.mode_label("pool_split4_programmatic") == "pool, the D split over 4 CTAs, programmatic launch"
    assert step_suite.mode_label("pool_pipeline396_programmatic") == "pool, slab pipeline, 396 CTAs, programmatic launch"
    launched = []
    real_run = ptx_tier.run_step_ptx

    def record(spec, *a, **kw):
        launched.append((spec.tile_D, spec.programmatic_launch))
        return real_run(spec, *a, **kw)

    monkeypatch.setattr(ptx_tier, "run_step_ptx", record)
    assert step_checks.check_batch(flagship_spec(), 2, 2, torch.device("cpu"), ptx_step_fn, layouts=forms) == []
    assert {(32, False), (16, False), (64, True), (32, True), (16, True)} <= set(launched)


@pytest.mark.parametrize("flag", [["--async-copy"], ["--min-ctas", "4"], ["--unpinned-loads"], ["--late-epilogue"],
                                  ["--pipeline-per-sm", "2"], ["--small-batch"]])
def test_gpu_bench_refuses_kernel_variants_on_the_cpu_path(flag, capsys):
    """A kernel variant is checked bit for bit against pool mode; on --device cpu pool mode runs the PyTorch path,
    which no kernel matches bit for bit: refused by name before anything runs, not reported as a failed check."""
    with pytest.raises(SystemExit) as exc:
        gpu_bench.main(CPU_ARGS + flag)
    assert exc.value.code == 2
    assert "run them on a CUDA device" in capsys.readouterr().err
