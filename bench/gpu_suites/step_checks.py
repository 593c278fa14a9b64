"""The step suite's inputs, its three paths and its correctness checks (``bench/gpu_bench.py --suite step``).

Inputs come from the package's one factory (``mamba3_step.testing``). ``gather_scatter_step``
here is the *timed* unindexed path: allocation-free (preallocated scratch) so that it can be
captured in a CUDA graph, with no padding lanes; the reference baseline that defines parity
for padded batches is ``mamba3_step.serving.gather_dense_scatter``.
"""

from __future__ import annotations

import torch

from mamba3_step import mamba3_step_fn
from mamba3_step.api import prepare_step
from mamba3_step.launch import kernel_for
from mamba3_step.signature import STEP_SIGNATURE, make_binder, split_call
from mamba3_step.spec import PREVIOUS_LOAD_LAYOUTS
from mamba3_step.tensors import kernel_arguments
from mamba3_step.reference import mamba3_step_reference
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, row_tensors

from .timing import GraphUnavailable, capture


# ------------------------------------------------------------------------------ input sets
def make_shared(spec, heads: int, device, gen: torch.Generator) -> dict:
    """Per-step tensors every lane shares: D (H,) fp32 and the (R, H, D) projections."""
    return layer_weights(heads, spec.headdim, spec.mimo, proj_dtype=spec.proj_dtype, has_z=spec.has_z,
                         has_outproj=spec.has_outproj, generator=gen, device=device)


def make_lanes(spec, batch: int, heads: int, device, gen: torch.Generator) -> dict:
    """Per-lane tensors of one step: A/dt/trap (B, H) fp32, B/C (B, R, H, N), x/z (B, H, D)
    and a preallocated ``out``; random, never zeros."""
    lanes = lane_inputs(batch, heads, spec.headdim, spec.dstate, spec.mimo, kv_dtype=spec.kv_dtype,
                        x_dtype=spec.x_dtype, has_z=spec.has_z, generator=gen, device=device)
    R, D = spec.mimo, spec.headdim
    shape = (batch, heads, D) if spec.has_outproj else (batch, R, heads, D)
    return {**lanes, "out": torch.empty(shape, dtype=lanes["x"].dtype, device=device)}


def make_pool(spec, rows: int, heads: int, device, gen: torch.Generator) -> dict:
    """state (rows, H, D, N), Bstate (rows, R, H, N), Xstate (rows, H, D), random."""
    return row_tensors(rows, heads, spec.headdim, spec.dstate, spec.mimo, state_dtype=spec.state_dtype,
                       kv_dtype=spec.kv_dtype, x_dtype=spec.x_dtype, generator=gen, device=device)


def padded_copy(pool: dict, pad: int = 4) -> dict:
    """``pool`` with the same values, its state rows given a padded D stride (N + ``pad``
    elements): such a pool compiles the kernel that reads the state's D stride at run time
    (``StepSpec.padded_state_rows``), the kernel every pool ran before packed state rows. The
    padding columns hold NaN: a kernel that read them would show it."""
    state = pool["state"]
    wide = torch.full(tuple(state.shape[:-1]) + (state.shape[-1] + pad,), float("nan"), dtype=state.dtype,
                      device=state.device)
    view = wide[..., : state.shape[-1]]
    view.copy_(state)
    return {**pool, "state": view, "Bstate": pool["Bstate"].clone(), "Xstate": pool["Xstate"].clone()}


# ------------------------------------------------------------------------------ the three paths
_bind_step = make_binder("async_copy_step_fn", STEP_SIGNATURE)


def variant_step_fn(async_copy: bool = False, min_ctas: int = 0, layout: str = "", pipeline_ctas: int = 0):
    """``mamba3_step_fn`` (its validation included) launched through a kernel variant that is not a
    public option, as ``mamba3_step_fn`` launches its kernel: the asynchronous state copy
    (``StepSpec.async_state_copy``), a launch bound of ``min_ctas`` CTAs per SM
    (``StepSpec.min_ctas_per_sm``), a previous load layout or a small-batch form of the register kernel
    (``layout``, one of :data:`LAYOUTS` or :data:`SMALL_BATCH_FORMS`: its StepSpec fields), the slab pipeline with ``pipeline_ctas`` persistent CTAs
    (``StepSpec.pipeline_ctas``). On CPU tensors its PTX, executed (mamba3_step.tools.ptx_tier)."""

    def step(*args, **kwargs) -> torch.Tensor:
        tensors, options = split_call(_bind_step(*args, **kwargs))
        spec, tensors, out = prepare_step(tensors, **options._asdict())
        spec = spec.replace(async_state_copy=async_copy, min_ctas_per_sm=min_ctas, pipeline_ctas=pipeline_ctas,
                            **(KERNEL_FORMS[layout][1] if layout else {}))
        if tensors.batch > 0 and tensors.x.is_cuda:
            kernel_for(spec, tensors.x)(*kernel_arguments(tensors))
        elif tensors.batch > 0:
            from mamba3_step.tools.ptx_tier import run_step_ptx
            run_step_ptx(spec, tensors, record=False)
        return out

    return step


#: pool mode through the asynchronous state copy (``--async-copy``)
async_copy_step_fn = variant_step_fn(async_copy=True)

#: the step suite's mode of pool mode through the asynchronous state copy
ASYNC_MODE = "pool_async_copy"
#: the register kernel's previous load layouts -> (what it is, the StepSpec fields that select it: not public
#: options): every load left to the compiler's order (3 round trips), and with that the epilogue's operands
#: loaded after the update (4)
LAYOUTS = {"unpinned_loads": ("the loads unpinned", PREVIOUS_LOAD_LAYOUTS["unpinned"]),
           "late_epilogue": ("the late epilogue", PREVIOUS_LOAD_LAYOUTS["late-epilogue"])}
#: the small-batch forms of the register kernel -> (what it is, the StepSpec fields that select it): the D split over a
#: cluster of 2 and 4 CTAs a (lane, head) (tile_D, a public option, with update_kv_state), and programmatic dependent
#: launch (StepSpec.programmatic_launch, not a public option) alone and with each split; a round's input sets use
#: disjoint rows, so consecutive steps meet its guarantee (docs/contract.md)
SMALL_BATCH_FORMS = {"split2": ("the D split over 2 CTAs", {"tile_D": 32}),
                     "split4": ("the D split over 4 CTAs", {"tile_D": 16}),
                     "programmatic": ("programmatic launch", {"programmatic_launch": True}),
                     "split2_programmatic": ("the D split over 2 CTAs, programmatic launch",
                                             {"tile_D": 32, "programmatic_launch": True}),
                     "split4_programmatic": ("the D split over 4 CTAs, programmatic launch",
                                             {"tile_D": 16, "programmatic_launch": True})}
#: every register-kernel form a variant names (``layout``): the previous load layouts and the small-batch forms
KERNEL_FORMS = {**LAYOUTS, **SMALL_BATCH_FORMS}
#: the step suite's mode of pool mode through the register kernel with its epilogue's operands loaded after the update
LATE_MODE = "pool_late_epilogue"
#: the step suite's modes of pool mode through the slab pipeline (the mode's suffix: its persistent CTAs)
PIPELINE_MODE = "pool_pipeline"
#: the step suite's mode of pool mode through the register kernel with its loads in the compiler's order
UNPINNED_MODE = "pool_unpinned_loads"


def kernel_variants(async_copy: bool, bounds: tuple[int, ...] = (), layouts: tuple[str, ...] = (),
                    pipelines: tuple[int, ...] = ()) -> dict:
    """The step suite's kernel variants of pool mode: mode -> (what it is, its step function): the
    asynchronous state copy with ``async_copy``, the register kernel in each previous load layout of
    ``layouts`` (:data:`LAYOUTS`, mode ``pool_<layout>``), the slab pipeline with each CTA count ``c`` of
    ``pipelines`` (``pool_pipeline{c}``; with the small-batch forms also launched programmatically,
    ``pool_pipeline{c}_programmatic``), and for each launch bound ``n`` of ``bounds`` the register kernel
    (``pool_bound{n}``) and, with ``async_copy``, the copy (``pool_async_copy_bound{n}``) under it."""
    variants = {ASYNC_MODE: ("the asynchronous state copy", async_copy_step_fn)} if async_copy else {}
    for ctas in pipelines:
        variants[f"{PIPELINE_MODE}{ctas}"] = (f"the slab pipeline, {ctas} CTAs", variant_step_fn(pipeline_ctas=ctas))
        if "programmatic" in layouts:  # with the small-batch forms: the pipeline launched programmatically too
            variants[f"{PIPELINE_MODE}{ctas}_programmatic"] = (f"the slab pipeline, {ctas} CTAs, programmatic launch",
                                                                variant_step_fn(pipeline_ctas=ctas, layout="programmatic"))
    for layout in layouts:
        variants[f"pool_{layout}"] = (KERNEL_FORMS[layout][0], variant_step_fn(layout=layout))
    for n in bounds:
        variants[f"pool_bound{n}"] = (f"the register kernel at a launch bound of {n} CTAs", variant_step_fn(False, n))
        if async_copy:
            variants[f"{ASYNC_MODE}_bound{n}"] = (f"the asynchronous state copy at a launch bound of {n} CTAs",
                                                  variant_step_fn(True, n))
    return variants


def pool_step(step_fn, spec, pool: dict, shared: dict, lanes: dict, idx: torch.Tensor):
    """Pool mode: one launch over the pool, rows ``idx`` (B,) int32, in place."""
    return step_fn(
        pool["state"], pool["Bstate"], pool["Xstate"], lanes["A"], lanes["B"], lanes["C"],
        shared["D"], lanes["x"], lanes["dt"], lanes["trap"], shared["xproj"], shared["outproj"],
        None, lanes["out"], lanes["z"], shared["zproj"],
        state_batch_indices=idx, update_kv_state=spec.update_kv_state,
    )


def dense_step(step_fn, spec, dense: dict, shared: dict, lanes: dict):
    """Dense mode: lane b uses row b of ``dense``'s (B, ...) tensors, in place."""
    return step_fn(
        dense["state"], dense["Bstate"], dense["Xstate"], lanes["A"], lanes["B"], lanes["C"],
        shared["D"], lanes["x"], lanes["dt"], lanes["trap"], shared["xproj"], shared["outproj"],
        None, lanes["out"], lanes["z"], shared["zproj"],
        update_kv_state=spec.update_kv_state,
    )


def gather_scatter_step(step_fn, spec, pool: dict, scratch: dict, shared: dict, lanes: dict,
                        idx64: torch.Tensor):
    """What a server does without pool indexing: gather rows ``idx64`` (B,) int64 of the pool
    into ``scratch`` (dense (B, ...) buffers), dense step, scatter the new rows back (state,
    and Bstate/Xstate with update_kv_state). Allocation-free, graph-capturable."""
    for k in ("state", "Bstate", "Xstate"):
        torch.index_select(pool[k], 0, idx64, out=scratch[k])
    out = dense_step(step_fn, spec, scratch, shared, lanes)
    pool["state"].index_copy_(0, idx64, scratch["state"])
    if spec.update_kv_state:
        pool["Bstate"].index_copy_(0, idx64, scratch["Bstate"])
        pool["Xstate"].index_copy_(0, idx64, scratch["Xstate"])
    return out


# ------------------------------------------------------------------------------ correctness
def within_reference(name: str, got: torch.Tensor, ref32: torch.Tensor, ref64: torch.Tensor) -> str | None:
    """None when ``got`` is as close to the float64 evaluation as PyTorch float32 is (at most
    twice its max error plus one ulp of ``got``'s dtype at the largest magnitude), else a
    message. Non-finite values fail."""
    g, r32, r64 = got.double(), ref32.double(), ref64.double()
    if not torch.isfinite(g).all():
        return f"{name}: {int((~torch.isfinite(g)).sum())} non-finite values"
    if g.numel() == 0:
        return None
    err = (g - r64).abs().max().item()
    err32 = (r32 - r64).abs().max().item()
    scale = r64.abs().max().item()
    eps = torch.finfo(got.dtype).eps if got.is_floating_point() else 0.0
    bound = 2 * err32 + eps * max(scale, 1e-30)
    if err > bound:
        return (f"{name}: max error vs float64 {err:.3e} > bound {bound:.3e} "
                f"(PyTorch float32 error {err32:.3e}, |ref| <= {scale:.3e})")
    return None


def _clone(d: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def check_batch(spec, batch: int, heads: int, device, step_fn=None, reference_fn=None,
                graphs: bool = False, seed: int = 0, padded: bool = False, async_copy: bool = False,
                upstream_fn=None, peer_failures: list | None = None, bounds: tuple[int, ...] = (),
                layouts: tuple[str, ...] = (), pipelines: tuple[int, ...] = ()) -> list[str]:
    """Run every mode once on fresh random data and check it (see the module docstring); with
    ``padded``, pool mode on state rows of a padded D stride too, bit for bit pool mode's; with
    ``async_copy``, ``bounds`` and ``layouts``, each of :func:`kernel_variants` bit for bit pool mode's; with
    ``upstream_fn`` (upstream's dense step, :mod:`.upstream`), the peer's server step within PyTorch
    float32's error of the float64 evaluation and its Bstate/Xstate rows this step's B and x.

    Returns the list of failures (empty when all checks pass). The peer's failures, an exception it
    raises included, go to ``peer_failures`` when given (the peer is not this project's code), else
    to the returned list.
    """
    step_fn = step_fn or mamba3_step_fn
    reference_fn = reference_fn or mamba3_step_reference
    gen = torch.Generator().manual_seed(1000 + seed)
    P = 2 * batch + 3
    pool0 = make_pool(spec, P, heads, device, gen)
    shared = make_shared(spec, heads, device, gen)
    lanes = make_lanes(spec, batch, heads, device, gen)
    rows = torch.randperm(P, generator=gen)[:batch]
    idx = rows.to(torch.int32).to(device)
    idx64 = rows.to(device)
    failures = []

    # pool mode (the kernel)
    pool_k = _clone(pool0)
    lanes_k = _clone(lanes)
    pool_step(step_fn, spec, pool_k, shared, lanes_k, idx)

    # gather -> dense -> scatter (the kernel in dense mode): must be bit-identical
    pool_g = _clone(pool0)
    lanes_g = _clone(lanes)
    scratch = {k: torch.empty((batch,) + tuple(v.shape[1:]), dtype=v.dtype, device=device)
               for k, v in pool0.items()}
    gather_scatter_step(step_fn, spec, pool_g, scratch, shared, lanes_g, idx64)
    if not bits_equal(lanes_k["out"], lanes_g["out"]):
        failures.append(f"B={batch}: pool-mode out differs from gather->dense->scatter")
    for k in ("state", "Bstate", "Xstate"):
        if not bits_equal(pool_k[k], pool_g[k]):
            failures.append(f"B={batch}: pool-mode {k} differs from gather->dense->scatter")
    if padded:
        failures += _check_padded(spec, step_fn, pool0, shared, lanes, idx, pool_k, lanes_k, batch)
    for what, fn in kernel_variants(async_copy, bounds, layouts, pipelines).values():  # other kernels of pool mode: its bits
        pool_a, lanes_a = _clone(pool0), _clone(lanes)
        pool_step(fn, spec, pool_a, shared, lanes_a, idx)
        for k, a, b in (("out", lanes_a["out"], lanes_k["out"]), *((k, pool_a[k], pool_k[k]) for k in pool_k)):
            if not bits_equal(a, b):
                failures.append(f"B={batch}: {what}'s {k} differs from pool mode's")

    # the PyTorch path, float32 and float64
    p32, l32, p64, l64 = _references(spec, pool0, lanes, shared, idx, reference_fn)
    msg = within_reference(f"B={batch}: pool-mode out", lanes_k["out"], l32["out"], l64["out"])
    if msg:
        failures.append(msg)
    msg = within_reference(f"B={batch}: pool-mode new state rows", pool_k["state"][idx64],
                           p32["state"][idx64], p64["state"][idx64])
    if msg:
        failures.append(msg)
    if upstream_fn is not None:
        try:
            peer = _check_upstream(spec, upstream_fn, pool0, shared, lanes, idx64, scratch, p32, l32, l64, p64, batch)
        except Exception as e:  # the peer's own failure to run is a finding about the peer
            peer = [f"B={batch}: upstream's step raised {type(e).__name__}: {e}"]
        (failures if peer_failures is None else peer_failures).extend(peer)
    untouched = torch.ones(P, dtype=torch.bool, device=device)
    untouched[idx64] = False
    for k in ("state", "Bstate", "Xstate"):
        if not bits_equal(pool_k[k][untouched], pool0[k][untouched]):
            failures.append(f"B={batch}: pool mode changed {k} rows no lane writes")
        if spec.update_kv_state and k != "state" and not bits_equal(pool_k[k][idx64], p32[k][idx64]):
            failures.append(f"B={batch}: pool-mode {k} rows are not this step's "
                            f"{'B' if k == 'Bstate' else 'x'} (update_kv_state)")

    # dense mode (the kernel) against the PyTorch path
    dense_k = {k: v[idx64].clone() for k, v in pool0.items()}
    lanes_d = _clone(lanes)
    dense_step(step_fn, spec, dense_k, shared, lanes_d)
    msg = within_reference(f"B={batch}: dense-mode out", lanes_d["out"], l32["out"], l64["out"])
    if msg:
        failures.append(msg)
    msg = within_reference(f"B={batch}: dense-mode new state", dense_k["state"],
                           p32["state"][idx64], p64["state"][idx64])
    if msg:
        failures.append(msg)

    # CUDA-graph replay computes the same bits as the eager call
    if graphs and not failures:
        try:
            failures += _check_graphs(spec, batch, step_fn, pool0, lanes, shared, scratch, idx, idx64,
                                      pool_k, lanes_k, dense_k, lanes_d)
        except Exception as e:
            raise GraphUnavailable(f"{type(e).__name__}: {e}") from e
    return failures


def _check_upstream(spec, upstream_fn, pool0, shared, lanes, idx64, scratch, p32, l32, l64, p64, batch) -> list[str]:
    """The peer's server step (gather -> upstream's dense step -> scatter) on the check data."""
    from .upstream import upstream_step

    pool_u, lanes_u = _clone(pool0), _clone(lanes)
    upstream_step(upstream_fn, spec, pool_u, scratch, shared, lanes_u, idx64)
    failures = [msg for msg in (
        within_reference(f"B={batch}: upstream's out", lanes_u["out"], l32["out"], l64["out"]),
        within_reference(f"B={batch}: upstream's new state rows", pool_u["state"][idx64], p32["state"][idx64],
                         p64["state"][idx64])) if msg]
    for k in ("Bstate", "Xstate") if spec.update_kv_state else ():
        if not bits_equal(pool_u[k][idx64], p32[k][idx64]):
            failures.append(f"B={batch}: upstream's server step left {k} rows other than this step's "
                            f"{'B' if k == 'Bstate' else 'x'}")
    return failures


def _check_padded(spec, step_fn, pool0, shared, lanes, idx, pool_k, lanes_k, batch) -> list[str]:
    """Pool mode on a padded copy of ``pool0`` gives pool mode's bits, padding columns untouched."""
    pool_p, lanes_p = padded_copy(pool0), _clone(lanes)
    pool_step(step_fn, spec, pool_p, shared, lanes_p, idx)
    failures = [f"B={batch}: padded-row pool mode {k} differs from pool mode" for k in ("state", "Bstate", "Xstate")
                if not bits_equal(pool_p[k], pool_k[k])]
    if not bits_equal(lanes_p["out"], lanes_k["out"]):
        failures.append(f"B={batch}: padded-row pool mode out differs from pool mode")
    wide = pool_p["state"].as_strided(pool_p["state"].shape[:-1] + (pool_p["state"].stride(-2),),
                                      pool_p["state"].stride())
    if not torch.isnan(wide[..., pool_k["state"].shape[-1]:]).all():
        failures.append(f"B={batch}: padded-row pool mode wrote into the padding columns")
    return failures


def _references(spec, pool0: dict, lanes: dict, shared: dict, idx, reference_fn) -> tuple:
    """The PyTorch path on copies: in float32 (results in the storage dtypes) and in float64
    (inputs widened, results not cast back): ``(pool32, lanes32, pool64, lanes64)``."""
    p32, l32 = _clone(pool0), _clone(lanes)
    reference_fn(StepTensors(**p32, **l32, **shared, state_batch_indices=idx),
                 update_kv_state=spec.update_kv_state, compute_dtype=torch.float32)
    p64 = {k: v.clone().double() for k, v in pool0.items()}
    l64 = {k: (v.clone().double() if isinstance(v, torch.Tensor) else v) for k, v in lanes.items()}
    sh = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in shared.items()}
    reference_fn(StepTensors(**p64, **l64, **sh, state_batch_indices=idx),
                 update_kv_state=spec.update_kv_state, compute_dtype=torch.float64)
    return p32, l32, p64, l64


def _check_graphs(spec, batch, step_fn, pool0, lanes, shared, scratch, idx, idx64,
                  pool_k, lanes_k, dense_k, lanes_d) -> list[str]:
    """CUDA-graph replay of each mode on the check data gives the eager call's bits."""
    failures = []
    cases = {
        "pool": (lambda p, ln: pool_step(step_fn, spec, p, shared, ln, idx), pool_k, lanes_k),
        "gather_scatter": (lambda p, ln: gather_scatter_step(step_fn, spec, p, scratch, shared, ln, idx64),
                           pool_k, lanes_k),
    }
    for mode, (fn, want_pool, want_lanes) in cases.items():
        p, ln = _clone(pool0), _clone(lanes)
        graph = capture(lambda: fn(p, ln), warmup_restore=lambda: _restore(p, pool0, ln, lanes))
        _restore(p, pool0, ln, lanes)
        graph.replay()
        torch.cuda.synchronize()
        if not (bits_equal(ln["out"], want_lanes["out"]) and all(
                bits_equal(p[k], want_pool[k]) for k in p)):
            failures.append(f"B={batch}: CUDA-graph replay of {mode} differs from the eager call")
    d, ln = {k: v[idx64].clone() for k, v in pool0.items()}, _clone(lanes)
    d0 = _clone(d)
    graph = capture(lambda: dense_step(step_fn, spec, d, shared, ln),
                    warmup_restore=lambda: _restore(d, d0, ln, lanes))
    _restore(d, d0, ln, lanes)
    graph.replay()
    torch.cuda.synchronize()
    if not (bits_equal(ln["out"], lanes_d["out"]) and bits_equal(d["state"], dense_k["state"])):
        failures.append(f"B={batch}: CUDA-graph replay of dense differs from the eager call")
    return failures


def _restore(p: dict, p0: dict, ln: dict, ln0: dict) -> None:
    for k in p:
        p[k].copy_(p0[k])
    for k in ln:
        if isinstance(ln[k], torch.Tensor):
            ln[k].copy_(ln0[k])

