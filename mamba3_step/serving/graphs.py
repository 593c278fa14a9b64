"""``CudaGraphStepRunner``: a layer's decode step captured per batch-size bucket, replayed padded.

Letters (docs/contract.md): ``n`` live lanes, ``B`` bucket size, ``T`` tokens per lane, ``K``
candidate source rows per lane, ``P`` pool rows (slots), ``H`` heads, ``D`` head dim, ``N`` state
size, ``R`` MIMO rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from inspect import Parameter
from typing import NamedTuple

import torch

from ..ring import check_accepted
from ..contract import shown, source_rows
from ..signature import STEP_SIGNATURE, StepOptions, View, make_binder, view_fields, view_signature
from ..spec import MAX_TOKENS
from ..tensors import LANE_FIELDS, WEIGHT_FIELDS, StepTensors
from ..validation import check_options, check_step_inputs_cached
from ..validation.checks import check_is_tensor
from .buckets import (DEFAULT_BUCKETS, check_buckets, checked_capture_buckets, choose_bucket, lane_buffer, pad_lanes,
                      pad_slots)
from .hook import POOL_SUPPLIED, check_pool_step, decode_step, kv_update_in_kernel

__all__ = ["CudaGraphStepRunner", "DEFAULT_BUCKETS", "StepForm", "check_buckets", "choose_bucket", "pad_lanes",
           "pad_slots"]

class StepForm(NamedTuple):
    """The shapes of a step, part of a bucket's key: each (bucket, form) has its own static buffers and
    graph (and its own kernel specialisation: ``T``, like the index forms, is compile-time).

    ``tokens``: ``T``, per-lane inputs ``(n, T, ...)`` and ``out`` ``(n, T, ...)``; None: no token
    axis (the plain step; a token axis of ``T = 1`` is another form). ``candidates``: ``K``,
    ``slots`` ``(n, K)`` with ``num_accepted_tokens`` ``(n,)``; None: ``slots`` ``(n,)``.
    ``dst_per_token``: ``dst_slots`` ``(n, T)`` (a runner built ``with_dst``; else ``(n,)`` or none).
    ``accepted``: ``num_accepted_tokens`` ``(n,)`` beside ``slots`` ``(n,)`` (a replay pool's verify step
    committing its last drafts; docs/contract.md, "Replay").
    """

    tokens: int | None = None
    candidates: int | None = None
    dst_per_token: bool = False
    accepted: bool = False

    @classmethod
    def speculative(cls, T: int) -> "StepForm":
        """A verify step in vLLM's layout (``StatePool.spec_indices``): ``T`` tokens, ``(n, T)`` groups
        as sources with ``num_accepted_tokens``, ``(n, T)`` per-token destinations."""
        return cls(T, T, True)

    def problem(self, with_dst: bool) -> str:
        """Why a runner (``with_dst``) cannot capture this form, or ""."""
        def bad(v, top):
            return v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top)
        if bad(self.tokens, MAX_TOKENS):
            return f"tokens must be None or an int in [1, {MAX_TOKENS}], got {shown(self.tokens)}"
        if bad(self.candidates, 2**31 - 1):
            return f"candidates must be None or a positive int, got {shown(self.candidates)}"
        if not isinstance(self.dst_per_token, bool):
            return f"dst_per_token must be a bool, got {shown(self.dst_per_token)}"
        if self.dst_per_token and (self.tokens is None or not with_dst):
            return "dst_per_token needs tokens (a token axis) and a runner built with with_dst=True"
        if not isinstance(self.accepted, bool) or (self.accepted and self.candidates is not None):
            return f"accepted must be a bool, and False with candidates (groups), got {shown(self.accepted)}"
        return ""


PLAIN = StepForm()


def _form_of(x: torch.Tensor, slots: torch.Tensor, dst_slots, num_accepted_tokens) -> StepForm:
    """The form of a step's tensors (read before they are validated: a bad form finds no buffers)."""
    return StepForm(x.shape[1] if x.dim() == 4 else None, slots.shape[1] if slots.dim() == 2 else None,
                    isinstance(dst_slots, torch.Tensor) and dst_slots.dim() == 2,
                    num_accepted_tokens is not None and slots.dim() == 1)


#: the tensors a runner fixes at construction (its graphs read their storage): the layer's weights and,
#: with stochastic rounding, ``rand_seed`` (each step advances its offset in place, in the graph too)
_RUNNER_FIXED = (*WEIGHT_FIELDS, "rand_seed")
#: what a runner supplies itself: the pool's part, the tensors fixed at construction, its static
#: ``out`` and the options; :meth:`CudaGraphStepRunner.step` takes the rest, keyword-only
_STEP_VIEW = View(
    leading=(Parameter("self", Parameter.POSITIONAL_OR_KEYWORD),), promoted=("state_batch_indices",),
    supplied=POOL_SUPPLIED | set(_RUNNER_FIXED) | {"out"} | set(StepOptions._fields),
    renamed={"state_batch_indices": "slots", "dst_state_batch_indices": "dst_slots"}, keyword_only=True,
    trailing=(Parameter("clone", Parameter.KEYWORD_ONLY, default=True, annotation="bool"),))
_STEP_FIELDS = view_fields(_STEP_VIEW)
#: the step's declared arguments the runner copies into its buffers (any other must be None)
_STEP_HANDLED = frozenset(LANE_FIELDS) | {"state_batch_indices", "dst_state_batch_indices", "num_accepted_tokens"}
_bind_step = make_binder("step", view_signature(_STEP_VIEW))


#: the options a runner fixes at construction (the rest it decides: update_kv_state, validate_indices)
_RUNNER_OPTIONS = ("tile_D", "num_warps", "rotate_pairwise", "stochastic_rounding")
#: the constructor: the pool and layer, then (keyword-only) the layer's weights as declared (a new
#: weight field becomes a parameter by itself), the options it fixes, then its own settings
_INIT_VIEW = View(
    leading=(Parameter("self", Parameter.POSITIONAL_OR_KEYWORD),
             Parameter("pool", Parameter.POSITIONAL_OR_KEYWORD, annotation="StatePool"),
             Parameter("layer", Parameter.POSITIONAL_OR_KEYWORD, annotation="int")),
    supplied=frozenset(STEP_SIGNATURE.parameters) - set(_RUNNER_FIXED) - set(_RUNNER_OPTIONS), keyword_only=True,
    trailing=tuple(Parameter(name, Parameter.KEYWORD_ONLY, default=default, annotation=ann) for name, default, ann in (
        ("buckets", DEFAULT_BUCKETS, "Sequence[int]"), ("with_dst", False, "bool"), ("shared_bc", False, "bool"),
        ("use_cuda_graph", None, "bool | None"), ("graph_pool", None, "Any"))))
_INIT_NAMES = tuple(view_signature(_INIT_VIEW).parameters)
_bind_init = make_binder("CudaGraphStepRunner", view_signature(_INIT_VIEW))

class CudaGraphStepRunner:
    """Runs :func:`decode_step` for one layer at a fixed set of batch-size buckets.

    On CUDA (``use_cuda_graph`` default: the pool is on CUDA) each bucket's step is captured
    once into a CUDA graph over static buffers; :meth:`step` copies the live lanes' inputs
    into the smallest bucket ``>= n``, pads the slot list with ``pool.pad_id`` and the
    inputs with zeros, replays, and returns the first ``n`` lanes of ``out``. Padded lanes
    are padding to the kernel (``-1``, or the reserved null slot), so they touch no pool row.
    A step larger than the largest bucket runs eagerly, unpadded. On CPU the same static
    buffers and padding are used, without graphs, so server logic is testable anywhere.

    The layer's weights (``D`` ``(H,)`` fp32; ``xproj``/``zproj``/``outproj`` ``(R, H, D)``; the rotary
    ``B_bias``/``C_bias`` ``(R, H, N)`` fp32), the options ``tile_D``, ``num_warps``,
    ``rotate_pairwise`` and ``stochastic_rounding``, and with the latter ``rand_seed`` ``(2,)`` int64,
    are fixed at construction (the graph reads their storage: update them in place; each step,
    replayed or not, advances ``rand_seed``'s offset by T, as ``decode_step`` does). Per-step inputs: ``A``, ``dt``, ``trap`` ``(n, H)`` fp32; ``B``, ``C`` ``(n, R, H, N)``
    (``(n, R, 1, N)`` with ``shared_bc=True``); ``x`` (and ``z`` when ``zproj`` is given) ``(n, H, D)``;
    ``angle_proj`` ``(n, H, S)`` fp32 when the pool has rotary angles (``rope_angles=S``; the pool
    supplies ``angle_state``). An 8-bit pool (int8 / float8_e4m3fn) supplies ``state_scale`` the same
    way; its runner needs ``stochastic_rounding=True`` and ``rand_seed`` (else its steps and captures
    are refused). With ``with_dst=True`` a static destination-slot buffer is captured
    too and :meth:`step` takes ``dst_slots`` (prefix caching; a replay pool's verify step takes none).
    Capture happens lazily on first use of a bucket, or eagerly with :meth:`capture`.

    Multi-token steps (speculative decoding's verify pass): the per-lane inputs may carry a token
    axis, ``(n, T, ...)``, ``slots`` may be ``(n, K)`` with ``num_accepted_tokens`` ``(n,)``, and
    ``dst_slots`` ``(n, T)``. Each combination is a :class:`StepForm`, part of the bucket's key: a
    (bucket, form) pair has its own buffers and graph (``capture(form=StepForm.speculative(T))`` at
    start-up). A padded lane's slots row is all ``pool.pad_id``, its count 1, its destinations
    ``pool.pad_id``: padding. T-less steps are the form ``StepForm()``, unchanged.
    """

    def __init__(self, *args, **kwargs):
        a = dict(zip(_INIT_NAMES, _bind_init(self, *args, **kwargs)))
        pool, layer, use_cuda_graph = a["pool"], a["layer"], a["use_cuda_graph"]
        pool._layer(layer)
        self.pool = pool
        self.layer = layer
        self._weights = {name: a[name] for name in _RUNNER_FIXED}  # D, xproj, zproj, outproj, B_bias, C_bias, rand_seed
        options = check_options(**{name: a[name] for name in _RUNNER_OPTIONS})  # named errors, numpy ints
        self._options = {name: options[name] for name in _RUNNER_OPTIONS}  # tile_D, num_warps, ..., stochastic_rounding
        self.__dict__.update(self._weights, **self._options)  # each also an attribute: self.D, self.tile_D ...
        self.buckets = check_buckets(a["buckets"])
        self.with_dst, self.shared_bc = bool(a["with_dst"]), bool(a["shared_bc"])
        #: the optional per-lane inputs and whether this runner has a buffer for each (the rest: none)
        self._optional_lanes = {"z": self.zproj is not None, "angle_proj": pool.rope_angles > 0}
        is_cuda = pool.device.type == "cuda"
        if use_cuda_graph is None:
            use_cuda_graph = is_cuda
        if use_cuda_graph and not is_cuda:
            raise ValueError(f"use_cuda_graph: CUDA graphs need a CUDA pool, got device {pool.device}")
        self.use_cuda_graph = bool(use_cuda_graph)
        self.graph_pool = a["graph_pool"]
        if self.use_cuda_graph and self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        self._static: dict[tuple[int, StepForm], dict[str, torch.Tensor]] = {}
        self._graphs: dict[tuple[int, StepForm], torch.cuda.CUDAGraph] = {}

    def _check_step(self, key: tuple[int, StepForm], n: int, inputs: dict, slots, dst_slots,
                    num_accepted_tokens) -> None:
        """Validate the caller's lane tensors with the pool and weights, as ``mamba3_step_fn`` would.

        The index tensors are stood in for (they may live on another device: they are copied into
        the static buffers) by tensors of their shapes and dtypes on the pool's device: the bucket's
        static slices when they match, else fresh ones (before the bucket's first capture, or for a
        step that does not fit its form). A ``with_dst`` runner's default destination is ``(n,)``.
        Metadata only, through the validation cache: a repeated signature costs its guard and
        address checks, not the full validation (docs/performance.md, "Host overhead").
        """
        p, s = self.pool, self._static.get(key)

        def stand_in(name, t, shape=None):
            if shape is None and not isinstance(t, torch.Tensor):
                return t  # validation names it
            shape, dtype = (tuple(t.shape), t.dtype) if shape is None else (shape, torch.int32)
            buf = None if s is None else s.get(name)
            if buf is not None and tuple(buf[:n].shape) == shape and buf.dtype == dtype:
                return buf[:n]
            return torch.empty(shape, dtype=dtype, device=p.device)

        x = inputs["x"]
        token_axis = isinstance(x, torch.Tensor) and x.dim() == 4
        if dst_slots is not None:
            dst = stand_in("dst", dst_slots)
        else:  # a with_dst runner's default destination is (n,), but for a replay pool's verify step
            dst = stand_in("dst", None, (n,)) if self._default_dst(token_axis) else None
        nat = None if num_accepted_tokens is None else stand_in("nat", num_accepted_tokens)
        tensors = StepTensors(
            **p.layer_rows(self.layer), **{f: inputs.get(f) for f in LANE_FIELDS},
            **self._weights, out=None if s is None else s["out"][:n], state_batch_indices=stand_in("slots", slots),
            dst_state_batch_indices=dst, null_slot_id=p.null_slot_id, num_accepted_tokens=None if p.replay_ring else nat,
        )  # a replay pool's num_accepted_tokens commits drafts of its ring: checked below, not as a group's
        tokens = x.shape[1] if token_axis else 1
        in_kernel = kv_update_in_kernel(p.headdim, p.dstate, p.mimo, p.state_dtype, self.tile_D, tokens)
        check_step_inputs_cached(tensors, update_kv_state=in_kernel, **self._options)
        if p.replay_ring and nat is not None:  # a replay pool's accepted drafts: (n,) beside (n,) slots
            check_accepted(tensors, nat, "num_accepted_tokens")
        check_pool_step(p, self.layer, tensors, self.stochastic_rounding, in_kernel)  # what decode_step refuses

    def _default_dst(self, token_axis: bool) -> bool:
        """Whether a step without ``dst_slots`` gets the default destination (each lane's source row): with
        ``with_dst``, except a replay pool's verify step (a token axis), which keeps its drafts in the
        ring and takes no destination (as ``decode_step`` takes it)."""
        return self.with_dst and not (self.pool.replay_ring and token_axis)

    # static buffers -------------------------------------------------------------------
    def _make_static(self, bucket: int, form: StepForm) -> dict[str, torch.Tensor]:
        p, dev = self.pool, self.pool.device
        H, Dh, R = p.nheads, p.headdim, p.mimo
        lanes = (bucket,) if form.tokens is None else (bucket, form.tokens)
        s = {"slots": torch.full((bucket,) + ((form.candidates,) if form.candidates else ()), p.pad_id,
                                 dtype=torch.int32, device=dev)}
        for name in LANE_FIELDS:
            if self._optional_lanes.get(name, name not in StepTensors._field_defaults):
                shape, dtype = lane_buffer(p, name, self.shared_bc)
                s[name] = torch.zeros(lanes + shape, dtype=dtype, device=dev)
        if form.candidates or form.accepted:
            s["nat"] = torch.ones((bucket,), dtype=torch.int32, device=dev)
        if self._default_dst(form.tokens is not None):
            dst_shape = (bucket, form.tokens) if form.dst_per_token else (bucket,)
            s["dst"] = torch.full(dst_shape, p.pad_id, dtype=torch.int32, device=dev)
        out_shape = lanes + ((H, Dh) if self.outproj is not None else (R, H, Dh))
        s["out"] = torch.zeros(out_shape, dtype=p.x_dtype, device=dev)
        return s

    def _run(self, s: dict[str, torch.Tensor]) -> torch.Tensor:
        return decode_step(
            self.pool, self.layer, s["slots"], **{f: s.get(f) for f in LANE_FIELDS}, **self._weights,
            dst_slots=s.get("dst"), num_accepted_tokens=s.get("nat"), out=s["out"], **self._options,
        )

    def capture(self, buckets: Sequence[int] | None = None, form: StepForm | None = None) -> None:
        """Build static buffers (and, on CUDA, capture graphs) for ``buckets`` (default: all) in
        ``form`` (default: the plain T-less step, ``StepForm()``).

        During capture every slot is the pad id, so the warm-up and capture runs touch no
        pool row. The warm-up runs outside the graph (it compiles the kernel); ``rand_seed``'s
        offset is as it was before the capture.
        """
        form = PLAIN if form is None else form
        if not isinstance(form, StepForm):
            raise TypeError(f"form: expected a StepForm or None, got {type(form).__name__}")
        problem = form.problem(self.with_dst)
        if problem:
            raise ValueError(f"form: {problem}")
        for b in checked_capture_buckets(buckets, self.buckets):  # all checked before any is captured
            if (b, form) in self._static:
                continue
            s = self._make_static(b, form)
            if self.use_cuda_graph:
                self._warm_up(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.graph_pool):
                    self._run(s)
                self._graphs[(b, form)] = g
            self._static[(b, form)] = s

    def _warm_up(self, s: dict[str, torch.Tensor]) -> None:
        """One step of ``s`` (every lane padding) outside any graph, before its capture: it compiles the
        kernel. It is no step of the decode: the ``rand_seed`` offset it advances goes back, so the
        runner draws what ``decode_step`` draws with the same seed (a capture only records the advance).
        On CUDA it runs on a side stream, as graph capture asks."""
        seed = self._weights["rand_seed"]
        kept = seed.clone() if seed is not None else None
        if self.pool.device.type == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._run(s)
            torch.cuda.current_stream().wait_stream(side)
        else:
            self._run(s)
        if kept is not None:
            seed.copy_(kept)

    @property
    def captured(self) -> tuple[tuple[int, StepForm], ...]:
        """The (bucket, form) pairs with buffers (and, on CUDA, a graph)."""
        keys = self._graphs if self.use_cuda_graph else self._static
        return tuple(sorted(keys, key=lambda k: (k[0], str(k[1]))))

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        """The buckets captured for the plain T-less form."""
        return tuple(b for b, form in self.captured if form == PLAIN)

    def buffers(self, bucket: int, form: StepForm | None = None) -> dict[str, torch.Tensor] | None:
        """The static buffers of ``(bucket, form)`` (default form: the plain step), or None before
        its capture: ``slots``, the per-lane inputs, ``out``, and ``nat``/``dst`` where the form has them."""
        return self._static.get((bucket, PLAIN if form is None else form))

    def step(self, *args, **kwargs) -> torch.Tensor:
        """One padded step for ``n = len(slots)`` live lanes; returns their ``out`` ``(n, ...)``.

        ``slots`` (and ``dst_slots``, ``num_accepted_tokens``) are int32, on any device (copied into
        the static buffers): ``slots`` ``(n,)`` or ``(n, K)`` with ``num_accepted_tokens`` ``(n,)``;
        ``dst_slots`` ``(n,)`` or, with a token axis on the inputs, ``(n, T)``. With ``clone=False``
        the result is a view of the static output buffer, overwritten by the next step of the same
        bucket and form.

        Every input is validated as the eager path (``mamba3_step_fn``) validates it, before
        anything is copied: exact shapes, dtypes and device, never broadcast or cast into the
        static buffers. A refused step changes nothing.
        """
        values = _bind_step(self, *args, **kwargs)
        call = {name: v for name, v in zip(_STEP_FIELDS, values) if name is not None}
        slots, dst_slots = call["state_batch_indices"], call["dst_state_batch_indices"]
        num_accepted_tokens, clone, x = call["num_accepted_tokens"], values[-1], call["x"]
        for name in call.keys() - _STEP_HANDLED:  # declared, but no buffer of the runner holds it
            if call[name] is not None:
                raise ValueError(f"{name}: a CudaGraphStepRunner does not take {name} (it has no buffer for it); "
                                 f"pass None, or call decode_step")
        self._check_kinds(call, slots, dst_slots, num_accepted_tokens)
        inputs = self._lane_inputs(slots, {f: call[f] for f in LANE_FIELDS}, dst_slots)
        n = slots.shape[0]
        bucket = choose_bucket(n, self.buckets)
        if bucket is None:  # too big for any bucket: run eagerly, unpadded
            return self._eager(slots, inputs, dst_slots, num_accepted_tokens)
        key = (bucket, _form_of(x, slots, dst_slots, num_accepted_tokens))
        self._check_step(key, n, inputs, slots, dst_slots, num_accepted_tokens)
        if key not in self._static:
            self.capture([bucket], key[1])
        s = self._static[key]
        self._fill(s, n, slots, dst_slots, num_accepted_tokens, inputs)
        if self.use_cuda_graph:
            self._graphs[key].replay()
        else:
            self._run(s)
        res = s["out"][:n]
        return res.clone() if clone else res

    @staticmethod
    def _check_kinds(call: dict, slots, dst_slots, num_accepted_tokens) -> None:
        """Every tensor the runner reads or copies is a strided tensor holding its values, checked
        before anything reads a shape (a nested tensor has none) or copies a byte."""
        for name in LANE_FIELDS:
            check_is_tensor(name, call[name], optional=True)
        for name, t in (("slots", slots), ("dst_slots", dst_slots), ("num_accepted_tokens", num_accepted_tokens)):
            check_is_tensor(name, t, optional=name != "slots")
            if t is not None and t.device.type == "meta":
                raise ValueError(f"{name}: expected a tensor holding values (it is copied into the runner's "
                                 f"buffers), got a meta tensor")

    def _lane_inputs(self, slots, inputs: dict, dst_slots) -> dict:
        """The runner's own checks (slots' kind, z against zproj, angle_proj against the pool's angles,
        B/C's head axis against ``shared_bc``, ``dst_slots`` against ``with_dst``, every per-lane input
        a tensor of ``n`` lanes); returns the per-lane inputs given."""
        if not isinstance(slots, torch.Tensor) or slots.dim() not in (1, 2):
            raise ValueError(f"slots: expected a (n,) or (n, K) int32 tensor, got "
                             f"{getattr(slots, 'shape', type(slots))}")
        if slots.dtype != torch.int32:
            raise TypeError(f"slots: expected dtype torch.int32, got {slots.dtype}")
        for name in [f for f in inputs if f in StepTensors._field_defaults]:
            t, wanted = inputs.pop(name), self._optional_lanes.get(name)
            if wanted is None and t is not None:  # an optional per-lane input the runner has no buffer for
                raise ValueError(f"{name}: a CudaGraphStepRunner captures no {name}; pass None")
            if wanted is not None and (t is None) == wanted:
                raise ValueError(self._optional_lane_problem(name, t))
            if t is not None:
                inputs[name] = t
        heads, H = (1 if self.shared_bc else self.pool.nheads), self.pool.nheads
        for name in ("B", "C"):  # the other valid head axis fits no buffer of this runner
            t = inputs[name]
            if isinstance(t, torch.Tensor) and t.dim() >= 4 and t.shape[-2] != heads and t.shape[-2] in (1, H):
                raise ValueError(f"{name}: expected a head axis of {heads} (this runner was built with shared_bc="
                                 f"{self.shared_bc}), got shape {tuple(t.shape)}")
        if dst_slots is not None and not self.with_dst:
            raise ValueError("dst_slots: this runner was built with with_dst=False; pass with_dst=True")
        n = slots.shape[0]
        for name, t in inputs.items():
            if not isinstance(t, torch.Tensor) or t.shape[:1] != (n,):
                raise ValueError(f"{name}: expected {n} lanes (len(slots)), got shape {tuple(getattr(t, 'shape', ()))}")
        return inputs

    def _optional_lane_problem(self, name: str, given) -> str:
        """Why an optional per-lane input ``name`` (``given`` or None) does not fit this runner."""
        if name == "z":
            return ("z: this runner was built without zproj, so z must be None" if given is not None
                    else "z: expected a (n, H, D) tensor because the runner has zproj")
        S = self.pool.rope_angles
        return (f"{name}: this runner's pool has no rotary angles (rope_angles=0), so {name} must be None"
                if given is not None else
                f"{name}: expected a (n, H, {S}) fp32 tensor because the runner's pool has rotary angles (S={S})")

    def _eager(self, slots, inputs: dict, dst_slots, num_accepted_tokens) -> torch.Tensor:
        """The step, unpadded, through :func:`decode_step` (validated there)."""
        dev = self.pool.device
        x = inputs["x"]
        if dst_slots is None and self._default_dst(x.dim() == 4) and slots.dim() == 1:
            dst_slots = slots

        def moved(t):
            return t.to(dev) if isinstance(t, torch.Tensor) else t

        return decode_step(
            self.pool, self.layer, slots.to(dev), **{f: inputs.get(f) for f in LANE_FIELDS}, **self._weights,
            dst_slots=moved(dst_slots), num_accepted_tokens=moved(num_accepted_tokens), **self._options,
        )

    def _fill(self, s: dict, n: int, slots, dst_slots, num_accepted_tokens, inputs: dict) -> None:
        """Copy the live lanes into the static buffers and pad the rest (pad ids, count 1, zeros)."""
        s["slots"][:n].copy_(slots)
        s["slots"][n:].fill_(self.pool.pad_id)
        if "nat" in s:
            s["nat"][:n].copy_(num_accepted_tokens)
            s["nat"][n:].fill_(1)
        if "dst" in s:
            if dst_slots is None:  # the default destination: each lane's source row ((n,) slots: itself)
                dst_slots = slots if s["slots"].dim() == 1 else source_rows(s["slots"][:n], s["nat"][:n])
            s["dst"][:n].copy_(dst_slots)
            s["dst"][n:].fill_(self.pool.pad_id)
        for name, t in inputs.items():
            s[name][:n].copy_(t)
            s[name][n:].zero_()


CudaGraphStepRunner.step.__signature__ = view_signature(_STEP_VIEW).replace(return_annotation="torch.Tensor")
CudaGraphStepRunner.__init__.__signature__ = view_signature(_INIT_VIEW)
