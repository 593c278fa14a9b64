"""Shared pytest options, markers and input factories for the mamba3_step test suite.

Letters (as in SPEC.md): B batch lanes, P pool rows, H heads, D head dim, N state size,
R MIMO rank.

Options and markers
-------------------
* ``--full-matrix``: opt in to the big matrices (the full compile cross product). Tests marked
  ``@pytest.mark.full_matrix`` are skipped without it; the ``full_matrix`` fixture returns the
  flag as a bool (skips nothing) for tests that only grow with it.
* ``@pytest.mark.gpu``: skipped when ``torch.cuda.is_available()`` is False. GPU tests live in
  ``tests/gpu/``.

Factories (import them with ``from conftest import make_inputs, ...``; pytest puts this
folder on ``sys.path``; the same functions are also fixtures of the same name)
-------------------------------------------------------------------------------------------
* :func:`make_inputs` - a dict of fresh random step inputs, keyed like ``mamba3_step_fn``'s
  arguments (``state``, ``Bstate``, ..., ``z``, ``zproj``; ``outproj``/``z``/``zproj`` are None
  when disabled), ready for ``mamba3_step_fn(**inputs)``.
* :func:`make_pool_indices` / :func:`build_pool_indices` - race-free int32 pool indices with
  live lanes and padding lanes of the three kinds (negative, ``>= P``, ``null_slot_id``), and
  live lanes whose destination is padding.
* :func:`poison_` / :func:`poison_rows_` - fill a tensor (or some of its rows) with random bit
  patterns (NaN, inf, huge and tiny values included), in place.
* :func:`bits` / :func:`assert_bits_equal` - NaN-safe bit-for-bit comparison.
* :func:`gather_dense_scatter` - the expected result of a pool-mode call, computed as SPEC.md
  defines it: gather the live rows with torch indexing, run a dense step, scatter back.
* :func:`check_pool_parity` - poison, run a pool-mode call and assert it bit-identical to
  :func:`gather_dense_scatter` (padding zeros, untouched rows, read-only inputs included);
  ``step_fn`` lets GPU tests run it on the kernel.
"""

from __future__ import annotations

import random

import pytest
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
PAD_KINDS = ("negative", "oob", "null")
LANE_KINDS = ("live", "live_nodst") + PAD_KINDS
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# --------------------------------------------------------------------------- options, markers
def pytest_addoption(parser):
    parser.addoption(
        "--full-matrix",
        action="store_true",
        default=False,
        help="run the big matrices (full compile cross product); tests marked full_matrix",
    )


def pytest_collection_modifyitems(config, items):
    full = config.getoption("--full-matrix")
    has_cuda = torch.cuda.is_available()
    skip_full = pytest.mark.skip(reason="big matrix: run with --full-matrix")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("full_matrix") is not None and not full:
            item.add_marker(skip_full)
        if item.get_closest_marker("gpu") is not None and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture
def full_matrix(request) -> bool:
    """True when pytest was given ``--full-matrix``."""
    return bool(request.config.getoption("--full-matrix"))


@pytest.fixture(autouse=True, scope="session")
def _private_kernel_cache(tmp_path_factory):
    """Every test process uses its own kernel cache dir: no test writes to the user's cache."""
    import os

    old = os.environ.get("MAMBA3_STEP_CACHE_DIR")
    os.environ["MAMBA3_STEP_CACHE_DIR"] = str(tmp_path_factory.mktemp("kernel-cache"))
    yield
    if old is None:
        os.environ.pop("MAMBA3_STEP_CACHE_DIR", None)
    else:
        os.environ["MAMBA3_STEP_CACHE_DIR"] = old


# --------------------------------------------------------------------------- random inputs
def _dtype(d) -> torch.dtype:
    return DTYPES[d] if isinstance(d, str) else d


def make_inputs(
    B: int,
    P: int | None = None,
    H: int = 2,
    D: int = 32,
    N: int = 32,
    R: int = 2,
    *,
    state_dtype="float32",
    kv_dtype="bfloat16",
    x_dtype="bfloat16",
    proj_dtype="bfloat16",
    has_z: bool = True,
    has_outproj: bool = True,
    seed: int = 0,
    device="cpu",
) -> dict:
    """Fresh random inputs for one step (never zeros), as a dict of ``mamba3_step_fn`` arguments.

    ``P`` is the number of rows of ``state`` (P, H, D, N), ``Bstate`` (P, R, H, N) and ``Xstate``
    (P, H, D); ``P=None`` means dense mode (rows = B). Per-lane tensors have B rows. Values:
    state, B, C, x, Xstate, z ~ N(0, 1); A in [-1.5, -0.5) (decay); dt in [0.01, 0.51);
    trap in [0, 1); D ~ N(0, 1); projections ~ N(0, 0.5^2) + 1. Data are drawn in float32 on the
    CPU from ``seed`` and then cast and moved, so a seed gives the same values on every device.
    Keys ``outproj``, ``z``, ``zproj`` are None when disabled.
    """
    g = torch.Generator().manual_seed(seed)
    rows = B if P is None else P
    sd, kd, xd, pd = map(_dtype, (state_dtype, kv_dtype, x_dtype, proj_dtype))

    def randn(*shape, dtype=torch.float32, scale=1.0, shift=0.0):
        t = torch.randn(*shape, generator=g) * scale + shift
        return t.to(dtype).to(device)

    def rand(*shape, lo, hi):
        return (torch.rand(*shape, generator=g) * (hi - lo) + lo).to(device)

    inputs = dict(
        state=randn(rows, H, D, N, dtype=sd),
        Bstate=randn(rows, R, H, N, dtype=kd),
        Xstate=randn(rows, H, D, dtype=xd),
        A=rand(B, H, lo=-1.5, hi=-0.5),
        B=randn(B, R, H, N, dtype=kd),
        C=randn(B, R, H, N, dtype=kd),
        D=randn(H),
        x=randn(B, H, D, dtype=xd),
        dt=rand(B, H, lo=0.01, hi=0.51),
        trap=rand(B, H, lo=0.0, hi=1.0),
        xproj=randn(R, H, D, dtype=pd, scale=0.5, shift=1.0),
        outproj=randn(R, H, D, dtype=pd, scale=0.5, shift=1.0) if has_outproj else None,
        z=randn(B, H, D, dtype=xd) if has_z else None,
        zproj=randn(R, H, D, dtype=pd, scale=0.5, shift=1.0) if has_z else None,
    )
    return inputs


def clone_inputs(inputs: dict) -> dict:
    """A deep copy of an inputs dict (None stays None)."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


# --------------------------------------------------------------------------- poison, bits
def poison_(t: torch.Tensor, seed: int = 1234) -> torch.Tensor:
    """Fill ``t`` in place with random bit patterns (NaN, inf, huge, tiny, negative zero...).

    For int tensors the values are random ints. Returns ``t``.
    """
    if t.numel() == 0:
        return t
    g = torch.Generator().manual_seed(seed)
    iv = _INT_VIEW[t.element_size()]
    info = torch.iinfo(iv)
    noise = torch.randint(info.min, info.max, t.shape, generator=g, dtype=torch.int64).to(iv)
    if t.is_floating_point():
        t.copy_(noise.view(t.dtype).to(t.device))
    else:
        t.copy_(noise.to(t.dtype).to(t.device))
    return t


def poison_rows_(t: torch.Tensor, rows, seed: int = 4321) -> torch.Tensor:
    """Poison (random bits) rows ``rows`` (indices along dim 0) of ``t`` in place; returns ``t``."""
    rows = torch.as_tensor(list(rows) if not isinstance(rows, torch.Tensor) else rows,
                           dtype=torch.int64, device=t.device)
    if rows.numel():
        t[rows] = poison_(torch.empty((rows.numel(),) + tuple(t.shape[1:]), dtype=t.dtype), seed).to(t.device)
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as an integer tensor of the same shape (NaN-safe equality)."""
    if t.is_floating_point():
        return t.contiguous().view(_INT_VIEW[t.element_size()])
    return t


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Assert same dtype, shape and identical bits; the message counts the differing elements."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = bits(actual).cpu(), bits(expected).cpu()
    if not torch.equal(a, e):
        diff = (a != e)
        first = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(diff.sum())} of {diff.numel()} elements differ in their bits; first at "
            f"{first}: {actual.cpu()[first].item()!r} != {expected.cpu()[first].item()!r}"
        )


# --------------------------------------------------------------------------- pool indices
def _pad_value(kind: str, P: int, null_slot_id, rng: random.Random) -> int:
    if kind == "negative":
        return rng.choice([-1, -1, -2, -7, -(2**31)])
    if kind == "oob":
        return rng.choice([P, P, P + 1, P + 13, 2**31 - 1])
    if kind == "null":
        assert null_slot_id is not None, "padding kind 'null' needs a null_slot_id"
        return null_slot_id
    raise AssertionError(f"unknown padding kind {kind!r}")


def build_pool_indices(
    kinds: list[str],
    P: int,
    *,
    null_slot_id: int | None = None,
    with_dst: bool = False,
    seed: int = 0,
    device="cpu",
):
    """Race-free pool indices with one lane per entry of ``kinds``.

    Lane kinds: ``"live"`` (reads a real row and writes one), ``"live_nodst"`` (reads a real row,
    its destination is padding so it writes nothing; only with ``with_dst``), and the padding
    kinds ``"negative"``, ``"oob"`` (``>= P``), ``"null"`` (``== null_slot_id``). Live lanes get
    distinct destination rows; a live lane reads either its own destination row (in place) or a
    row no lane writes (shared reads allowed), so no lane writes a row another live lane reads.
    Live lanes that do not fit in the pool become ``"negative"`` padding. Padding lanes' dst are
    random values, in range or not, as a padded batch may leave them: they must write nothing.

    Returns ``(src, dst, kinds)``: int32 (B,) tensors (``dst`` None without ``with_dst``) and the
    lane kinds actually used.
    """
    rng = random.Random(seed)
    kinds = list(kinds)
    usable = [r for r in range(P) if r != null_slot_id]
    rng.shuffle(usable)
    if not with_dst:
        kinds = ["live" if k == "live_nodst" else k for k in kinds]
    writers = [b for b, k in enumerate(kinds) if k == "live"]
    for b in writers[len(usable):]:
        kinds[b] = "negative"
    writers = writers[: len(usable)]
    dst_rows = {b: usable[i] for i, b in enumerate(writers)}
    readonly = usable[len(writers):]  # rows nobody writes

    src, dst = [0] * len(kinds), [0] * len(kinds)
    for b, k in enumerate(kinds):
        if k == "live":
            dst[b] = dst_rows[b]
            src[b] = dst[b] if (not with_dst or not readonly or rng.random() < 0.5) else rng.choice(readonly)
        elif k == "live_nodst":
            if readonly:
                src[b] = rng.choice(readonly)
                dst[b] = _pad_value(rng.choice([p for p in PAD_KINDS if p != "null" or null_slot_id is not None]),
                                    P, null_slot_id, rng)
            else:
                kinds[b] = "negative"
        if kinds[b] in PAD_KINDS:
            src[b] = _pad_value(kinds[b], P, null_slot_id, rng)
            dst[b] = rng.choice([rng.randrange(-3, P + 3) if P else -1, src[b]])
    src_t = torch.tensor(src, dtype=torch.int32, device=device)
    dst_t = torch.tensor(dst, dtype=torch.int32, device=device) if with_dst else None
    return src_t, dst_t, kinds


def make_pool_indices(
    B: int,
    P: int,
    *,
    n_pad: int,
    layout: str = "interleaved",
    pad_kinds=PAD_KINDS,
    null_slot_id: int | None = None,
    with_dst: bool = False,
    nodst_fraction: float = 0.2,
    seed: int = 0,
    device="cpu",
):
    """Pool indices for ``B`` lanes, ``n_pad`` of them padding (cycling through ``pad_kinds``).

    ``layout``: ``"trailing"`` puts the padding lanes after the live ones (a padded CUDA-graph
    batch), ``"interleaved"`` shuffles them among the live lanes. With ``with_dst`` about
    ``nodst_fraction`` of the live lanes get a padding destination. Returns what
    :func:`build_pool_indices` returns.
    """
    rng = random.Random(seed)
    n_live = B - n_pad
    live = ["live_nodst" if with_dst and rng.random() < nodst_fraction else "live" for _ in range(n_live)]
    pads = [pad_kinds[i % len(pad_kinds)] for i in range(n_pad)]
    if layout == "trailing":
        kinds = live + pads
    elif layout == "interleaved":
        kinds = live + pads
        rng.shuffle(kinds)
    else:
        raise AssertionError(f"unknown layout {layout!r}")
    return build_pool_indices(kinds, P, null_slot_id=null_slot_id, with_dst=with_dst,
                              seed=seed + 1, device=device)


def read_rows(src: torch.Tensor, P: int, null_slot_id=None) -> set[int]:
    """The pool rows live lanes read."""
    return {v for v in src.tolist() if 0 <= v < P and v != null_slot_id}


# --------------------------------------------------------------------------- expected results
def gather_dense_scatter(
    inputs: dict,
    src: torch.Tensor,
    dst: torch.Tensor | None,
    *,
    null_slot_id: int | None = None,
    update_kv_state: bool = False,
    step_fn=None,
    **step_kwargs,
) -> dict:
    """Expected pool-mode result, the way SPEC.md defines it, without touching ``inputs``.

    Gathers the live lanes' rows out of the pools with torch indexing, runs ``step_fn``
    (default ``mamba3_step_fn``) in dense mode on them (in place on the gathered copies, with
    ``update_kv_state``), scatters the new rows back into clones of the pools for lanes whose
    destination is a real row, and builds ``out`` with exact zeros for padding lanes.

    Returns a dict with ``out``, ``state``, ``Bstate``, ``Xstate`` (the expected tensors).
    """
    if step_fn is None:
        from mamba3_step import mamba3_step_fn as step_fn
    P = inputs["state"].shape[0]

    def real(v: int) -> bool:
        return 0 <= v < P and v != null_slot_id

    s = src.tolist()
    d = s if dst is None else dst.tolist()
    lanes = [b for b, v in enumerate(s) if real(v)]
    dev = inputs["x"].device
    lane_t = torch.tensor(lanes, dtype=torch.int64, device=dev)
    row_t = torch.tensor([s[b] for b in lanes], dtype=torch.int64, device=dev)

    g_state = inputs["state"][row_t]
    g_Bstate = inputs["Bstate"][row_t]
    g_Xstate = inputs["Xstate"][row_t]
    per_lane = {k: (None if inputs[k] is None else inputs[k][lane_t])
                for k in ("A", "B", "C", "x", "dt", "trap", "z")}
    shared = {k: inputs[k] for k in ("D", "xproj", "outproj", "zproj")}
    dense_out = step_fn(g_state, g_Bstate, g_Xstate, update_kv_state=update_kv_state,
                        **per_lane, **shared, **step_kwargs)

    x = inputs["x"]
    out_shape = (x.shape[0],) + tuple(dense_out.shape[1:])
    out = torch.zeros(out_shape, dtype=x.dtype, device=dev)
    out[lane_t] = dense_out
    exp = {"out": out, "state": inputs["state"].clone(), "Bstate": inputs["Bstate"].clone(),
           "Xstate": inputs["Xstate"].clone()}
    for i, b in enumerate(lanes):
        if real(d[b]):
            exp["state"][d[b]] = g_state[i]
            if update_kv_state:
                exp["Bstate"][d[b]] = g_Bstate[i]
                exp["Xstate"][d[b]] = g_Xstate[i]
    return exp


POOL_STATE_KEYS = ("state", "Bstate", "Xstate")


def check_pool_parity(
    inputs: dict,
    src: torch.Tensor,
    dst: torch.Tensor | None,
    kinds: list[str],
    *,
    null_slot_id: int | None = None,
    update_kv_state: bool = False,
    seed: int = 0,
    step_fn=None,
) -> None:
    """Assert that a pool-mode call is bit-identical to :func:`gather_dense_scatter`.

    ``inputs`` (from :func:`make_inputs`), ``src``/``dst``/``kinds`` (from
    :func:`make_pool_indices` or :func:`build_pool_indices`) are not modified. Rows that no
    live lane reads are poisoned first (random bits), ``out`` is poisoned before the call. Then,
    bit for bit: out, state, Bstate, Xstate equal the gather -> dense -> scatter result;
    padding lanes' out is +0.0; rows no live lane writes are unchanged (and Bstate/Xstate
    entirely without ``update_kv_state``); indices and per-lane inputs are unchanged.
    ``step_fn`` (default ``mamba3_step_fn``) runs both the pool call and the dense twin.
    """
    if step_fn is None:
        from mamba3_step import mamba3_step_fn as step_fn
    inputs = clone_inputs(inputs)
    P = inputs["state"].shape[0]
    unread = sorted(set(range(P)) - read_rows(src, P, null_slot_id))
    for i, key in enumerate(POOL_STATE_KEYS):
        poison_rows_(inputs[key], unread, seed=seed * 7 + i)
    before = clone_inputs(inputs)

    expected = gather_dense_scatter(inputs, src, dst, null_slot_id=null_slot_id,
                                    update_kv_state=update_kv_state, step_fn=step_fn)

    out = poison_(torch.empty_like(expected["out"]), seed=seed + 99)
    src_before = src.clone()
    dst_before = None if dst is None else dst.clone()
    ret = step_fn(**inputs, out=out, state_batch_indices=src, dst_state_batch_indices=dst,
                  null_slot_id=null_slot_id, update_kv_state=update_kv_state)
    assert ret is out, "the function must return the out it was given"

    assert_bits_equal(out, expected["out"], "out")
    for key in POOL_STATE_KEYS:
        assert_bits_equal(inputs[key], expected[key], key)

    # Independent of the twin: padding lanes give +0.0 bits, unwritten rows keep their bits.
    pad = torch.tensor([k in PAD_KINDS for k in kinds], dtype=torch.bool, device=out.device)
    assert_bits_equal(out[pad], torch.zeros_like(out[pad]), "padding lanes' out")
    written = {d for k, d in zip(kinds, (src if dst is None else dst).tolist()) if k == "live"}
    untouched = torch.tensor(sorted(set(range(P)) - written), dtype=torch.int64, device=out.device)
    for key in POOL_STATE_KEYS:
        if key != "state" and not update_kv_state:
            assert_bits_equal(inputs[key], before[key], f"{key} (no update_kv_state)")
        assert_bits_equal(inputs[key][untouched], before[key][untouched], f"{key} untouched rows")
    assert torch.equal(src, src_before), "state_batch_indices was modified"
    if dst is not None:
        assert torch.equal(dst, dst_before), "dst_state_batch_indices was modified"
    for key, value in inputs.items():
        if key not in POOL_STATE_KEYS and value is not None:
            assert_bits_equal(value, before[key], f"{key} (read-only input)")


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(name="make_inputs")
def _make_inputs_fixture():
    return make_inputs


@pytest.fixture(name="make_pool_indices")
def _make_pool_indices_fixture():
    return make_pool_indices


@pytest.fixture(name="poison_")
def _poison_fixture():
    return poison_


@pytest.fixture(name="gather_dense_scatter")
def _gather_dense_scatter_fixture():
    return gather_dense_scatter


@pytest.fixture(name="check_pool_parity")
def _check_pool_parity_fixture():
    return check_pool_parity
