"""torch.ops.mamba3_step.step: schema (mutated tensors), fake impl, eager parity with
mamba3_step_fn, and a toy layer under torch.compile(fullgraph=True) on CPU (same bytes as eager).

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import pytest
import torch

import mamba3_step.ops  # noqa: F401  (registers the op)
from mamba3_step import mamba3_step_fn
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, poison_pool
from mamba3_step.ops import mamba3_step_op
from mamba3_step.serving import StatePool

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

H, D, N, R = 2, 32, 32, 2
P, NB = 9, 5


def _setup(seed, *, has_outproj=True, null_slot=False):
    g = torch.Generator().manual_seed(seed)
    pool = StatePool(1, P, H, D, N, R, reserve_null_slot=null_slot)
    poison_pool(pool, g)
    w = layer_weights(H, D, R, has_outproj=has_outproj, generator=g)
    inp = lane_inputs(NB, H, D, N, R, generator=g)
    slots = torch.tensor([6, -1, 2, 0, 8], dtype=torch.int32)
    dst = torch.tensor([4, 3, 2, 1, -1], dtype=torch.int32)
    return pool, w, inp, slots, dst


def test_schema_declares_mutated_tensors_and_returns_nothing():
    schema = torch.ops.mamba3_step.step.default._schema
    mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    ring = {f"replay_ring_{f}" for f in ("B", "x", "coef", "length", "offset", "drawn_for", "angle")}
    assert mutated == {"state", "Bstate", "Xstate", "state_out", "out", "angle_state", "state_scale"} | ring
    assert len(schema.returns) == 0
    by_name = {a.name: a for a in schema.arguments}
    assert str(by_name["state_out"].type) == "Optional[Tensor]"
    assert str(by_name["out"].type) == "Tensor"  # required: a custom op cannot return an input alias


@pytest.mark.parametrize("has_outproj", [True, False])
@pytest.mark.parametrize("with_dst", [False, True])
def test_op_matches_mamba3_step_fn_bytes(has_outproj, with_dst):
    pool, w, inp, slots, dst = _setup(1, has_outproj=has_outproj)
    st, bs, xs = pool.layer_tensors(0)
    ref_pool = [t.clone() for t in (st, bs, xs)]
    kw = dict(state_batch_indices=slots, dst_state_batch_indices=dst if with_dst else None, update_kv_state=True)
    args = (inp["A"], inp["B"], inp["C"], w["D"], inp["x"], inp["dt"], inp["trap"], w["xproj"], w["outproj"])
    ref = mamba3_step_fn(*ref_pool, *args, z=inp["z"], zproj=w["zproj"], **kw)
    out = mamba3_step_op(st, bs, xs, *args, z=inp["z"], zproj=w["zproj"], **kw)
    assert bits_equal(out, ref)
    for a, b in zip((st, bs, xs), ref_pool):
        assert bits_equal(a, b)
    # a caller-provided out is written in place and returned
    out2 = torch.full_like(out, float("nan"))
    st2 = [t.clone() for t in ref_pool]
    got = mamba3_step_op(*st2, *args, None, out2, inp["z"], w["zproj"], **{**kw, "update_kv_state": False})
    assert got is out2 and not torch.isnan(out2.float()).any()


def test_op_dense_mode_with_state_out():
    pool, w, inp, _, _ = _setup(2)
    g = torch.Generator().manual_seed(3)
    st = torch.randn(NB, H, D, N, generator=g)
    bs = torch.randn(NB, R, H, N, generator=g).to(torch.bfloat16)
    xs = torch.randn(NB, H, D, generator=g).to(torch.bfloat16)
    args = (inp["A"], inp["B"], inp["C"], w["D"], inp["x"], inp["dt"], inp["trap"], w["xproj"], w["outproj"])
    so_ref = torch.full_like(st, float("nan"))
    ref = mamba3_step_fn(st.clone(), bs.clone(), xs.clone(), *args, so_ref, None, inp["z"], w["zproj"])
    st0 = st.clone()
    so = torch.full_like(st, float("nan"))
    out = mamba3_step_op(st, bs, xs, *args, so, None, inp["z"], w["zproj"])
    assert bits_equal(out, ref) and bits_equal(so, so_ref)
    assert bits_equal(st, st0)  # state_out received the new state, state is untouched


def test_opcheck_schema_and_fake():
    pool, w, inp, slots, dst = _setup(4)
    st, bs, xs = pool.layer_tensors(0)
    out = torch.empty(NB, H, D, dtype=torch.bfloat16)
    args = (st.clone(), bs.clone(), xs.clone(), inp["A"], inp["B"], inp["C"], w["D"], inp["x"], inp["dt"],
            inp["trap"], w["xproj"], out, w["outproj"], None, inp["z"], w["zproj"], slots, dst, None)
    options = dict(update_kv_state=True, tile_D=None, num_warps=None, validate_indices=False)  # by keyword
    torch.library.opcheck(torch.ops.mamba3_step.step.default, args, options,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


class ToyLayer(torch.nn.Module):
    """A Mamba-3 layer's decode step around the op: hidden -> x (exact ops), step, residual.

    hidden (B, H*D) fp32 -> x (B, H, D) bf16; out (B, H, D) bf16 -> hidden + out.
    Only correctly rounded element-wise ops surround the op, so eager and compiled
    bytes must agree exactly.
    """

    step = staticmethod(mamba3_step_op)

    def __init__(self, w):
        super().__init__()
        for k, v in w.items():
            self.register_buffer(k, v)

    def forward(self, state, Bstate, Xstate, slots, hidden, A, dt, trap, B, C, z):
        n = hidden.shape[0]
        x = (hidden * 0.5).to(torch.bfloat16).view(n, H, D)
        out = self.step(state, Bstate, Xstate, A, B, C, self.D, x, dt, trap, self.xproj, self.outproj,
                        z=z, zproj=self.zproj, state_batch_indices=slots, null_slot_id=0, update_kv_state=True)
        return hidden + out.float().reshape(n, H * D)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_toy_layer_fullgraph_same_bytes_as_eager(backend):
    torch._dynamo.reset()
    pool, w, inp, _, _ = _setup(5, null_slot=True)
    slots = torch.tensor([6, 0, 2, 7, 8], dtype=torch.int32)  # lane 1 is the null slot (padding)
    layer = ToyLayer(w)
    hidden = torch.randn(NB, H * D, generator=torch.Generator().manual_seed(6))
    tail = (slots, hidden, inp["A"], inp["dt"], inp["trap"], inp["B"], inp["C"], inp["z"])

    eager_pool = [t.clone() for t in pool.layer_tensors(0)]
    before = [t.clone() for t in pool.layer_tensors(0)]
    ref = layer(*eager_pool, *tail)

    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    got = compiled(*pool.layer_tensors(0), *tail)  # the pool's own (view) tensors, mutated in place
    assert bits_equal(got, ref)
    for a, b, c in zip(pool.layer_tensors(0), eager_pool, before):
        assert bits_equal(a, b)
        assert not bits_equal(a, c)  # the step did write the live rows
        assert bits_equal(a[[0, 1, 3, 4, 5]], c[[0, 1, 3, 4, 5]])  # null slot and unused rows untouched
    # a second step through the compiled layer keeps matching (state carried in the pool)
    ref2 = layer(*eager_pool, *tail)
    got2 = compiled(*pool.layer_tensors(0), *tail)
    assert bits_equal(got2, ref2)
    for a, b in zip(pool.layer_tensors(0), eager_pool):
        assert bits_equal(a, b)


# --------------------------------------------------------------------------- the op's messages say what arrived
def _call_args(seed=7):
    pool, w, inp, slots, dst = _setup(seed)
    st, bs, xs = (t.clone() for t in pool.layer_tensors(0))
    out = torch.zeros(NB, H, D, dtype=torch.bfloat16)
    args = [st, bs, xs, inp["A"], inp["B"], inp["C"], w["D"], inp["x"], inp["dt"], inp["trap"], w["xproj"], out,
            w["outproj"], None, inp["z"], w["zproj"], slots, dst]
    return args


@pytest.mark.parametrize("option,value", [("null_slot_id", True), ("update_kv_state", 1),
                                          ("validate_indices", 1), ("tile_D", True), ("num_warps", 4.0)])
def test_op_refuses_what_mamba3_step_fn_refuses(option, value):
    """The dispatcher used to turn null_slot_id=True into 1 and update_kv_state=1 into True."""
    args = _call_args()
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    kw = {option: value}
    with pytest.raises(TypeError, match=rf"^{option}: expected") as direct:
        torch.ops.mamba3_step.step(*args, **kw)
    names = ("state", "Bstate", "Xstate", "A", "B", "C", "D", "x", "dt", "trap", "xproj", "out", "outproj",
             "state_out", "z", "zproj", "state_batch_indices", "dst_state_batch_indices")
    call = dict(zip(names, args))
    with pytest.raises(TypeError) as wrapped:
        mamba3_step_op(**call, **kw)
    with pytest.raises(TypeError) as fn:
        mamba3_step_fn(**call, **kw)
    assert str(direct.value) == str(wrapped.value) == str(fn.value)
    after = [a for a in args if isinstance(a, torch.Tensor)]
    assert all(bits_equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("option,value", [("null_slot_id", 2**70), ("tile_D", 2**70), ("num_warps", 2**64),
                                          ("tile_D", -2**70), ("null_slot_id", -2**63 - 1)])
def test_op_wrapper_names_an_int_option_beyond_64_bits(option, value):
    """The op's Scalar holds 64 bits: the dispatcher used to raise an unnamed OverflowError."""
    args = _call_args()
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    names = ("state", "Bstate", "Xstate", "A", "B", "C", "D", "x", "dt", "trap", "xproj", "out", "outproj",
             "state_out", "z", "zproj", "state_batch_indices", "dst_state_batch_indices")
    call = dict(zip(names, args))
    with pytest.raises(ValueError, match=rf"^({option}|tile_D/num_warps):") as wrapped:
        mamba3_step_op(**call, **{option: value})
    with pytest.raises(ValueError) as fn:
        mamba3_step_fn(**call, **{option: value})
    assert str(wrapped.value) == str(fn.value)
    after = [a for a in args if isinstance(a, torch.Tensor)]
    assert all(bits_equal(a, b) for a, b in zip(after, before))


def test_op_accepts_numpy_integers_like_mamba3_step_fn():
    np = pytest.importorskip("numpy")
    args = _call_args()
    names = ("state", "Bstate", "Xstate", "A", "B", "C", "D", "x", "dt", "trap", "xproj", "out", "outproj",
             "state_out", "z", "zproj", "state_batch_indices", "dst_state_batch_indices")
    call = dict(zip(names, args))
    ref = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in call.items()}
    mamba3_step_fn(**ref, null_slot_id=0, tile_D=D)
    mamba3_step_op(**call, null_slot_id=np.int64(0), tile_D=np.int32(D))
    assert bits_equal(call["out"], ref["out"]) and bits_equal(call["state"], ref["state"])


def test_op_refuses_a_write_target_defect_with_the_named_error_and_writes_nothing():
    args = _call_args()
    args[11] = args[11].requires_grad_(True)  # out
    before = [a.detach().clone() for a in args if isinstance(a, torch.Tensor)]
    with pytest.raises(ValueError, match="^out: expected a tensor that does not require grad"):
        torch.ops.mamba3_step.step(*args, update_kv_state=True)
    after = [a.detach() for a in args if isinstance(a, torch.Tensor)]
    assert all(bits_equal(a, b) for a, b in zip(after, before))


def test_mamba3_step_fn_under_fake_tensor_mode_validates_with_named_errors():
    """Used to fail inside the CPU path (a data-dependent nonzero) with an error naming nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _call_args()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        st, bs, xs, A, B, C, Dw, x, dt, trap, xproj, out, outproj, _, z, zproj, slots, dst = fake
        got = mamba3_step_fn(st, bs, xs, A, B, C, Dw, x, dt, trap, xproj, outproj, z=z, zproj=zproj,
                             state_batch_indices=slots, dst_state_batch_indices=dst, update_kv_state=True)
        assert tuple(got.shape) == (NB, H, D) and got.dtype == torch.bfloat16
        with pytest.raises(ValueError, match=r"^C: expected shape"):
            mamba3_step_fn(st, bs, xs, A, B, C[:, :, :1], Dw, x, dt, trap, xproj, outproj, z=z, zproj=zproj,
                           state_batch_indices=slots)
        with pytest.raises(TypeError, match=r"^update_kv_state: expected a bool"):
            mamba3_step_fn(st, bs, xs, A, B, C, Dw, x, dt, trap, xproj, outproj, z=z, zproj=zproj,
                           state_batch_indices=slots, update_kv_state=1)


class FnLayer(ToyLayer):
    """ToyLayer calling mamba3_step_fn itself (not the op wrapper)."""

    step = staticmethod(mamba3_step_fn)


def test_mamba3_step_fn_compiles_fullgraph_with_the_same_bytes_as_eager():
    """torch.compile(fullgraph=True) used to fail on mamba3_step_fn (only the op was traceable)."""
    torch._dynamo.reset()
    pool, w, inp, _, _ = _setup(8, null_slot=True)
    slots = torch.tensor([6, 0, 2, 7, 8], dtype=torch.int32)
    layer = FnLayer(w)
    hidden = torch.randn(NB, H * D, generator=torch.Generator().manual_seed(9))
    tail = (slots, hidden, inp["A"], inp["dt"], inp["trap"], inp["B"], inp["C"], inp["z"])
    eager_pool = [t.clone() for t in pool.layer_tensors(0)]
    ref = layer(*eager_pool, *tail)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = compiled(*pool.layer_tensors(0), *tail)
    assert bits_equal(got, ref)
    for a, b in zip(pool.layer_tensors(0), eager_pool):
        assert bits_equal(a, b)
    # a bad input inside the compiled function still gets the named error: dynamo reports the
    # fake implementation's ValueError inside its own exception (by text in newer torch, as the
    # cause in older)
    with pytest.raises(Exception) as info:
        compiled(*pool.layer_tensors(0), slots, hidden, inp["A"], inp["dt"], inp["trap"], inp["B"][:, :1],
                 inp["C"], inp["z"])
    chain, e = [], info.value
    while e is not None:
        chain.append(f"{type(e).__name__}({str(e)!r})")
        e = e.__cause__ or e.__context__
    assert any("Bstate: expected shape (P, R, H, N)" in c for c in chain[1:]) or \
        "ValueError('Bstate: expected shape (P, R, H, N)" in str(info.value), chain[:3]
