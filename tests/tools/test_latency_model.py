"""The latency model (mamba3_step.tools.latency_model): the SASS round-trip analysis on a synthetic listing
whose answer is known and on the compiled flagship, and the model's arithmetic on figures checked by
hand. Everything it computes is modelled; the measured table the bench compares with is written here."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest

from mamba3_step.tools import latency_model as lm
from mamba3_step.tools.bytes_model import bytes_per_step
from mamba3_step.tools.issue_model import GPUS, ISSUED_SASS, PIPELINE_EXECUTED, REPLAY_EXECUTED
from mamba3_step.spec import flagship_spec

# A live CTA: the index load, the padding branch, three loads addressed by the index (a 16-byte, an
# 8-byte through a 64-bit address pair, a 2-byte), a use of the 16-byte load's last register (closes
# trip 2), a load whose address needs the 8-byte load's value (dependence depth 3), an LDGSTS waited
# by DEPBAR, a predicated load closed by a WAW overwrite of its register, and the padding path after
# the unconditional EXIT (its load is not on the live path).
SYNTHETIC = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   IMAD.WIDE.U32 R2, R0, 0x4, R2 ;
        /*0020*/                   LDG.E R5, desc[UR4][R2.64] ;
        /*0030*/                   ISETP.GE.AND P0, PT, R5, UR6, PT ;
        /*0040*/               @P0 BRA `(.L_x_0) ;
        /*0050*/                   IMAD.WIDE R8, R0, 0x10, R2 ;
        /*0060*/                   LDG.E.128 R12, desc[UR4][R8.64] ;
        /*0070*/                   LDG.E.64 R16, desc[UR4][R8.64+0x10] ;
        /*0080*/                   LDG.E.U16 R18, desc[UR4][R8.64+0x20] ;
        /*0090*/                   FADD R20, R15, R15 ;
        /*00a0*/                   IADD3 R22, P1, R16, R8, RZ ;
        /*00b0*/                   IADD3.X R23, RZ, R17, RZ, P1, !PT ;
        /*00c0*/                   LDG.E R24, desc[UR4][R22.64] ;
        /*00d0*/                   LDGSTS.E.BYPASS.128 [R0+UR5], desc[UR4][R8.64+0x40] ;
        /*00e0*/                   LDGDEPBAR ;
        /*00f0*/                   DEPBAR.LE SB0, 0x0 ;
        /*0100*/               @P1 LDG.E R26, desc[UR4][R8.64+0x80] ;
        /*0110*/                   MOV R26, R24 ;
        /*0120*/                   STG.E.128 desc[UR4][R8.64], R12 ;
        /*0130*/                   EXIT ;
.L_x_0:
        /*0140*/                   LDG.E R30, desc[UR4][R2.64] ;
        /*0150*/                   EXIT ;
"""


def test_round_trips_of_a_synthetic_listing():
    t = lm.global_round_trips(SYNTHETIC)
    assert [tr["loads"] for tr in t.trips] == [1, 3, 2, 1]
    assert [tr["bytes_per_thread"] for tr in t.trips] == [4, 16 + 8 + 2, 4 + 16, 4]
    assert t.trips[1]["by_width"] == {16: 1, 8: 1, 2: 1}
    assert "FADD R20, R15, R15" in t.trips[1]["waited_at"]  # R15: the 16-byte load's 4th register
    assert "DEPBAR" in t.trips[2]["waited_at"]  # the LDGSTS (and R24's load beside it)
    assert "MOV R26, R24" in t.trips[3]["waited_at"]  # a write to a pending register waits too
    assert t.round_trips == 4 and t.dependence_depth == 3
    # R24's address derives from R16:R17, and the predicated load's guard P1 from the same sum
    assert [d for *_, d in t.loads] == [1, 2, 2, 2, 3, 2, 3]
    assert t.bytes_before_first_wait(32) == 26 * 32  # the largest trip after the index's
    assert len(t.loads) == 7  # the padding path's load is not on the live path


def test_register_operands_are_read_at_their_widths():
    ins = {}
    for i in lm.sass_instructions(SYNTHETIC):
        ins.setdefault(i.base, i)  # the first of each opcode
    assert ins["STG"].reads == {"R8", "R9", "R12", "R13", "R14", "R15", "UR4"} and not ins["STG"].writes
    assert ins["LDG"].writes == {"R5"} and ins["ISETP"].pred_writes == {"P0"}
    assert ins["ISETP"].reads == {"R5", "UR6"}
    assert ins["IMAD"].writes == {"R2", "R3"} and ins["IMAD"].reads == {"R0", "R2", "R3"}  # .WIDE: 64-bit pairs
    assert ins["IADD3"].pred_writes == {"P1"} and ins["BRA"].pred_reads == {"P0"}


# Uniform registers and predicates carry dependences and are not the general ones of the same number:
# the index reaches a load's address through UR8 and a branch through UP0, while P0 (written after UP0
# from a thread index) guards a load of depth 1.
UNIFORM = """
        /*0000*/                   LDG.E R5, desc[UR4][R2.64] ;
        /*0010*/                   R2UR UR8, R5 ;
        /*0020*/                   UISETP.NE.AND UP0, UPT, UR8, URZ, UPT ;
        /*0030*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;
        /*0040*/               @P0 LDG.E R7, desc[UR4][R2.64+0x4] ;
        /*0050*/                   LDG.E R9, desc[UR4][R2.64+UR8] ;
        /*0060*/                   BRA.U !UP0, `(.L_x_1) ;
        /*0070*/                   LDG.E R11, desc[UR4][R2.64+0x8] ;
        /*0080*/                   EXIT ;
.L_x_1:
        /*0090*/                   EXIT ;
"""


def test_uniform_registers_and_predicates_carry_their_own_dependences():
    t = lm.global_round_trips(UNIFORM)
    assert [tr["loads"] for tr in t.trips] == [1, 3] and t.trips[1]["waited_at"] is None
    assert "R2UR UR8, R5" in t.trips[0]["waited_at"]
    assert [d for *_, d in t.loads] == [1, 1, 2, 2] and t.dependence_depth == 2


def test_an_unconditional_branch_free_listing_without_loads_has_no_trips():
    t = lm.global_round_trips("        /*0000*/                   MOV R1, R2 ;\n        /*0010*/   EXIT ;\n")
    assert t.round_trips == 0 and t.dependence_depth == 0


def _compiles():
    try:
        from mamba3_step.tools.inspection import find_nvdisasm
        import mamba3_step.kernel
    except Exception:
        return False
    return find_nvdisasm() is not None and hasattr(mamba3_step.kernel, "compile_step_kernel")


#: the flagship's 16-byte state loads per round trip, read from its SASS (the index; then all of them, with the
#: staging loads and the epilogue's operands)
FLAGSHIP_STATE_LOADS = {"sm_90a": [0, 16], "sm_100a": [0, 16]}


@pytest.mark.skipif(not _compiles(), reason="kernel or nvdisasm unavailable")
@pytest.mark.parametrize("arch", sorted(FLAGSHIP_STATE_LOADS))
def test_flagship_round_trips_read_from_the_sass(arch):
    """The budget: today's flagship makes FLAGSHIP_TRIPS = 2 dependent round trips, the fewest its loads' own
    dependences allow (the index, then everything else); 3 CTAs per SM."""
    from mamba3_step.tools.inspection import kernel_facts
    from mamba3_step.kernel import compile_step_kernel
    f = kernel_facts(compile_step_kernel(flagship_spec(), arch))
    t = lm.global_round_trips(f.sass_text)
    assert t.round_trips == lm.FLAGSHIP_TRIPS == 2 == t.dependence_depth
    assert [tr["by_width"].get(16, 0) for tr in t.trips] == FLAGSHIP_STATE_LOADS[arch]
    assert t.trips[0]["loads"] == 1 and t.trips[0]["by_width"] == {4: 1}  # the index alone
    assert (t.round_trips, f.occupancy()["ctas_per_sm"]) == lm.KERNEL_LATENCY_FACTS["fp32"] == (2, 3)
    # the peak in flight: every load after the index's, 318 bytes a thread (256 of them the state's)
    assert t.bytes_before_first_wait(f.threads) == 128 * 318


def test_littles_law_by_hand():
    r = lm.bytes_in_flight_needed("H200", latency_s=1e-6, copy_bandwidth=4.0e12)
    assert r["bytes_per_sm"] == pytest.approx(4.0e12 * 1e-6 / 132) and r["bytes_total"] == pytest.approx(4.0e6)
    b200 = lm.bytes_in_flight_needed("B200")
    assert b200["bytes_per_sm"] == pytest.approx(0.88 * 8.0e12 * lm.assumption("loaded_latency_s") / 148)


def test_mean_value_analysis_by_hand():
    # one customer: a cycle is every demand plus the delay
    assert lm.mean_value_analysis(1, [1.0, 2.0], 3.0) == pytest.approx((1 / 6, 6.0))
    # two: residence = demand x (1 + the one customer's backlog): 1 x 7/6, 2 x 4/3; cycle 41/6
    assert lm.mean_value_analysis(2, [1.0, 2.0], 3.0) == pytest.approx((12 / 41, 41 / 6))
    # many customers saturate the largest demand
    assert lm.mean_value_analysis(200, [1.0, 2.0], 3.0)[0] == pytest.approx(0.5, rel=1e-3)
    with pytest.raises(ValueError, match="customers"):
        lm.mean_value_analysis(0, [1.0], 0.0)


def _today(batch):
    spec = flagship_spec()
    total = bytes_per_step(spec, batch, 48)["total"]
    return lm.flagship_designs(spec, 6000, total / (batch * 48), 32768)["today"], total


def test_step_time_by_hand_at_a_large_and_a_small_batch():
    gpu, bw = GPUS["H200"], 4.0e12
    for batch, active, per_sm in ((256, 132, math.ceil(256 * 48 / 132)), (1, 48, 1)):
        design, total = _today(batch)
        share = min(bw / active, lm.assumption("sm_port_bytes_per_s"))
        issue = 6000 / (4 * gpu.clock_hz)
        delay = lm.FLAGSHIP_TRIPS * 0.5e-6 + 6000 / 4 * 0.5 / gpu.clock_hz
        rate, _ = lm.mean_value_analysis(min(3, per_sm), [issue, total / (batch * 48) / share], delay)
        m = lm.percent_of_copy(design, batch, 48, "H200", total, bw, idle_latency_s=0.5e-6, launch_s=2e-6)
        assert m["seconds"] == pytest.approx(per_sm / rate + 2e-6) and m["per_sm"] == per_sm
        assert m["percent"] == pytest.approx(100 * total / m["seconds"] / bw)


def test_small_batch_path_splits_d_below_two_waves_of_slabs():
    spec = flagship_spec()
    d = lm.flagship_designs(spec, 6000, 70000, 32768)["small-batch path"]
    assert [lm.step_time(d, b, 48, "H200")["split"] for b in (1, 2, 4, 64)] == [4, 2, 1, 1]
    assert lm.step_time(d, 1, 48, "H200")["ctas"] == 192


def test_the_built_d_split_takes_its_fastest_tile_and_programmatic_launch_hides_the_gap_and_a_trip():
    """The D split over a cluster (split facts invented here: 2 CTAs a slab at 60% of its instructions, 2 trips,
    4 CTAs per SM): at each batch the fastest of today's kernel and the splits whose grid fits 2 x SMs, so never
    slower than today, and today's kernel from 2 x SMs slabs up; launched programmatically the same CTAs less the
    launch gap and one idle round trip, exactly."""
    spec, inputs = flagship_spec(), dict(idle_latency_s=0.5e-6, launch_s=2e-6)
    facts = ((2, 0.6, 2, 4), (4, 0.4, 4, 6))
    for batch in (1, 2, 4, 8, 64):
        ds = lm.flagship_designs(spec, 6000, 70000, 32768, split=facts, programmatic=True)
        t = {k: lm.step_time(d, batch, 48, "H200", **inputs) for k, d in ds.items()}
        assert t["D split (cluster)"]["seconds"] <= t["today"]["seconds"]
        if batch * 48 * 2 > 2 * GPUS["H200"].sms:
            assert t["D split (cluster)"]["seconds"] == t["today"]["seconds"] and t["D split (cluster)"]["split"] == 1
        for base in ("today", "D split"):
            plain = t["today" if base == "today" else "D split (cluster)"]["seconds"]
            assert t[f"{base}, programmatic launch"]["seconds"] == pytest.approx(plain - 2e-6 - 0.5e-6)
    one = lm.step_time(lm.flagship_designs(spec, 6000, 70000, 32768, split=facts)["D split (cluster)"], 1, 48, "H200")
    assert one["split"] == 2  # 4 trips at 4 CTAs a slab cost more than the smaller grid's
    piped = lm.flagship_designs(spec, 6000, 70000, 32768, slab_pipeline=(1, 3), programmatic=True)
    for batch in (1, 64):
        t = [lm.step_time(piped[k], batch, 48, "H200", **inputs)["seconds"]
             for k in ("slab pipeline", "slab pipeline, programmatic launch")]
        assert t[1] == pytest.approx(t[0] - 2e-6 - 0.5e-6)


def test_designs_rank_as_the_model_says_from_b64():
    """Fewer round trips and more bytes in flight are never slower in the model (fp32 flagship, H200); today's
    kernel is the one-round-trip design, the unpinned kernel's three trips are slower."""
    spec = flagship_spec()
    for batch in (64, 512):
        total = bytes_per_step(spec, batch, 48)["total"]
        ds = lm.flagship_designs(spec, REPLAY_EXECUTED["stepwise"], total / (batch * 48), 32768)
        unpinned = lm.flagship_designs(spec, REPLAY_EXECUTED["stepwise"], total / (batch * 48), 32768,
                                       *lm.UNPINNED_LATENCY_FACTS["sm_90a"]["fp32"])["today"]
        t = {k: lm.step_time(d, batch, 48, "H200")["seconds"] for k, d in ds.items()}
        assert t["pipeline"] < t["one round trip"] == t["today"] < lm.step_time(unpinned, batch, 48, "H200")["seconds"]


def test_refused_inputs():
    d, _ = _today(8)
    with pytest.raises(ValueError, match="inputs must be among"):
        lm.step_time(d, 8, 48, "H200", idle_latency=1e-6)
    with pytest.raises(ValueError, match="batch and heads"):
        lm.step_time(d, 0, 48, "H200")
    with pytest.raises(ValueError, match="gpu_name must be one of"):
        lm.step_time(d, 8, 48, "A100")
    with pytest.raises(ValueError, match="copy_bandwidth positive"):
        lm.step_time(d, 8, 48, "H200", 0.0)


def _bench():
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location("bench_latency_model", os.path.join(bench, "latency_model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_prints_the_model_beside_a_measured_table(tmp_path, capsys):
    """The measured column comes from the file given; the model uses that run's copy bandwidth."""
    total = bytes_per_step(flagship_spec(), 64, 48)["total"]
    table = {"copy_bandwidth_bytes_per_s": 4.0e12,
             "table": [{"mode": "pool", "batch": 64, "us_graph": 100.0},
                       {"mode": "dense", "batch": 64, "us_graph": 1.0}]}
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps(table))
    assert _bench().main(["--no-compile", "--measured", str(path), "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "latency_model.json").read_text())
    (row,) = payload["measured"]
    assert row["measured us"] == 100.0 and row["measured % copy"] == pytest.approx(100 * total / 100e-6 / 4.0e12)
    design, _ = _today(64)
    # the model counts the SASS a slab issues (the late layout issues the pinned kernel's arithmetic)
    model = lm.step_time(lm.Design("today", 4, ISSUED_SASS["fp32"]["registers"], design.bytes_per_slab), 64, 48, "H200",
                         4.0e12)
    assert row["modelled us"] == pytest.approx(model["seconds"] * 1e6)
    assert {r["state"] for r in payload["designs"]} >= {"fp32", "bf16, stochastic rounding", "fp32 replay F = 4"}
    assert "modelled" in capsys.readouterr().out


def test_bench_reads_a_step_suite_result_with_both_kernels_and_the_measured_stalls(tmp_path):
    """gpu_bench's own JSON (suites -> step): pool mode is the register kernel ("today", its loads pinned), the
    asynchronous state copy its design, each of the run's state dtype; with Nsight Compute's stalls the model is
    rerun."""
    spec = flagship_spec(state_dtype="bfloat16")
    result = {"copy_bandwidth_bytes_per_s": 4.2e12, "spec": spec.as_dict(),
              "table": [{"mode": "pool", "batch": 256, "us_graph": 210.0},
                        {"mode": "pool_async_copy", "batch": 256, "us_graph": 213.0},
                        {"mode": "upstream", "batch": 256, "us_graph": 560.0}]}
    path = tmp_path / "gpu_bench.json"
    path.write_text(json.dumps({"environment": {}, "suites": {"step": result}}))
    assert _bench().main(["--no-compile", "--measured", str(path), "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "latency_model.json").read_text())["measured"]
    assert [(r["kernel"], r["state"]) for r in rows] == [("async", "bf16, round to nearest"),
                                                         ("pinned", "bf16, round to nearest")]
    total = bytes_per_step(spec, 256, 48)["total"]
    for r, us in zip(rows, (213.0, 210.0)):
        assert r["measured % copy"] == pytest.approx(100 * total / (us * 1e-6) / 4.2e12)
        # more stall cycles per instruction than the assumed 0.5: the model predicts less
        assert r["modelled % copy, measured stalls"] < r["modelled % copy"]
    trips, ctas = lm.ASYNC_LATENCY_FACTS["sm_90a"]["bf16, round to nearest"]
    design = lm.Design("asynchronous state copy", trips, ISSUED_SASS["bf16, round to nearest"]["async"],
                       total / (256 * 48), ctas_per_sm=ctas)
    assert rows[0]["modelled us"] == pytest.approx(lm.step_time(design, 256, 48, "H200", 4.2e12)["seconds"] * 1e6)


def test_bench_refuses_a_measured_file_it_cannot_read(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"suites": {"replay": {}}}))
    for path, message in ((tmp_path / "absent.json", "no such file"), (bad, "expected a bench/gpu_bench.py JSON")):
        with pytest.raises(SystemExit) as exc:
            _bench().main(["--no-compile", "--measured", str(path), "--out", str(tmp_path)])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_pool_mode_is_named_by_the_fields_of_its_runs_spec(tmp_path):
    """A run from before the loads were pinned (its spec has late_epilogue, not unpinned_loads) timed the early
    epilogue unpinned: modelled at its three round trips; one from before that (neither field), the late
    epilogue at four; the variants of a current run by their modes."""
    spec = flagship_spec().as_dict()
    older = {k: v for k, v in spec.items() if k != "unpinned_loads"}
    oldest = {k: v for k, v in older.items() if k != "late_epilogue"}
    bench = _bench()
    assert [bench.pool_kernel(s) for s in (spec, older, oldest)] == ["pinned", "unpinned", "late epilogue"]
    rows = {}
    for name, s, modes in (("now", spec, ("pool", "pool_unpinned_loads", "pool_late_epilogue")), ("older", older, ("pool",))):
        result = {"copy_bandwidth_bytes_per_s": 4.2e12, "spec": s,
                  "table": [{"mode": mode, "batch": 256, "us_graph": 250.0} for mode in modes]}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(result))
        assert bench.main(["--no-compile", "--measured", str(path), "--out", str(tmp_path)]) == 0
        rows[name] = {r["kernel"]: r for r in json.loads((tmp_path / "latency_model.json").read_text())["measured"]}
    assert set(rows["now"]) == {"pinned", "unpinned", "late epilogue"} and set(rows["older"]) == {"unpinned"}
    assert rows["older"]["unpinned"]["modelled us"] == rows["now"]["unpinned"]["modelled us"]
    us = [rows["now"][k]["modelled us"] for k in ("pinned", "unpinned", "late epilogue")]
    assert us == sorted(us) and len(set(us)) == 3  # each trip more, a longer step
    # the unpinned kernel takes the late epilogue's measured stalls: its code less one barrier
    assert (rows["now"]["unpinned"]["modelled % copy, measured stalls"]
            != rows["now"]["unpinned"]["modelled % copy"])


def test_measured_stalls_are_recomputed_from_the_raw_logs():
    """MEASURED_OWN_STALLS is own_stalls of the committed Nsight Compute raw pages, kernel by kernel in the
    order profiled."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "measured")
    logs = {("2026-11-28-h200-pinned", "float32"): ["pinned"], ("2026-11-28-h200-pinned", "bfloat16"): ["pinned"],
            ("2026-11-28-h200-async", "float32"): ["late epilogue", "async"],
            ("2026-11-28-h200-async", "bfloat16"): ["late epilogue", "async"]}
    forms = {"float32": "fp32", "bfloat16": "bf16, round to nearest"}
    seen = {}
    for (folder, dtype), kernels in logs.items():
        with open(os.path.join(root, folder, f"ncu_raw_{dtype}.log")) as f:
            values = lm.own_stalls(f.read())
        assert len(values) == len(kernels), (folder, dtype, values)
        seen |= {(forms[dtype], k): v for k, v in zip(kernels, values)}
    assert seen == lm.MEASURED_OWN_STALLS
    synthetic = "\n".join(f"  smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio  inst  {v}" for r, v in (
        ("barrier", 0.5), ("long_scoreboard", 4.0), ("short_scoreboard", 0.25), ("selected", 1), ("wait", "1.00")))
    assert lm.own_stalls(synthetic + "\n" + synthetic) == [1.25, 1.25]


def test_the_model_predicts_the_goals_for_the_built_kernels():
    """Modelled on the H200 from the stated facts (no compile): the slab pipeline launched programmatically at
    >= 92% of copy from B = 64 for fp32 and bf16 rounded to nearest and >= 85% with stochastic rounding (its SASS
    per slab under the memory time), and the D split launched programmatically <= 2.5 us at B = 1, each form.
    With the executed PTX counts instead of the SASS the stochastic form would fall short (the issue side
    would count instructions ptxas fuses)."""
    bench = _bench()
    rows = {(r["state"], r["design"]): r for r in bench.design_rows("H200", bench.kernel_latency_facts(False), None, {})}
    goals = {"fp32": 92, "bf16, round to nearest": 92, "bf16, stochastic rounding": 85}
    for form, goal in goals.items():
        piped = rows[(form, "slab pipeline, programmatic launch")]
        assert min(piped[f"B{b}"] for b in (64, 256, 512)) >= goal, (form, piped)
        assert piped["issue/memory"] < 1, (form, piped)
        assert rows[(form, "D split, programmatic launch")]["us_B1"] <= 2.5, form
    spec = flagship_spec(state_dtype="bfloat16", stochastic_rounding=True)
    total = bytes_per_step(spec, 64, 48)["total"]
    as_ptx = lm.flagship_designs(spec, PIPELINE_EXECUTED["bf16, stochastic rounding"], total / (64 * 48), 16384, slab_pipeline=(1, 3),
                                 programmatic=True)["slab pipeline, programmatic launch"]
    assert lm.percent_of_copy(as_ptx, 64, 48, "H200", total)["percent"] < 85


def test_the_verify_forms_are_re_costed_on_the_built_kernels():
    """The T = 4 verify step and replay's verify step at F = 2 and 4 have the model's rows (stated facts, H200): the
    verify step on the slab pipeline is modelled faster than on the register kernel from B = 64 (one CTA an SM
    either way, its state in flight a slab ahead), and replay's verify kernel is issue-bound on every design."""
    bench = _bench()
    rows = {(r["state"], r["design"]): r for r in bench.design_rows("H200", bench.kernel_latency_facts(False), None, {})}
    verify = {d: r for (form, d), r in rows.items() if form == bench.VERIFY_FORM}
    assert set(verify) == {"today", "one round trip", "small-batch path", "pipeline", "slab pipeline"}
    assert verify["today"]["trips"] == 10 and verify["slab pipeline"]["CTAs/SM"] == 1
    for b in (64, 256, 512):
        assert verify["slab pipeline"][f"us_B{b}"] < verify["today"][f"us_B{b}"], b
    for K in (2, 4):
        replayed = [r for (form, _), r in rows.items() if form == f"fp32 replay verify F = {K}, T = 4"]
        assert len(replayed) == 4 and all(r["issue/memory"] > 1 for r in replayed), K
