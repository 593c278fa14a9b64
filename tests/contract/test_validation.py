"""Every bad input of docs/contract.md's list gets the right exception type, naming the argument, with
expected vs got; validate_indices catches out-of-range, duplicate-destination and overlap cases."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import assert_bits_equal, clone_inputs, gather_dense_scatter, make_inputs

from mamba3_step import StepSpec, mamba3_step_fn
from mamba3_step.contract import SUPPORTED_D, SUPPORTED_N, SUPPORTED_R
from mamba3_step.tensors import StepTensors
from mamba3_step.tiling import launch_cluster
from mamba3_step.validation import check_indices, check_step_inputs

NB, P, H, DH, N, R = 4, 6, 2, 64, 32, 2
TENSOR_ARGS = ("state", "Bstate", "Xstate", "A", "B", "C", "D", "x", "dt", "trap", "xproj",
               "outproj", "z", "zproj")


def pool_call(**overrides) -> dict:
    """Valid pool-mode keyword arguments (with out and dst indices), then ``overrides``."""
    kw = make_inputs(NB, P, H, DH, N, R, seed=77)
    kw["out"] = torch.empty(NB, H, DH, dtype=torch.bfloat16)
    kw["state_batch_indices"] = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    kw["dst_state_batch_indices"] = torch.tensor([3, 4, 5, -1], dtype=torch.int32)
    kw.update(overrides)
    return kw


def dense_call(**overrides) -> dict:
    kw = make_inputs(NB, None, H, DH, N, R, seed=78)
    kw["state_out"] = torch.empty_like(kw["state"])
    kw.update(overrides)
    return kw


def names(arg: str) -> str:
    """Regex: the message names ``arg`` as a whole word (so 'state' does not match 'Bstate')."""
    return rf"(?<![A-Za-z0-9_]){re.escape(arg)}(?![A-Za-z0-9_])"


def raises(exc, arg, kw, *also):
    with pytest.raises(exc) as info:
        mamba3_step_fn(**kw)
    msg = str(info.value)
    assert re.search(names(arg), msg), f"message does not name {arg!r}: {msg}"
    for word in also:
        assert word in msg, f"message lacks {word!r}: {msg}"
    return msg


def test_the_valid_base_calls_pass():
    # Guard: the mutations below each break exactly one thing of a call that works.
    mamba3_step_fn(**pool_call())
    mamba3_step_fn(**dense_call())
    spec = check_step_inputs(StepTensors(**pool_call()), update_kv_state=True)
    assert spec == StepSpec(dstate=N, headdim=DH, mimo=R, pool=True, has_dst=True,
                            update_kv_state=True).with_default_tiling()
    assert spec.tile_D == DH and spec.num_warps > 0


# --------------------------------------------------------------------------- kinds of argument
def test_non_tensor_argument():
    raises(TypeError, "x", pool_call(x=[[1.0]]), "expected", "got")
    raises(TypeError, "zproj", pool_call(zproj=3.0), "expected", "got")


# --------------------------------------------------------------------------- ranks and shapes
@pytest.mark.parametrize("arg", TENSOR_ARGS + ("out", "state_batch_indices", "dst_state_batch_indices"))
def test_wrong_rank(arg):
    kw = pool_call()
    kw[arg] = kw[arg].unsqueeze(0)
    raises(ValueError, arg, kw, "expected", "got")


@pytest.mark.parametrize("arg", [a for a in TENSOR_ARGS if a not in ("x", "B")]
                         + ["out", "state_batch_indices", "dst_state_batch_indices"])
def test_wrong_size(arg):
    # The last dimension is always one of the letters (H, D, N or B) the others must agree on.
    kw = pool_call()
    t = kw[arg]
    kw[arg] = torch.zeros(t.shape[:-1] + (t.shape[-1] + 1,), dtype=t.dtype)
    raises(ValueError, arg, kw, "expected", "got")


def test_wrong_size_of_the_letter_sources():
    # x and B define B, H, D / R, N: a bad one is reported on the first tensor that disagrees,
    # and the message says where the letters come from.
    kw = pool_call(x=torch.zeros(NB + 1, H, DH, dtype=torch.bfloat16))
    raises(ValueError, "B", kw, "taken from x")
    kw = pool_call(B=torch.zeros(NB, R, H, N + 1, dtype=torch.bfloat16))
    raises(ValueError, "state", kw, "from B")


def test_wrong_size_state_out_dense():
    kw = dense_call(state_out=torch.empty(NB, H, DH, N + 4))
    raises(ValueError, "state_out", kw, "expected", "got")


@pytest.mark.parametrize("bad,listing", [
    (dict(N=48), str(SUPPORTED_N)), (dict(DH=48), str(SUPPORTED_D)), (dict(R=3), str(SUPPORTED_R)),
    (dict(N=16), str(SUPPORTED_N)), (dict(DH=256), str(SUPPORTED_D)), (dict(R=16), str(SUPPORTED_R)),
])
def test_unsupported_N_D_R_lists_the_supported_sets(bad, listing):
    dims = {**dict(N=N, DH=DH, R=R), **bad}
    kw = make_inputs(NB, P, H, dims["DH"], dims["N"], dims["R"], seed=1)
    kw["state_batch_indices"] = torch.arange(NB, dtype=torch.int32)
    letter = {"N": "N", "DH": "D", "R": "R"}[next(iter(bad))]
    raises(ValueError, letter, kw, listing, "got")


# --------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("arg,dtype", [
    ("state", torch.float64), ("B", torch.float64), ("x", torch.float64), ("xproj", torch.float64),
    ("state", torch.int32), ("x", torch.int16),
])
def test_unsupported_dtype_lists_the_supported_ones(arg, dtype):
    kw = pool_call()
    kw[arg] = kw[arg].to(dtype)
    raises(TypeError, arg, kw, "float32", "bfloat16", "float16", "got")


@pytest.mark.parametrize("arg,ref", [
    ("C", "B"), ("Bstate", "B"), ("Xstate", "x"), ("z", "x"), ("out", "x"),
    ("zproj", "xproj"), ("outproj", "xproj"),
])
def test_mismatched_dtype_within_a_group(arg, ref):
    kw = pool_call()
    other = torch.float16 if kw[ref].dtype != torch.float16 else torch.bfloat16
    kw[arg] = kw[arg].to(other)
    raises(TypeError, arg, kw, "expected", "got", f"same as {ref}")


def test_state_out_dtype_must_match_state():
    raises(TypeError, "state_out", dense_call(state_out=torch.empty(NB, H, DH, N, dtype=torch.bfloat16)),
           "same as state")


@pytest.mark.parametrize("arg", ["A", "dt", "trap", "D"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fp32_only_scalars(arg, dtype):
    kw = pool_call()
    kw[arg] = kw[arg].to(dtype)
    raises(TypeError, arg, kw, "float32", "got")


@pytest.mark.parametrize("arg", ["state_batch_indices", "dst_state_batch_indices"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.int16])
def test_indices_must_be_int32(arg, dtype):
    kw = pool_call()
    kw[arg] = kw[arg].to(dtype)
    raises(TypeError, arg, kw, "int32", "got")


# --------------------------------------------------------------------------- devices, strides
@pytest.mark.parametrize("arg", ["D", "state", "z", "out", "state_batch_indices", "xproj"])
def test_tensor_on_another_device(arg):
    # The meta device stands in for a second device on a CPU-only machine.
    kw = pool_call()
    kw[arg] = kw[arg].to("meta")
    raises(ValueError, arg, kw, "meta", "cpu")


def _strided_copy(t: torch.Tensor) -> torch.Tensor:
    """The same values with innermost stride 2."""
    wide = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)
    view = wide[..., ::2]
    view.copy_(t)
    return view


@pytest.mark.parametrize("arg", ["state", "Bstate", "Xstate", "B", "C", "x", "z", "xproj", "A", "D",
                                 "out", "state_batch_indices"])
def test_non_unit_innermost_stride(arg):
    kw = pool_call()
    kw[arg] = _strided_copy(kw[arg])
    raises(ValueError, arg, kw, "innermost stride 1")


@pytest.mark.parametrize("arg", ["B", "state", "Xstate", "out"])
def test_a_row_spanning_more_than_2_31_elements_is_refused(arg):
    """Below the first dimension the kernel uses 32-bit offsets: a view whose row spans more than
    2**31 - 1 elements (here a huge stride in the second dimension, on the meta device so nothing
    is allocated) is refused before anything is launched."""
    kw = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in pool_call().items()}
    t = kw[arg]
    strides = list(t.stride())
    strides[1] = 2**31
    kw[arg] = torch.empty_strided(t.shape, strides, dtype=t.dtype, device="meta")
    raises(ValueError, arg, kw, "32-bit offsets")
    strides[1] = 2**31 // (t.shape[1] - 1) // 2  # a large stride whose span still fits
    kw[arg] = torch.empty_strided(t.shape, strides, dtype=t.dtype, device="meta")
    check_step_inputs(StepTensors(**kw), update_kv_state=True)


def test_state_base_pointer_not_16_byte_aligned():
    kw = pool_call()
    flat = torch.empty(kw["state"].numel() + 1)
    kw["state"] = flat[1:].view(kw["state"].shape).copy_(kw["state"])  # 4 bytes past 16-byte alignment
    raises(ValueError, "state", kw, "16")


@pytest.mark.parametrize("state_dtype,pad_elems", [("float32", 1), ("float32", 2), ("bfloat16", 4)])
def test_state_row_stride_not_16_byte_multiple(state_dtype, pad_elems):
    kw = pool_call()
    st = kw["state"].to(getattr(torch, state_dtype))
    padded = torch.zeros(st.shape[:-1] + (N + pad_elems,), dtype=st.dtype)[..., :N]
    kw["state"] = padded.copy_(st)
    raises(ValueError, "state", kw, "16 bytes")


def test_state_out_not_aligned():
    kw = dense_call()
    padded = torch.zeros(NB, H, DH, N + 1)[..., :N]
    raises(ValueError, "state_out", dict(kw, state_out=padded), "16 bytes")


@pytest.mark.parametrize("state_dtype,pad_elems", [("float32", 4), ("bfloat16", 8)])
def test_padded_but_aligned_state_is_accepted_and_correct(state_dtype, pad_elems):
    # A pool with padded rows (16-byte multiple) is legal; results equal the contiguous pool's.
    kw = pool_call()
    kw["state"] = kw["state"].to(getattr(torch, state_dtype))
    padded = torch.full(kw["state"].shape[:-1] + (N + pad_elems,), float("nan"),
                        dtype=kw["state"].dtype)
    view = padded[..., :N]
    view.copy_(kw["state"])
    contiguous = clone_inputs(kw)
    mamba3_step_fn(**contiguous)
    mamba3_step_fn(**dict(kw, state=view))
    assert_bits_equal(view, contiguous["state"], "state")
    assert_bits_equal(kw["out"], contiguous["out"], "out")
    assert bool(padded[..., N:].isnan().all()), "the padding columns were written"


# --------------------------------------------------------------------------- modes and options
def test_state_out_in_pool_mode():
    kw = pool_call(state_out=torch.empty(NB, H, DH, N))
    raises(ValueError, "state_out", kw, "pool mode")


def test_dst_indices_without_src_indices():
    kw = dense_call(dst_state_batch_indices=torch.arange(NB, dtype=torch.int32))
    raises(ValueError, "dst_state_batch_indices", kw, "state_batch_indices")


def test_null_slot_id_without_pool_mode():
    raises(ValueError, "null_slot_id", dense_call(null_slot_id=0), "got 0")


@pytest.mark.parametrize("value", [1.0, True, "0", torch.tensor(0)])
def test_null_slot_id_must_be_an_int(value):
    raises(TypeError, "null_slot_id", pool_call(null_slot_id=value), "int", "got")


def test_null_slot_id_must_fit_int32():
    raises(ValueError, "null_slot_id", pool_call(null_slot_id=2**31), "int32")


@pytest.mark.parametrize("given,missing", [("z", "zproj"), ("zproj", "z")])
def test_z_and_zproj_come_together(given, missing):
    kw = pool_call()
    kw[missing] = None
    raises(ValueError, missing, kw, given)


def test_update_kv_state_with_tile_D_below_headdim():
    # D / tile_D CTAs a (lane, head), launched as one cluster: at most 8
    for tile_D in (DH // 2, DH // 8):
        spec = check_step_inputs(StepTensors(**pool_call()), update_kv_state=True, tile_D=tile_D)
        assert spec.tile_D == tile_D and spec.update_kv_state and launch_cluster(spec) == (1, 1, DH // tile_D)
    msg = raises(ValueError, "tile_D", pool_call(update_kv_state=True, tile_D=DH // 16), "update_kv_state")
    assert "cluster" in msg and f"tile_D={DH // 16}" in msg and f"tile_D >= {DH // 8}" in msg
    # The same tile without update_kv_state is accepted: the user's choice is kept as given.
    spec = check_step_inputs(StepTensors(**pool_call()), tile_D=DH // 16, num_warps=1)
    assert spec.tile_D == DH // 16 and launch_cluster(spec) is None


@pytest.mark.parametrize("tile_D", [0, -64, 24, 128])
def test_impossible_tile_D(tile_D):
    raises(ValueError, "tile_D", pool_call(tile_D=tile_D), "got")


@pytest.mark.parametrize("num_warps", [0, 3, 32])
def test_impossible_num_warps(num_warps):
    raises(ValueError, "num_warps", pool_call(num_warps=num_warps), "got")


def test_num_warps_too_many_for_a_small_tile():
    # N=32 fp32: 8 threads per row, 4 rows per warp; 16 warps cover 64 rows per pass > tile_D=32.
    raises(ValueError, "tile_D", pool_call(tile_D=32, num_warps=16), "num_warps")


@pytest.mark.parametrize("arg,value", [("tile_D", 64.0), ("num_warps", "4"), ("tile_D", True)])
def test_tiling_options_must_be_ints(arg, value):
    raises(TypeError, arg, pool_call(**{arg: value}), "int", "got")


def test_update_kv_state_must_be_a_bool():
    raises(TypeError, "update_kv_state", pool_call(update_kv_state=1), "bool")


# --------------------------------------------------------------------------- launch grid
def test_batch_too_large_for_the_launch_grid():
    # Expanded (stride-0) views give a batch of 2**31 lanes without allocating it.
    nb = 2**31
    small = make_inputs(1, None, 1, 32, 32, 1, seed=3)
    kw = dict(small)
    for k in ("state", "Bstate", "Xstate", "A", "B", "C", "x", "dt", "trap", "z"):
        kw[k] = small[k].expand((nb,) + tuple(small[k].shape[1:]))
    raises(ValueError, "x", kw, str(nb), str(2**31 - 1))


def test_too_many_heads_for_the_launch_grid():
    nh = 65536
    small = make_inputs(1, None, 1, 32, 32, 1, seed=4)
    kw = {}
    for k, v in small.items():
        if v is None:
            kw[k] = None
        elif k in ("A", "dt", "trap", "D"):  # H is their innermost dim: must be real memory
            kw[k] = v.repeat((1,) * (v.dim() - 1) + (nh,))
        else:
            hdim = {"Bstate": 2, "B": 2, "C": 2, "xproj": 1, "outproj": 1, "zproj": 1}.get(k, 1)
            shape = list(v.shape)
            shape[hdim] = nh
            kw[k] = v.expand(shape)
    raises(ValueError, "state", kw, str(nh), "65535")


# --------------------------------------------------------------------------- validate_indices
def _pool_indices_call(src, dst=None, null_slot_id=None):
    kw = pool_call(state_batch_indices=torch.tensor(src, dtype=torch.int32),
                   dst_state_batch_indices=None if dst is None else torch.tensor(dst, dtype=torch.int32),
                   null_slot_id=null_slot_id)
    return kw


@pytest.mark.parametrize("src,dst,arg,lanes", [
    ([0, 6, 2, -1], None, "state_batch_indices", "[1]"),  # src == P
    ([0, 1, 2, 2**31 - 1], None, "state_batch_indices", "[3]"),
    ([0, 1, 2, 3], [4, 5, 6, -1], "dst_state_batch_indices", "[2]"),  # dst == P
    ([0, 1, -1, -1], [0, 9, 3, 3], "dst_state_batch_indices", "[1]"),  # padding lanes' dst too
])
def test_validate_indices_out_of_range(src, dst, arg, lanes):
    kw = _pool_indices_call(src, dst)
    before = kw["state"].clone()
    msg = raises(ValueError, arg, dict(kw, validate_indices=True), lanes, "P=6")
    assert_bits_equal(kw["state"], before, "state after a rejected call")
    # Without validation the same call runs, treating >= P as padding.
    mamba3_step_fn(**kw)
    assert msg


@pytest.mark.parametrize("src,dst,lanes", [
    ([0, 1, 2, 3], [4, 4, 5, -1], "[0, 1]"),  # two live lanes share dst row 4
    ([0, 0, 2, 3], None, "[0, 1]"),  # in place, two lanes on one row
    ([1, 2, 3, 4], [5, 0, 5, 0], "[0, 1, 2, 3]"),
])
def test_validate_indices_duplicate_destination(src, dst, lanes):
    arg = "state_batch_indices" if dst is None else "dst_state_batch_indices"
    raises(ValueError, arg, dict(_pool_indices_call(src, dst), validate_indices=True), lanes, "share")


@pytest.mark.parametrize("src,dst,lanes", [
    ([0, 1, 2, 3], [1, 4, 5, -1], "[0]"),  # lane 0 writes row 1, which lane 1 reads
    ([0, 1, 2, 3], [5, 4, 3, 2], "[2, 3]"),  # lanes 2 and 3 swap rows
])
def test_validate_indices_overlap(src, dst, lanes):
    raises(ValueError, "dst_state_batch_indices", dict(_pool_indices_call(src, dst), validate_indices=True),
           lanes, "reads")


def test_validate_indices_accepts_legitimate_padding_and_matches():
    # Negative and null-slot padding, a padded dst, shared reads, in-place writes: all legal.
    src, dst = [0, -1, 2, 2], [0, 3, 4, -5]
    kw = _pool_indices_call(src, dst, null_slot_id=5)
    kw["state_batch_indices"][1] = 5  # the null slot
    expected = gather_dense_scatter(kw, kw["state_batch_indices"], kw["dst_state_batch_indices"],
                                    null_slot_id=5)
    check_indices(kw["state_batch_indices"], kw["dst_state_batch_indices"], P, 5)
    got = clone_inputs(kw)
    mamba3_step_fn(**got, validate_indices=True)
    assert_bits_equal(got["out"], expected["out"], "out")
    assert_bits_equal(got["state"], expected["state"], "state")


def test_validate_indices_refuses_under_graph_capture(monkeypatch):
    # No GPU here: pretend a capture is in progress to check the refusal path.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph"):
        check_indices(torch.tensor([0, 1], dtype=torch.int32), None, 4)


# --------------------------------------------------------------------------- messages that say what arrived
def test_numpy_bool_update_kv_state_is_refused_with_a_message_that_says_what_arrived():
    """Says which bool arrived: numpy's bool type is also called bool."""
    np = pytest.importorskip("numpy")
    msg = raises(TypeError, "update_kv_state", pool_call(update_kv_state=np.bool_(True)), "numpy")
    assert "got bool" not in msg


@pytest.mark.parametrize("value", ["no", 1, None])
def test_validate_indices_must_be_a_bool(value):
    """'no' used to switch the check on (any truthy value did)."""
    raises(TypeError, "validate_indices", dict(pool_call(), validate_indices=value), "bool", "got")


def test_numpy_integers_are_accepted_where_ints_are():
    np = pytest.importorskip("numpy")
    kw = _pool_indices_call([0, 1, 5, -1], [2, 3, 4, -1], null_slot_id=np.int64(5))
    mamba3_step_fn(**kw, tile_D=np.int32(DH), validate_indices=True)


@pytest.mark.parametrize("null_slot_id", [P, P + 3])
def test_validate_indices_accepts_a_null_slot_at_or_beyond_P(null_slot_id):
    """Lanes holding null_slot_id are padding whatever its value: never reported as 'indices >= P'."""
    src, dst = [0, null_slot_id, 2, -1], [3, 4, null_slot_id, -1]
    kw = _pool_indices_call(src, dst, null_slot_id=null_slot_id)
    expected = gather_dense_scatter(kw, kw["state_batch_indices"], kw["dst_state_batch_indices"],
                                    null_slot_id=null_slot_id)
    got = clone_inputs(kw)
    mamba3_step_fn(**got, validate_indices=True)
    assert_bits_equal(got["state"], expected["state"], "state")
    # a real out-of-range index next to it is still reported, and only that lane
    kw = _pool_indices_call([0, null_slot_id, P + 7, -1], None, null_slot_id=null_slot_id)
    raises(ValueError, "state_batch_indices", dict(kw, validate_indices=True), "[2]", f"P={P}")


def test_meta_tensors_in_pool_mode_are_validated_and_computed_as_shapes_only():
    """Used to fail inside the CPU path with an error naming no argument."""
    kw = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in pool_call().items()}
    out = mamba3_step_fn(**kw, update_kv_state=True)
    assert out is kw["out"] and out.device.type == "meta"
    kw["out"] = None
    assert mamba3_step_fn(**kw).shape == (NB, H, DH)
    raises(ValueError, "C", dict(kw, C=kw["C"][:, :, :1]), "expected shape")
    raises(TypeError, "B", dict(kw, B=kw["B"].float()), "expected dtype")
    raises(ValueError, "validate_indices", dict(kw, validate_indices=True), "meta")
