"""Launch the flagship's stepwise and replay kernels once each inside a profiler range, for ncu.

    ncu --profile-from-start off --section SpeedOfLight ... python bench/gpu_replay_probe.py [--batch 256]

Every kernel is compiled and launched twice before ``cudaProfilerStart``, so the profiled range holds
exactly one launch per variant, in this order: stepwise (pool mode), the same step in dense mode
(the pool mode / dense comparison of docs/performance.md section 4), then replay K=2, 4, 8 with outputs
replayed, then replayed at each ``--replay-warps`` warps a CTA, then from the checkpoint (rings
staggered as in ``bench/gpu_bench.py --suite replay``; a profiler's time limit cuts the last first).
Prints the order so that a report's kernels can be named. Exits 0 without a CUDA device.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402,F401  (puts the repository on sys.path)

import torch  # noqa: E402

from gpu_suites.replay import Layer  # noqa: E402
from mamba3_step.spec import FLAGSHIP_HEADS  # noqa: E402


def variants(batch: int, heads: int, Ks, device="cuda", replay_warps=()) -> list[tuple[str, object]]:
    """(name, step) in profiling order: the stepwise step in pool and dense mode, then replay for each K with outputs
    replayed, then replayed at each of ``replay_warps`` warps a CTA, then from the checkpoint; each
    replay layer's rows staggered over the ring positions."""
    out = [("stepwise", Layer(batch, heads, 2, device, seed=1).stepwise),
           ("stepwise dense", Layer(batch, heads, 2, device, seed=1).dense)]
    forms = [(False, None)] + [(False, w) for w in replay_warps] + [(True, None)]
    for fc, warps in forms:
        for K in Ks:
            layer = Layer(batch, heads, K, device, seed=1).stagger()
            name = f"replay K={K} {'from checkpoint' if fc else 'replayed'}" + (f" {warps} warps" if warps else "")
            out.append((name, lambda layer=layer, fc=fc, w=warps: layer.replay(fc, w)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--heads", type=int, default=FLAGSHIP_HEADS)
    p.add_argument("--ks", default="2,4,8")
    p.add_argument("--replay-warps", default="", help="also the replayed step at these warps a CTA (e.g. 8)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return 0
    runs = variants(args.batch, args.heads, [int(k) for k in args.ks.split(",")],
                    replay_warps=[int(w) for w in args.replay_warps.split(",") if w])
    for _, fn in runs:
        fn(), fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for i, (name, fn) in enumerate(runs):
        fn()
        print(f"profiled launch {i}: {name}")
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
