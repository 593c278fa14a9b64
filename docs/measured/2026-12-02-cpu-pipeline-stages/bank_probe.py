import sys, time
sys.path[:0] = ["tests/kernel", "tests/ptx", "tests"]  # run from the repository root
from async_state_cases import prepared_call, pipeline_spec
from mamba3_step.spec import flagship_spec
from mamba3_step.tools.ptx_tier import run_step_ptx
from ptx_executor import analysis
for form in (dict(), dict(state_dtype="bfloat16")):
    spec = flagship_spec(**form)
    tensors, _ = prepared_call(spec, B=2, seed=3)
    t = time.time()
    res = run_step_ptx(pipeline_spec(spec, 4), tensors, record_shared=True)
    c = analysis.bank_conflicts(res)
    req = sum(v["requests"] for v in c.values()); wf = sum(v["wavefronts"] for v in c.values()); ideal = sum(v["ideal"] for v in c.values())
    worst = sorted(c.items(), key=lambda kv: kv[1]["ideal"] - kv[1]["wavefronts"])[:6]
    print(form, f"requests {req} wavefronts {wf} ideal {ideal} excess {wf-ideal}", round(time.time()-t,1), "s")
    for ln, v in sorted(c.items(), key=lambda kv: -(kv[1]["wavefronts"] - kv[1]["ideal"]))[:6]:
        print("   ", ln, v)
    byline = {i.line: i.text for i in res.entry.instructions}
    for ln, v in sorted(c.items(), key=lambda kv: -(kv[1]["wavefronts"] - kv[1]["ideal"]))[:12]:
        print("   ", ln, byline.get(ln, ln), v)

