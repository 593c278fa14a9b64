"""Launch the flagship's pool-mode step through the register kernel, the asynchronous state copy
(``StepSpec.async_state_copy``), the slab pipeline (``StepSpec.pipeline_ctas``, two persistent CTAs per SM
of the device) and the small-batch forms (the D split over a cluster of 4, programmatic launch, both) inside a
profiler range, for Nsight Compute and compute-sanitizer.

    ncu --profile-from-start off --set full python bench/gpu_async_probe.py [--batch 256] [--state-dtype bfloat16]
    compute-sanitizer --tool racecheck python bench/gpu_async_probe.py --batch 4 --kernels async

Each kernel is compiled and launched twice before ``cudaProfilerStart``, so the profiled range holds
exactly one launch per kernel, in the order of ``--kernels`` (default ``registers,async``), printed so
that a report's kernels can be named. Their outputs are compared bit for bit afterwards (exit 1 when
they differ). Exits 0 without a CUDA device.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402,F401  (puts the repository on sys.path)

import torch  # noqa: E402

from gpu_suites.step_checks import make_lanes, make_pool, make_shared  # noqa: E402
from mamba3_step.api import prepare_step  # noqa: E402
from mamba3_step.launch import kernel_for  # noqa: E402
from mamba3_step.spec import FLAGSHIP_HEADS, flagship_spec  # noqa: E402
from mamba3_step.tensors import StepTensors, kernel_arguments  # noqa: E402
from mamba3_step.testing import bits_equal  # noqa: E402

#: a kernel -> the StepSpec fields that select it (``pipeline_ctas``: per SM of the device, times its SMs)
KERNELS = {"registers": {}, "async": {"async_state_copy": True}, "pipeline": {"pipeline_ctas": 2},
           "split4": {"tile_D": 16}, "programmatic": {"programmatic_launch": True},
           "split4_programmatic": {"tile_D": 16, "programmatic_launch": True}}


def launcher(spec, batch: int, heads: int, fields: dict, seed: int = 3):
    """``(launch, out, pool)``: one pool-mode step of ``spec`` on fresh rows, through the kernel ``fields``
    select (:data:`KERNELS`); the same inputs for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    pool = make_pool(spec, 2 * batch + 3, heads, torch.device("cuda"), gen)
    shared = make_shared(spec, heads, torch.device("cuda"), gen)
    lanes = make_lanes(spec, batch, heads, torch.device("cuda"), gen)
    idx = torch.randperm(2 * batch + 3, generator=gen)[:batch].to(torch.int32).cuda()
    call = StepTensors(state=pool["state"], Bstate=pool["Bstate"], Xstate=pool["Xstate"], A=lanes["A"], B=lanes["B"],
                       C=lanes["C"], D=shared["D"], x=lanes["x"], dt=lanes["dt"], trap=lanes["trap"],
                       xproj=shared["xproj"], outproj=shared["outproj"], out=lanes["out"], z=lanes["z"],
                       zproj=shared["zproj"], state_batch_indices=idx)
    prepared, tensors, _ = prepare_step(call, update_kv_state=True)
    if "pipeline_ctas" in fields:
        fields = {"pipeline_ctas": fields["pipeline_ctas"] * torch.cuda.get_device_properties(0).multi_processor_count}
    kernel = kernel_for(prepared.replace(**fields), tensors.x)
    return (lambda: kernel(*kernel_arguments(tensors))), tensors.out, pool


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--heads", type=int, default=FLAGSHIP_HEADS)
    p.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--kernels", default="registers,async")
    args = p.parse_args(argv)
    names = args.kernels.split(",")
    if not names or set(names) - set(KERNELS):
        p.error(f"--kernels: expected a comma-separated subset of {','.join(KERNELS)}, got {args.kernels!r}")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return 0
    spec = flagship_spec(state_dtype=args.state_dtype)
    runs = {name: launcher(spec, args.batch, args.heads, KERNELS[name]) for name in names}
    for launch, _, _ in runs.values():  # compile, then warm
        launch()
        launch()
    torch.cuda.synchronize()
    fresh = {name: launcher(spec, args.batch, args.heads, KERNELS[name]) for name in names}
    torch.cuda.cudart().cudaProfilerStart()
    for name in names:
        print(f"profiled: {name}", flush=True)
        fresh[name][0]()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    outs = list(fresh.values())
    same = all(bits_equal(o[1], outs[0][1]) and all(bits_equal(o[2][k], outs[0][2][k]) for k in o[2]) for o in outs)
    print("outputs and rows bit-identical across kernels" if same else "OUTPUTS DIFFER between kernels")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
