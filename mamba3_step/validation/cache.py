"""Validation once per signature: what ``check_step_inputs`` leaves behind, reused by later calls.

Letters (docs/contract.md): B lanes, T tokens, P pool rows, H heads, D head dim, N state size,
R MIMO rank, K candidate source rows.

:func:`~mamba3_step.validation.step.check_step_inputs` (two orders of magnitude more than a
launch's host cost: docs/performance.md, "Host overhead") reads
the call's metadata (which arguments are given, and per tensor its Python type, shape, strides,
dtype, device, ``requires_grad`` and whether it is an inference tensor), the options, whether
``torch.inference_mode`` is on, and the data pointers. Between the calls of a server only the
data pointers change. So a successful full validation is kept as a :class:`CheckedSignature`:

* a **guard** on everything but the addresses: :func:`make_guard` (torch's C++ tensor guard,
  the one ``torch.compile`` uses, comparing exact type, dispatch keys, dtype, device, sizes,
  strides and ``requires_grad`` of every given tensor; a plain-Python tuple comparison where
  that is unavailable), plus which arguments are None;
* the **address plan**: which tensors must start on 16 bytes (``state``, ``state_out``), each
  non-empty tensor's byte extent (fixed by its shape, strides and dtype), which are written.

``CheckedSignature.admits`` answers a later call: ``MISS`` (another signature),
``ADMIT`` (same signature, aligned, no written tensor sharing a byte with another argument, no
written inference tensor outside inference mode) or ``RECHECK`` (same signature, but one of
those address or mode checks fails). The guard is only ever stricter than the full validation
(a tensor it refuses may still be valid: then the full validation runs), and the address plan
decides exactly what the full validation's address checks decide; on ``RECHECK`` the caller
runs the full validation, which raises the named error, so the messages are always the full
validation's own.

``admits`` runs once per call of a server, so its cost is the plan/run path's floor. It is
written twice: in Python (:meth:`CheckedSignature.admits_python`, the definition) and in C
(``_admit.c``, the same steps in the same order, built by ``setup.py`` where a C compiler and
Python's headers exist; the two are timed side by side by ``bench/bench_host.py``). Which one
new signatures use: :data:`NATIVE` (``MAMBA3_STEP_NATIVE=0`` switches the C one off).

:class:`ValidationCache` maps a cheap key (``x``'s shape, the options, the inference-mode flag)
to a few signatures; :data:`VALIDATION_CACHE` is the process-wide one behind
:func:`check_step_inputs_cached` (what ``mamba3_step_fn`` and ``prepare_step`` call).
Failures are never cached: a refused call runs the full validation every time.
"""

from __future__ import annotations

import ctypes
import os
import threading
from bisect import bisect_left, bisect_right
from operator import add, is_not, itemgetter
from typing import Callable

import torch

from ..contract import VECTOR_BYTES, shown
from ..spec import StepSpec
from ..tensors import StepTensors
from . import checks
from .step import check_step_inputs
from .table import RULE_BY_NAME, is_written

try:  # the guard torch.compile installs on tensors (C++); absent or changed -> plain Python
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - depends on the torch build
    _TensorGuards = None
try:  # the address of torch's C function reading a tensor's data pointer (see _probe_data_ptr_function)
    from torch._C._dynamo.guards import _torchinductor_pyobject_tensor_data_ptr as _DATA_PTR_FN_ADDRESS
except ImportError:  # pragma: no cover - depends on the torch build
    _DATA_PTR_FN_ADDRESS = None

#: environment variable: ``0`` makes every new signature use the Python admission check even
#: where the C module is built (debugging, comparisons)
ENV_NATIVE = "MAMBA3_STEP_NATIVE"
try:  # the admission check in C (setup.py builds it where a C compiler and Python's headers exist)
    from ._admit import Admitter as _Admitter
except ImportError:  # not built here: the Python definition below gives the same verdicts
    _Admitter = None
#: True when new signatures check calls in C (the module is built and not switched off)
NATIVE = _Admitter is not None and os.environ.get(ENV_NATIVE, "1") != "0"

#: tensor types whose data pointer the C check may read with torch's C function (plain tensors
#: and parameters always have a storage; other subclasses may not, and the function throws then)
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _probe_data_ptr_function(address=_DATA_PTR_FN_ADDRESS) -> int:
    """``address`` when it is that of a C function ``void *f(PyObject *tensor)`` answering
    ``data_ptr()`` (torch's, for inductor's header-free wrappers) on probe tensors (a plain one,
    offset views, a parameter, an empty one); else 0 (this torch has none, or it answers
    something else)."""
    if type(address) is not int or address <= 0:  # pragma: no cover - another torch's binding
        return 0
    read = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(address)  # called holding the GIL
    base = torch.arange(64, dtype=torch.float32)
    probes = (base, base[5:], base.view(8, 8)[:, 3], torch.nn.Parameter(base.clone()), torch.empty(0))
    return address if all((read(t) or 0) == t.data_ptr() for t in probes) else 0


#: what :func:`_probe_data_ptr_function` found (0: the C check calls ``data_ptr()``)
_DATA_PTR_FN = _probe_data_ptr_function() if _Admitter is not None else 0

__all__ = ["ADMIT", "CheckedSignature", "ENV_NATIVE", "MISS", "NATIVE", "RECHECK", "TENSOR_SLOTS", "VALIDATION_CACHE",
           "ValidationCache", "check_step_inputs_cached", "make_guard", "python_guard", "tensor_signature"]

#: verdicts of :meth:`CheckedSignature.admits`
MISS, ADMIT, RECHECK = 0, 1, 2

#: positions of the tensor arguments in a StepTensors (every field but ``null_slot_id`` and ``replay_ring``, a
#: bundle of tensors the replay mode checks itself: mamba3_step.replay_validation)
TENSOR_SLOTS = tuple(i for i, name in enumerate(StepTensors._fields) if name not in ("null_slot_id", "replay_ring"))
_NULL_SLOT = StepTensors._fields.index("null_slot_id")
_X = StepTensors._fields.index("x")
_STATE_OUT = StepTensors._fields.index("state_out")
_data_ptr = torch.Tensor.data_ptr
_is_inference = torch.Tensor.is_inference
def _is_nested(t) -> bool:
    """True for a nested tensor, and for anything that is not a tensor (the full validation names it)."""
    return getattr(t, "is_nested", True) is not False
_Tensor = torch.Tensor


def tensor_signature(t: torch.Tensor) -> tuple:
    """What validation reads of one tensor besides its address: (type, shape, strides, dtype,
    device, requires_grad, is_inference)."""
    return (type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, t.is_inference())


def python_guard(tensors: tuple) -> Callable[..., bool]:
    """A guard in plain Python: ``guard(*tensors)`` is True when every tensor has the same
    :func:`tensor_signature` as ``tensors`` (used where torch's C++ guard is unavailable)."""
    expected = tuple(tensor_signature(t) for t in tensors)

    def guard(*given) -> bool:
        if len(given) != len(expected) or not all(isinstance(t, _Tensor) for t in given):
            return False
        return tuple(tensor_signature(t) for t in given) == expected

    return guard


def make_guard(tensors: tuple, prefer_cpp: bool = True) -> Callable[..., bool]:
    """``guard(*given) -> bool``: True only if each given tensor matches the one in ``tensors`` in
    exact Python type, dtype, device, sizes, strides and ``requires_grad`` (and, as far as the
    thread's dispatch state lets dispatch keys tell, inference-ness: :meth:`CheckedSignature.admits`
    checks that of written tensors itself). torch's C++ ``TensorGuards`` when it works here (several times
    faster per tensor), else :func:`python_guard`."""
    if prefer_cpp and _TensorGuards is not None:
        try:
            g = _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                              dynamic_dims_strides=[list(t.stride()) for t in tensors])
            if g.check(*tensors) is True:
                return g.check
        except Exception:  # noqa: BLE001 - another torch version's signature: use the Python guard
            pass
    return python_guard(tensors)


_SPECS: dict = {}  # one object per distinct StepSpec handed out by signatures


def _interned(spec: StepSpec) -> StepSpec:
    """The one object equal to ``spec`` that every signature returns: a dict keyed by it (the
    compile cache's) then finds it by identity, without comparing 18 fields."""
    if len(_SPECS) > 4096:
        _SPECS.clear()
    return _SPECS.setdefault(spec, spec)


def _tuple_getter(positions: tuple) -> Callable[[tuple], tuple]:
    """``f(seq) -> tuple(seq[i] for i in positions)``, a C-level itemgetter where possible."""
    if len(positions) >= 2:
        return itemgetter(*positions)
    if len(positions) == 1:
        (i,) = positions
        return lambda seq: (seq[i],)
    return lambda seq: ()


class CheckedSignature:
    """One successful full validation, kept to admit later calls with the same signature.

    Build it with :meth:`from_call` right after ``check_step_inputs`` accepted ``tensors`` with
    these options. ``spec`` is that validation's result. ``call`` arguments below are any
    sequence laid out like :class:`~mamba3_step.tensors.StepTensors` (a StepTensors, or a plain
    tuple of its 20 fields).

    ``admits(call)`` answers :data:`MISS`, :data:`ADMIT` or :data:`RECHECK` (the module
    docstring). It assumes the options and the inference-mode flag are those of this signature
    (the caller's key or plan holds them); ``null_slot_id`` is compared there. It is the C
    module's check where that is built and ``prefer_native`` allows it (None, the default,
    follows :data:`NATIVE`), else :meth:`admits_python`: the same steps in the same order,
    hence the same verdicts (tests compare them); ``native`` says which one this signature uses.
    """

    __slots__ = ("spec", "inference_mode", "present", "_pick", "_absent", "_nones", "_guard", "_written",
                 "_addr", "_extents", "_aligned", "_written_addr", "signatures", "null_slot_id", "admits", "native")

    def __init__(self, spec: StepSpec, tensors, inference_mode: bool, prefer_cpp: bool = True,
                 prefer_native: bool | None = None):
        self.spec = _interned(spec)
        self.inference_mode = inference_mode
        self.null_slot_id = tensors[_NULL_SLOT]
        self.present = tuple(i for i in TENSOR_SLOTS if tensors[i] is not None)
        absent = tuple(i for i in TENSOR_SLOTS if tensors[i] is None)
        self._pick = _tuple_getter(self.present)
        self._absent = _tuple_getter(absent)
        self._nones = (None,) * len(absent)
        given = self._pick(tensors)
        self._guard = make_guard(given, prefer_cpp)
        self.signatures = tuple(tensor_signature(t) for t in given)  # for messages (what changed)
        names = [StepTensors._fields[i] for i in self.present]
        has_state_out = tensors[_STATE_OUT] is not None
        written = [is_written(RULE_BY_NAME[n], has_state_out, spec.update_kv_state) for n in names]
        written_given = tuple(k for k, w in enumerate(written) if w)
        self._written = _tuple_getter(written_given)
        spans = [checks.byte_span(t) for t in given]
        addr = tuple(k for k, span in enumerate(spans) if span is not None)
        self._addr = None if len(addr) == len(given) else _tuple_getter(addr)  # None: all of them
        self._extents = tuple(spans[k][1] - spans[k][0] for k in addr)
        self._aligned = tuple(j for j, k in enumerate(addr) if RULE_BY_NAME[names[k]].vector_aligned)
        self._written_addr = tuple((j, self._extents[j]) for j, k in enumerate(addr) if written[k])
        self.native = _Admitter is not None and (NATIVE if prefer_native is None else prefer_native)
        self.admits = self._c_admits(absent, written_given, addr, given) if self.native else self.admits_python

    def _c_admits(self, absent: tuple, written: tuple, addr: tuple, given: tuple) -> Callable[..., int]:
        """The C module's ``admits`` for this signature: the same tables as :meth:`admits_python`
        reads (call positions of the absent arguments; given indices of the written tensors and
        of those with a byte extent), and torch's data-pointer function where every tensor is a
        plain tensor or parameter."""
        plain = all(type(t) in _PLAIN_TENSOR_TYPES for t in given)
        return _Admitter(
            n_fields=len(StepTensors._fields), present=self.present, absent=absent, null_pos=_NULL_SLOT,
            null_slot_id=self.null_slot_id, guard=self._guard, check_inference=not self.inference_mode,
            written=written, addr=addr, extents=self._extents, aligned=self._aligned,
            written_addr=tuple(j for j, _ in self._written_addr), vector_bytes=VECTOR_BYTES,
            data_ptr=_data_ptr, is_inference=_is_inference, data_ptr_fn=_DATA_PTR_FN if plain else 0).admits

    @classmethod
    def from_call(cls, spec: StepSpec, tensors, prefer_cpp: bool = True,
                  prefer_native: bool | None = None) -> "CheckedSignature":
        """The signature of a call that ``check_step_inputs`` just accepted (result ``spec``)."""
        return cls(spec, tensors, torch.is_inference_mode_enabled(), prefer_cpp, prefer_native)

    def admits_python(self, call) -> int:
        """``admits`` in Python: the definition the C module follows step by step."""
        if any(map(is_not, self._absent(call), self._nones)):
            return MISS
        given = self._pick(call)
        if any(map(_is_nested, given)):  # no sizes: a guard would raise (torch's aborts the process)
            return MISS
        if not self._guard(*given):
            return MISS
        nsi = call[_NULL_SLOT]
        if nsi is not self.null_slot_id and (type(nsi) is not type(self.null_slot_id) or nsi != self.null_slot_id):
            return MISS
        if not self.inference_mode and any(map(_is_inference, self._written(given))):
            return RECHECK
        return ADMIT if self._addresses_ok(given if self._addr is None else self._addr(given)) else RECHECK

    def _addresses_ok(self, tensors: tuple) -> bool:
        """16-byte alignment of the vector-aligned tensors, and no written tensor sharing a byte
        with any other argument: the full validation's address checks, from the extents."""
        try:
            starts = list(map(_data_ptr, tensors))
        except RuntimeError:  # a tensor without a data pointer: the full validation names it
            return False
        if 0 in starts:  # a non-empty tensor whose storage was freed: the full validation names it
            return False
        for j in self._aligned:
            if starts[j] % VECTOR_BYTES:
                return False
        by_start, by_end = sorted(starts), sorted(map(add, starts, self._extents))
        for j, extent in self._written_addr:
            # the tensors overlapping [start, start + extent) are those starting before its end
            # minus those ending at or before its start (all of which start before its end):
            # itself and, if the call is refused, at least one more
            start = starts[j]
            if bisect_left(by_start, start + extent) - bisect_right(by_end, start) > 1:
                return False
        return True

    def differences(self, call) -> list[str]:
        """What differs between ``call`` and this signature, one phrase per argument (messages)."""
        out = []
        fields = StepTensors._fields
        present = set(self.present)
        for i in TENSOR_SLOTS:
            name, t = fields[i], call[i]
            if (i in present) != (t is not None):
                out.append(f"{name}: planned {'a tensor' if i in present else 'None'}, got "
                           f"{'None' if t is None else 'a tensor'}")
            elif t is not None and isinstance(t, torch.Tensor):
                want = self.signatures[self.present.index(i)]
                got = tensor_signature(t)
                for label, a, b in zip(_SIGNATURE_LABELS, want, got):
                    if a != b:
                        out.append(f"{name}: planned {label} {_show(a)}, got {_show(b)}")
        if call[_NULL_SLOT] != self.null_slot_id or type(call[_NULL_SLOT]) is not type(self.null_slot_id):
            out.append(f"null_slot_id: planned {shown(self.null_slot_id)}, got {shown(call[_NULL_SLOT])}")
        return out


_SIGNATURE_LABELS = ("type", "shape", "strides", "dtype", "device", "requires_grad", "is_inference")


def _show(value) -> str:
    if isinstance(value, type):
        return value.__qualname__
    return str(value)


class ValidationCache:
    """Bounded, thread-safe map from a call's cheap key to the signatures validated under it.

    :meth:`check` is ``check_step_inputs`` with a memory: the same result or the same exception
    for every call. A lookup takes no lock (one dict read of an immutable tuple); inserting and
    evicting (oldest key first, past ``max_keys``; at most ``per_key`` signatures a key, newest
    first) take the lock.
    """

    def __init__(self, max_keys: int = 512, per_key: int = 4, prefer_cpp: bool = True,
                 prefer_native: bool | None = None):
        self.max_keys, self.per_key, self.prefer_cpp = max_keys, per_key, prefer_cpp
        self.prefer_native = prefer_native
        self._entries: dict = {}
        self._lock = threading.Lock()
        self.full_validations = 0  # how often check() ran the full validation

    def __len__(self) -> int:
        return sum(len(v) for v in list(self._entries.values()))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def check(self, tensors: StepTensors, update_kv_state=False, tile_D=None, num_warps=None, rotate_pairwise=False,
              stochastic_rounding=False) -> StepSpec:
        """``check_step_inputs(tensors, **options)``, answered from the cache when a signature admits
        the call; otherwise the full validation runs (raising its named error) and, for a call of
        plain tensors and plain options, its result is kept. The options are
        :data:`~mamba3_step.signature.VALIDATED_OPTIONS`."""
        key = call_key(tensors, update_kv_state, tile_D, num_warps, rotate_pairwise, stochastic_rounding)
        if key is not None:
            for sig in self._entries.get(key, ()):
                verdict = sig.admits(tensors)
                if verdict == ADMIT:
                    return sig.spec
                if verdict == RECHECK:
                    key = None  # the full validation below raises; if not, nothing new to keep
                    break
        with self._lock:
            self.full_validations += 1
        spec = check_step_inputs(tensors, update_kv_state=update_kv_state, tile_D=tile_D, num_warps=num_warps,
                                 rotate_pairwise=rotate_pairwise, stochastic_rounding=stochastic_rounding)
        if key is None:
            return spec
        sig = CheckedSignature.from_call(spec, tensors, self.prefer_cpp, self.prefer_native)
        self.insert(key, sig)
        return sig.spec

    def insert(self, key, sig: CheckedSignature) -> None:
        with self._lock:
            old = self._entries.get(key)
            if old is None and len(self._entries) >= self.max_keys:
                del self._entries[next(iter(self._entries))]
            self._entries[key] = (sig,) + (old or ())[: self.per_key - 1]


def call_key(tensors, update_kv_state, tile_D, num_warps, rotate_pairwise=False, stochastic_rounding=False):
    """The cache key of a call (its options in :data:`~mamba3_step.signature.VALIDATED_OPTIONS`
    order), or None when it is not cached (a non-plain or nested ``x``, or an option of another type
    than bool/int/None: those take the full validation every time). Written out: it runs per call."""
    x, nsi = tensors[_X], tensors[_NULL_SLOT]
    if (type(x) is not _Tensor or type(update_kv_state) is not bool or type(rotate_pairwise) is not bool
            or type(stochastic_rounding) is not bool or x.is_nested):
        return None
    for v in (tile_D, num_warps, nsi):
        if v is not None and type(v) is not int:
            return None
    return (x.shape, nsi, torch.is_inference_mode_enabled(), update_kv_state, tile_D, num_warps, rotate_pairwise,
            stochastic_rounding)


#: the process-wide cache behind :func:`check_step_inputs_cached`
VALIDATION_CACHE = ValidationCache()


def check_step_inputs_cached(tensors: StepTensors, **options) -> StepSpec:
    """:func:`~mamba3_step.validation.step.check_step_inputs` through :data:`VALIDATION_CACHE`:
    the same StepSpec or the same exception; a repeated signature costs the guard and the address
    checks instead of the full validation (``bench/bench_host.py`` times both)."""
    return VALIDATION_CACHE.check(tensors, **options)
