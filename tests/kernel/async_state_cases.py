"""The specialisations the register kernel's other layouts (the asynchronous state copy,
``StepSpec.async_state_copy``; the epilogue loaded late, ``StepSpec.late_epilogue``) are compiled and
executed at beside the default (and the slab pipeline, ``StepSpec.pipeline_ctas``, at ``pipeline_spec``): the covering set and one of each feature set by default
(``ASYNC_DEFAULT``), the feature sets' other forms with ``--full-matrix`` (``ASYNC_FULL``); the one call
factory of their tests (``prepared_call``), and the comparison of two kernels' writes on one call
(``run_each``, ``assert_same_writes``)."""

from __future__ import annotations

from test_kernel_compile import COVERING, EIGHT_BIT, MULTI_TOKEN, ROTARY, STOCHASTIC

#: the null slot of the pool-mode calls
NULL = 2
#: the tensors a step may write: two kernels of one call are compared on these, bit for bit
WRITTEN = ("out", "state", "state_out", "Bstate", "Xstate", "angle_state", "state_scale")


def case_params() -> list:
    """pytest parameters naming every case: ``ASYNC_DEFAULT`` in the default run, ``ASYNC_FULL`` with
    ``--full-matrix``."""
    import pytest

    return [pytest.param(name, id=name) for name in ASYNC_DEFAULT] + [
        pytest.param(name, id=name, marks=pytest.mark.full_matrix) for name in ASYNC_FULL]


def case_spec(name: str):
    """The case's spec at its default tiling."""
    return {**ASYNC_DEFAULT, **ASYNC_FULL}[name].with_default_tiling()


def pipeline_spec(spec, ctas: int):
    """``spec`` on the slab pipeline with ``ctas`` CTAs, its tile_D halved while the stages would not fit in shared
    memory, or the whole head for update_kv_state's D split, which the pipeline does not take (``out`` and the
    stored bytes are independent of the tiling: docs/contract.md)."""
    from mamba3_step.slab_pipeline import pipeline_problem

    piped = spec.replace(pipeline_ctas=ctas)
    if spec.update_kv_state and spec.tile_D < spec.headdim:
        piped = piped.replace(tile_D=spec.headdim)
    while pipeline_problem(piped) and "shared memory" in pipeline_problem(piped):
        piped = piped.replace(tile_D=piped.tile_D // 2)
    assert pipeline_problem(piped) is None, pipeline_problem(piped)
    return piped


#: the state forms the latency model tabulates (latency_model's *_LATENCY_FACTS), as changes to the flagship
STATE_FORMS = {"fp32": {}, "bf16, round to nearest": dict(state_dtype="bfloat16"),
               "bf16, stochastic rounding": dict(state_dtype="bfloat16", stochastic_rounding=True)}

_FACTS: dict = {}


def compile_facts(spec, arch: str):
    """The compiler facts of ``spec`` on ``arch`` (compiled once per process)."""
    from mamba3_step.kernel import compile_step_kernel
    from mamba3_step.tools.inspection.facts import kernel_facts

    if (spec, arch) not in _FACTS:
        _FACTS[(spec, arch)] = kernel_facts(compile_step_kernel(spec, arch))
    return _FACTS[(spec, arch)]


def compile_params(archs) -> list:
    """pytest parameters ``(name, arch)`` of every case on every target: the default run compiles the flagship on
    each target and the other default cases on the first; the rest with ``--full-matrix``."""
    import pytest

    out = []
    for name in {**ASYNC_DEFAULT, **ASYNC_FULL}:
        for arch in archs:
            full = name in ASYNC_FULL or (arch != archs[0] and not name.startswith("flagship-pool-kv"))
            out.append(pytest.param(name, arch, id=f"{name}-{arch}", marks=[pytest.mark.full_matrix] if full else []))
    return out


def run_each(tensors, *specs) -> list:
    """Each of ``specs``' kernel run on its own copy of ``tensors``: launched on a GPU's tensors (then
    synchronised), else its PTX executed on the CPU (the PTX tier); the copies."""
    import torch

    from mamba3_step.launch import kernel_for
    from mamba3_step.tensors import StepTensors, kernel_arguments
    from mamba3_step.tools.ptx_tier import run_step_ptx

    copies = []
    for spec in specs:
        copy = StepTensors(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tensors._asdict().items()})
        if copy.x.is_cuda:
            kernel_for(spec, copy.x)(*kernel_arguments(copy))
            torch.cuda.synchronize()
        else:
            run_step_ptx(spec, copy, record=False)
        copies.append(copy)
    return copies


def assert_same_writes(a, b, where: str) -> int:
    """Every tensor of ``WRITTEN`` that the calls ``a`` and ``b`` have holds the same bits; how many were compared."""
    from mamba3_step.testing import bits_equal

    compared = 0
    for key in WRITTEN:
        x, y = getattr(a, key, None), getattr(b, key, None)
        if x is None:
            continue
        assert bits_equal(x, y), f"{where}: {key} differs"
        compared += 1
    return compared

ASYNC_DEFAULT = {**COVERING, "flagship-T4-spec": MULTI_TOKEN["flagship-T4-spec"],
                 "flagship-rotary": ROTARY["flagship-rotary"],
                 "flagship-bf16state-sr": STOCHASTIC["flagship-bf16state-sr"],
                 "flagship-int8state": EIGHT_BIT["flagship-int8state"]}
ASYNC_FULL = {name: spec for name, spec in {**MULTI_TOKEN, **ROTARY, **STOCHASTIC, **EIGHT_BIT}.items()
              if name not in ASYNC_DEFAULT}


def prepared_heads(spec) -> int:
    """The heads of :func:`prepared_call`'s inputs: 2 for a small state, else 1."""
    return 2 if spec.dstate * spec.headdim * spec.mimo < 256 * 32 * 8 else 1


def prepared_call(spec, B: int, seed: int, device: str = "cpu") -> tuple:
    """Fresh inputs and indices for ``spec`` on ``device`` (every padding kind in pool mode), validated as a
    user's call: ``(StepTensors, lane kinds)`` with ``out`` poisoned; the spec the call compiles to is ``spec``."""
    import torch

    from mamba3_step.api import prepare_step
    from mamba3_step.tensors import StepTensors
    from mamba3_step.testing import inputs_for, poison_, pool_rows, step_indices

    P = pool_rows(spec, B) if spec.pool else None
    heads = prepared_heads(spec)
    inputs = inputs_for(spec, B, P, H=heads, seed=seed, device=device)
    kinds = ["live"] * B
    kw = {}
    if spec.pool:
        kw, kinds = step_indices(spec, B, P, null_slot_id=NULL, seed=seed, device=device)
        kw = {k: v for k, v in kw.items() if v is not None}
    if spec.has_state_out:
        inputs["state_out"] = poison_(torch.empty_like(inputs["state"]))
    if spec.has_rand_rows:  # dense mode drawing each lane's bits for another row
        rows = torch.randperm(3 * B, generator=torch.Generator().manual_seed(seed))[:B]
        inputs["rand_rows"] = rows.to(torch.int32).to(device)
    prepared, tensors, _ = prepare_step(StepTensors(**inputs, **kw), update_kv_state=spec.update_kv_state,
                                        stochastic_rounding=spec.stochastic_rounding,
                                        rotate_pairwise=spec.rotate_pairwise, tile_D=spec.tile_D,
                                        num_warps=spec.num_warps)
    assert prepared == spec.replace(async_state_copy=False), (prepared, spec)
    return tensors._replace(out=poison_(tensors.out)), kinds
