"""The compile cache: one compile per specialisation, persistent AOT disk cache, precompile.

Letters (docs/contract.md): B batch lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.

Every test runs with ``MAMBA3_STEP_CACHE_DIR`` (and ``XDG_CACHE_HOME``) pointing into its own
tmp dir: nothing here writes to the user's cache. Real compiles (the project's kernel, about
0.5-2 s each on this machine) are kept to a handful; subprocesses (about 4 s each) prove what a
fresh process sees. Nothing here runs on a GPU: the kernels are compiled for sm_90a and loaded,
not launched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mamba3_step
from mamba3_step import build
from mamba3_step.tools import cli
from mamba3_step import compile_cache as cc
from mamba3_step.compile_cache import key, store
from mamba3_step.spec import StepSpec, flagship_spec
from mamba3_step.tensors import KERNEL_ARGUMENT_NAMES

REPO = Path(__file__).resolve().parents[2]
ARCH = "sm_90a"
SMALL = flagship_spec(dstate=32, headdim=32, mimo=1)  # the cheapest real compile (~0.6 s)
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ------------------------------------------------------------------------------ fixtures
#: every test gets a fresh cache dir, memory cache, counters and warn-once state (conftest.py)
pytestmark = pytest.mark.usefixtures("isolated_cache")


class RecordingBuilder:
    """A stand-in compiler that records each compile (no cutlass): fast key/counter tests."""

    def __init__(self, exportable=False):
        self.specs = []
        self.builder = cc.KernelBuilder(name="recording", compile=self._compile, sources=(),
                                        exportable=exportable)

    def _compile(self, spec, arch):
        self.specs.append((spec, arch))
        return _Compiled(spec, arch)


class _Compiled:
    def __init__(self, spec, arch):
        self.spec, self.arch = spec, arch

    def __tvm_ffi_object__(self):
        return self  # stands for the JIT's tvm-ffi function


def call_args(B, P=None, H=4, *, N=128, D=64, R=4, state_dtype="float32", kv_dtype="bfloat16",
              x_dtype="bfloat16", proj_dtype="bfloat16", dst=False, update_kv_state=True,
              z=True, outproj=True, state_out=False, pad_heads=0, device="meta"):
    """``mamba3_step_fn`` keyword arguments built from empty tensors (metadata only).

    ``P=None`` is dense mode. ``pad_heads`` makes every (rows, H, ...) tensor a view into a
    buffer with ``H + pad_heads`` heads, i.e. different strides for the same shapes.
    """
    rows = B if P is None else P
    sd, kd, xd, pd = (DT[n] for n in (state_dtype, kv_dtype, x_dtype, proj_dtype))
    Hb = H + pad_heads

    def e(*shape, dtype=torch.float32, head_dim=None):
        if head_dim is None or not pad_heads:
            return torch.empty(*shape, dtype=dtype, device=device)
        big = list(shape)
        big[head_dim] = Hb
        return torch.empty(*big, dtype=dtype, device=device).narrow(head_dim, 0, H)

    kw = dict(
        state=e(rows, H, D, N, dtype=sd, head_dim=1), Bstate=e(rows, R, H, N, dtype=kd, head_dim=2),
        Xstate=e(rows, H, D, dtype=xd, head_dim=1), A=e(B, H, head_dim=1),
        B=e(B, R, H, N, dtype=kd, head_dim=2), C=e(B, R, H, N, dtype=kd, head_dim=2), D=e(H),
        x=e(B, H, D, dtype=xd, head_dim=1), dt=e(B, H, head_dim=1), trap=e(B, H, head_dim=1),
        xproj=e(R, H, D, dtype=pd), outproj=e(R, H, D, dtype=pd) if outproj else None,
        z=e(B, H, D, dtype=xd, head_dim=1) if z else None, zproj=e(R, H, D, dtype=pd) if z else None,
        state_out=e(B, H, D, N, dtype=sd) if state_out else None,
        update_kv_state=update_kv_state,
    )
    if P is not None:
        kw["state_batch_indices"] = torch.empty(B, dtype=torch.int32, device=device)
        if dst:
            kw["dst_state_batch_indices"] = torch.empty(B, dtype=torch.int32, device=device)
    return kw


def _env(root: Path, **extra) -> dict:
    env = dict(os.environ)
    env[cc.ENV_CACHE_DIR] = str(root)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _valid_entry(spec, root) -> Path:
    """Assert the entry for (spec, ARCH) under ``root`` verifies and loads; return its path."""
    entry = cc.entry_path(spec, ARCH, root)
    fn, problem = store.try_load(entry, cc.entry_key(spec, ARCH))
    assert problem is None and fn is not None, problem
    return entry


# --------------------------------------------------------------- one compile per spec
def test_kernel_sources_are_the_modules_the_kernel_imports():
    """The fingerprinted sources are computed from the kernel package's imports, never listed by hand."""
    pkg = Path(mamba3_step.__file__).parent
    names = {Path(p).relative_to(pkg).as_posix() for p in build.kernel_sources()}
    # every module of the kernel package and what they import (contract, spec, tensors, tiling),
    # nothing of the layers above
    parts = {p.relative_to(pkg).as_posix() for p in (pkg / "kernel").glob("*.py")}
    assert "kernel/step.py" in parts and "kernel/state_formats.py" in parts
    assert parts | {"contract.py", "spec.py", "tensors.py", "tiling.py"} <= names
    assert not names & {"api.py", "launch.py", "demo.py", "cli.py", "compile_cache/__init__.py", "build.py"}
    assert cc.get_builder().sources == build.kernel_sources()


def _fingerprint(root: Path) -> str:
    key._FINGERPRINTS.clear()  # read once per process and builder (the documented hazard)
    b = cc.KernelBuilder(name="mamba3_step", compile=build.compile_kernel, sources=build.kernel_sources(root))
    return cc.entry_key(SMALL, ARCH, b)["sources_sha256"]


def test_key_changes_when_a_module_the_kernel_depends_on_changes(tmp_path):
    """On a copy of the package: touching a helper the kernel imports changes the key; a new helper
    module imported by the kernel enters the key by itself; modules the kernel does not import
    (the API, the demo) do not."""
    root = tmp_path / "mamba3_step"
    shutil.copytree(Path(mamba3_step.__file__).parent, root, ignore=shutil.ignore_patterns("__pycache__"))
    k0 = _fingerprint(root)
    assert k0 == _fingerprint(Path(mamba3_step.__file__).parent)  # relative names: same code, same key
    for unrelated in ("api.py", "tools/demo/decode.py", "serving/hook.py"):
        (root / unrelated).write_text((root / unrelated).read_text() + "\n# unrelated edit\n")
    assert _fingerprint(root) == k0
    (root / "tiling.py").write_text((root / "tiling.py").read_text() + "\n# a helper the kernel imports\n")
    k1 = _fingerprint(root)
    assert k1 != k0
    (root / "fresh_helper.py").write_text("SCALE = 1\n")
    assert _fingerprint(root) == k1  # not imported by the kernel yet
    kernel_py = root / "kernel" / "step.py"
    kernel_py.write_text(kernel_py.read_text().replace("from ..tiling import", "from ..fresh_helper import SCALE  # noqa\nfrom ..tiling import", 1))
    k2 = _fingerprint(root)
    assert k2 != k1 and str(root / "fresh_helper.py") in build.kernel_sources(root)
    (root / "fresh_helper.py").write_text("SCALE = 2\n")
    assert _fingerprint(root) not in (k0, k1, k2)
    key._FINGERPRINTS.clear()


def test_compile_counter_stays_at_one_across_batch_pool_heads_and_strides(isolated_cache):
    """Real kernel: B = 1..1024, several P, H and strides, CPU and meta tensors -> 1 compile."""
    first = cc.compile_for(**call_args(B=3, P=7, H=48, device="cpu"), arch=ARCH)
    assert cc.COUNTERS.compiles == 1 and cc.COUNTERS.disk_writes == 1
    calls = 1
    pools, heads = (1, 5, 1024, 8192), (1, 2, 48, 96)
    for B in range(1, 1025):
        fn = cc.compile_for(**call_args(B=B, P=pools[B % 4], H=heads[(B // 4) % 4],
                                        pad_heads=B % 3), arch=ARCH)
        assert fn is first
        calls += 1
    for B, P, H in ((1, 1, 1), (16, 3, 64), (300, 9000, 24)):
        assert cc.compile_for(**call_args(B=B, P=P, H=H, device="cpu"), validate_indices=True,
                              arch=ARCH) is first
        calls += 1
    assert cc.get_compiled(flagship_spec(), ARCH) is first
    calls += 1
    s = cc.stats()
    assert (s["compiles"], s["disk_loads"], s["memory_hits"]) == (1, 0, calls - 1)
    assert s["memory_entries"] == 1


STATIC_CHANGES = [
    ("dstate", dict(N=64)),
    ("headdim", dict(D=32)),
    ("mimo", dict(R=2)),
    ("state_dtype", dict(state_dtype="bfloat16")),
    ("kv_dtype", dict(kv_dtype="float16")),
    ("x_dtype", dict(x_dtype="float32")),
    ("proj_dtype", dict(proj_dtype="float32")),
    ("pool", dict(P=None, update_kv_state=True)),
    ("has_dst", dict(dst=True)),
    ("update_kv_state", dict(update_kv_state=False)),
    ("has_z", dict(z=False)),
    ("has_outproj", dict(outproj=False)),
]


def test_compile_counter_grows_for_each_static_change():
    """Each change of N, D, R, a dtype or a mode flag is a new spec: exactly one more compile."""
    rec = RecordingBuilder()
    cc.set_builder(rec.builder)
    base = call_args(B=4, P=9, H=6)
    cc.compile_for(**base, arch=ARCH)
    assert cc.COUNTERS.compiles == 1
    base_spec = rec.specs[0][0]
    for field, change in STATIC_CHANGES:
        before = cc.COUNTERS.compiles
        kw = dict(B=4, P=9, H=6)
        kw.update(change)
        cc.compile_for(**call_args(**kw), arch=ARCH)
        assert cc.COUNTERS.compiles == before + 1, field
        spec = rec.specs[-1][0]
        diff = {f.name for f in dataclasses.fields(StepSpec)
                if getattr(spec, f.name) != getattr(base_spec, f.name)}
        # a new D or N re-derives the default tiling; everything else changes only its field
        assert field in diff and diff <= {field, "tile_D", "num_warps", "has_dst"}, (field, diff)
        kw.update(B=17, P=33, H=2)  # same spec, other runtime dims: no compile
        cc.compile_for(**call_args(**kw), arch=ARCH)
        assert cc.COUNTERS.compiles == before + 1, field
    # dense mode with state_out, user tiling, and another arch are specs of their own
    before = cc.COUNTERS.compiles
    cc.compile_for(**call_args(B=4, H=6, state_out=True), arch=ARCH)
    cc.compile_for(**call_args(B=4, P=9, H=6), tile_D=64, num_warps=8, arch=ARCH)
    cc.compile_for(**call_args(B=4, P=9, H=6), arch="sm_100a")
    assert cc.COUNTERS.compiles == before + 3
    assert rec.specs[-1] == (base_spec, "sm_100a")
    assert len(set(rec.specs)) == len(rec.specs)  # never compiled one (spec, arch) twice


def test_meta_cpu_and_strided_inputs_give_the_same_spec():
    rec = RecordingBuilder()
    cc.set_builder(rec.builder)
    a = cc.compile_for(**call_args(B=5, P=11, H=3, device="meta"), arch=ARCH)
    b = cc.compile_for(**call_args(B=2, P=4, H=8, device="cpu", pad_heads=2), arch=ARCH)
    assert a is b and cc.COUNTERS.compiles == 1
    assert rec.specs == [(flagship_spec(), ARCH)]


def test_bad_inputs_are_rejected_with_clear_errors():
    cc.set_builder(RecordingBuilder().builder)
    with pytest.raises(TypeError, match="spec: expected a mamba3_step.StepSpec"):
        cc.get_compiled("flagship", ARCH)
    with pytest.raises(ValueError, match=r"arch: expected 'sm_'.*got 'hopper'"):
        cc.get_compiled(flagship_spec(), "hopper")
    with pytest.raises(TypeError, match="arch: expected a string"):
        cc.get_compiled(flagship_spec(), 90)
    with pytest.raises(ValueError, match=r"spec: N \(dstate\) must be one of \(32, 64, 128, 256\), got 48"):
        cc.get_compiled(StepSpec(dstate=48, headdim=64, mimo=4), ARCH)
    with pytest.raises(ValueError, match="spec.state_dtype: expected one of"):
        cc.get_compiled(flagship_spec().replace(state_dtype="float64"), ARCH)
    kw = call_args(B=4, P=9)
    kw["C"] = kw["C"][:, :, :, :16]
    with pytest.raises(ValueError, match=r"C: expected shape"):  # the validation's own message
        cc.compile_for(**kw, arch=ARCH)
    assert cc.COUNTERS.compiles == 0
    # a spec without tiling gets the default tiling: the same kernel as the completed spec
    bare = StepSpec(dstate=128, headdim=64, mimo=4, pool=True, update_kv_state=True)
    assert cc.get_compiled(bare, ARCH) is cc.get_compiled(flagship_spec(), ARCH)
    assert cc.COUNTERS.compiles == 1


# ----------------------------------------------------------------------- disk cache
LOADER = r"""
import json, sys, time
t0 = time.perf_counter()
import mamba3_step
from mamba3_step import compile_cache as cc
from mamba3_step.compile_cache import store
t1 = time.perf_counter()
spec = mamba3_step.flagship_spec()
fn, how, seconds, entry = cc.obtain(spec, "sm_90a")
t2 = time.perf_counter()
res = dict(stats=cc.stats(), how=how, load_seconds=seconds, import_to_loaded=t2 - t0,
           cutlass_imported="cutlass" in sys.modules, type=type(fn).__name__)
res["loaded_signature"] = store.ffi_signature(fn)

import torch
from mamba3_step.tensors import StepTensors, kernel_arguments
from mamba3_step.testing import make_inputs
inp = make_inputs(B=3, P=5, H=2, D=64, N=128, R=4)
inp["out"] = inp["x"].clone()
args = kernel_arguments(StepTensors(**inp, state_batch_indices=inp["x"].new_zeros(3, dtype=torch.int32)))

def call_error(f):
    try:
        f(*args)
    except Exception as e:
        return [type(e).__name__, str(e).split("\n")[0]]
    return None

res["loaded_cpu_call"] = call_error(fn)
if "--jit" in sys.argv:  # CUTE_DSL_ARCH=sm_90a: the DSL builds its JIT engine for sm_90a
    from mamba3_step.kernel import compile_step_kernel
    raw = compile_step_kernel(spec, "sm_90a").__tvm_ffi_object__()
    res["jit_signature"] = store.ffi_signature(raw)
    res["jit_cpu_call"] = call_error(raw)
print("RESULT " + json.dumps(res))
"""


def _run_loader(root, *extra_args, **env):
    r = subprocess.run([sys.executable, "-c", LOADER, *extra_args],
                       cwd=REPO, env=_env(root, **env), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_second_process_loads_flagship_with_the_jit_calling_convention(isolated_cache):
    fn, how, _, entry = cc.obtain(flagship_spec(), ARCH)
    assert how == "compiled" and cc.COUNTERS.compiles == 1 and cc.COUNTERS.disk_writes == 1
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["key"] == cc.entry_key(flagship_spec(), ARCH)
    assert manifest["key"]["spec"] == flagship_spec().key()

    res = _run_loader(isolated_cache, "--jit", CUTE_DSL_ARCH="sm_90a")
    assert res["how"] == "loaded"
    assert res["stats"]["compiles"] == 0 and res["stats"]["disk_loads"] == 1
    assert res["cutlass_imported"] is False  # a cache hit needs no DSL import
    assert res["type"] == "Function"  # tvm_ffi.Function, as for a fresh compile
    # same signature as the JIT-compiled function (the runtime arguments, no stream)
    assert res["loaded_signature"] == res["jit_signature"] == manifest["signature"]
    assert res["loaded_signature"].count(":") == len(KERNEL_ARGUMENT_NAMES) and "state: Tensor([n0, n1, 64, 128], float32)" \
        in res["loaded_signature"]
    # called with CPU tensors, both reject them identically (argument count/types accepted)
    assert res["loaded_cpu_call"] == res["jit_cpu_call"]
    assert res["loaded_cpu_call"][0] == "ValueError" and "device_type=cuda" in res["loaded_cpu_call"][1]
    # the in-process compile returned the same kind of callable
    assert type(fn).__name__ == "Function"


def _rewrite(path, data: bytes):
    """Replace a file's content with a new inode. Writing in place into a library this process
    has mapped would corrupt the running code itself (a crash at interpreter exit), which is
    not the situation under test: a bad file on disk."""
    path.unlink()
    path.write_bytes(data)


def _tamper_flip(entry):
    p = entry / "kernel.so"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x5A
    _rewrite(p, bytes(data))


def _tamper_truncate_so(entry):
    p = entry / "kernel.so"
    _rewrite(p, p.read_bytes()[:1000])


def _tamper_truncate_manifest(entry):
    p = entry / "manifest.json"
    p.write_text(p.read_text()[:50])


def _tamper_stale_key(entry):
    p = entry / "manifest.json"
    m = json.loads(p.read_text())
    m["key"]["sources_sha256"] = "0" * 64  # an entry built from other kernel sources
    p.write_text(json.dumps(m))


OTHER = flagship_spec(dstate=32, headdim=32, mimo=2)


def _tamper_swap_artifact(entry):
    """A valid library of another spec under this entry's manifest (sha mismatch)."""
    other = cc.entry_path(OTHER, ARCH)
    _rewrite(entry / "kernel.so", (other / "kernel.so").read_bytes())


def _tamper_delete_so(entry):
    (entry / "kernel.so").unlink()


@pytest.mark.parametrize("tamper", [_tamper_flip, _tamper_truncate_so, _tamper_truncate_manifest,
                                    _tamper_stale_key, _tamper_delete_so],
                         ids=lambda f: f.__name__.removeprefix("_tamper_"))
def test_corrupt_or_stale_entry_is_rebuilt_never_loaded(tamper):
    _, how, _, entry = cc.obtain(SMALL, ARCH)
    assert how == "compiled"
    good = json.loads((entry / "manifest.json").read_text())
    tamper(entry)
    cc.reset_memory_cache()
    _, how, _, entry2 = cc.obtain(SMALL, ARCH)
    assert (how, entry2) == ("rebuilt", entry)
    s = cc.stats()
    assert (s["compiles"], s["rebuilds"], s["disk_loads"], s["disk_writes"]) == (2, 1, 0, 2)
    new = json.loads((entry / "manifest.json").read_text())
    assert new["key"] == good["key"] and new["created_unix"] > good["created_unix"]
    # the rebuilt entry is valid and is what the next process-level lookup loads
    cc.reset_memory_cache()
    assert cc.obtain(SMALL, ARCH)[1] == "loaded"
    assert not [p for p in entry.parent.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


def test_swapped_library_is_detected(isolated_cache):
    cc.obtain(OTHER, ARCH)
    _, _, _, entry = cc.obtain(SMALL, ARCH)
    _tamper_swap_artifact(entry)
    fn, problem = store.try_load(entry, cc.entry_key(SMALL, ARCH))
    assert fn is None and "sha256" in problem


def test_publishing_race_keeps_the_first_entry(isolated_cache):
    """Two writers of one entry (no lock): the second rename fails and the first entry stays."""
    from mamba3_step.kernel import compile_step_kernel

    compiled = compile_step_kernel(SMALL, ARCH)
    entry_key = cc.entry_key(SMALL, ARCH)
    entry = cc.entry_path(SMALL, ARCH)
    entry.parent.mkdir(parents=True)
    linker = store.find_linker()
    store.store(compiled, entry, entry_key, linker, 1.0)
    first = (entry / "manifest.json").read_text()
    fn = store.store(compiled, entry, entry_key, linker, 2.0)  # loses the race
    assert type(fn).__name__ == "Function"
    assert (entry / "manifest.json").read_text() == first
    assert cc.COUNTERS.disk_writes == 1
    assert sorted(p.name for p in entry.parent.iterdir() if not p.name.startswith(".")) == [entry.name]
    _valid_entry(SMALL, isolated_cache)


def test_two_concurrent_precompiles_leave_a_valid_cache(isolated_cache):
    cmd = [sys.executable, "-m", "mamba3_step", "precompile", "--arch", ARCH, "--config", "flagship",
           "--config", "32,32,1", "--json"]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=_env(isolated_cache), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out))
    for spec in (flagship_spec(), SMALL):
        hows = sorted(r["how"] for o in outs for r in o["results"] if r["spec"] == spec.key())
        # the entry lock: one process compiles, the other waits and loads its result
        assert hows == ["compiled", "loaded"], hows
        _valid_entry(spec, isolated_cache)
    assert sum(o["counters"]["compiles"] for o in outs) == 2
    leftovers = [p.name for p in (isolated_cache / "v1" / ARCH).iterdir()
                 if p.name.startswith((".tmp-", ".trash-"))]
    assert leftovers == []
    # and a third reader loads both without compiling
    cc.reset_memory_cache()
    assert [r["how"] for r in cc.precompile([flagship_spec(), SMALL], ARCH)] == ["loaded", "loaded"]
    assert cc.COUNTERS.compiles == 0


def test_key_covers_sources_versions_env_and_arch(tmp_path, monkeypatch):
    src = tmp_path / "kernel_src.py"
    src.write_text("A = 1\n")
    b = cc.KernelBuilder(name="k", compile=lambda s, a: None, sources=(str(src),))
    k0 = cc.entry_key(SMALL, ARCH, b)
    assert k0["spec"] == SMALL.key() and k0["arch"] == ARCH
    assert set(k0["versions"]) == {"nvidia-cutlass-dsl", "apache-tvm-ffi"}
    src.write_text("A = 2\n")
    key._FINGERPRINTS.clear()
    k1 = cc.entry_key(SMALL, ARCH, b)
    assert k1["sources_sha256"] != k0["sources_sha256"]
    monkeypatch.setattr(key, "_VERSIONS", {"nvidia-cutlass-dsl": "9.9", "apache-tvm-ffi": "0.1.15"})
    k2 = cc.entry_key(SMALL, ARCH, b)
    monkeypatch.setenv("CUTE_DSL_LOG_LEVEL", "10")  # logging: not part of the key
    assert cc.entry_key(SMALL, ARCH, b) == k2
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")  # changes the generated code
    k3 = cc.entry_key(SMALL, ARCH, b)
    k4 = cc.entry_key(SMALL, "sm_100a", b)
    digests = {key.key_digest(k) for k in (k0, k1, k2, k3, k4)}
    assert len(digests) == 5
    key._FINGERPRINTS.clear()


def test_default_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv(cc.ENV_CACHE_DIR, str(tmp_path / "explicit"))
    assert cc.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv(cc.ENV_CACHE_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.cache_dir() == tmp_path / "xdg" / "mamba3_step"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cc.cache_dir() == tmp_path / "home" / ".cache" / "mamba3_step"


# -------------------------------------------------------------------------- fallbacks
def test_unwritable_cache_dir_compiles_in_memory_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(cc.ENV_CACHE_DIR, str(blocker / "cache"))  # unwritable even for root
    rec = RecordingBuilder(exportable=True)
    cc.set_builder(rec.builder)
    with pytest.warns(cc.CompileCacheWarning, match="not writable") as record:
        fn1, how1, _, e1 = cc.obtain(SMALL, ARCH)
        fn2, how2, _, e2 = cc.obtain(flagship_spec(), ARCH)
    assert len(record) == 1 and cc.ENV_CACHE_DIR in str(record[0].message)
    assert (how1, how2, e1, e2) == ("compiled-in-memory", "compiled-in-memory", None, None)
    assert isinstance(fn1, _Compiled) and fn1.spec == SMALL
    assert cc.COUNTERS.compiles == 2 and cc.COUNTERS.disk_writes == 0
    assert cc.get_compiled(SMALL, ARCH) is fn1 and cc.COUNTERS.compiles == 2


def test_missing_linker_compiles_in_memory_with_one_warning(monkeypatch, isolated_cache):
    monkeypatch.setattr(store, "find_linker", lambda: None)
    cc.set_builder(RecordingBuilder(exportable=True).builder)
    with pytest.warns(cc.CompileCacheWarning, match="no C/C\\+\\+ linker") as record:
        assert cc.obtain(SMALL, ARCH)[1] == "compiled-in-memory"
        assert cc.obtain(flagship_spec(), ARCH)[1] == "compiled-in-memory"
    assert len(record) == 1 and cc.COUNTERS.compiles == 2


def test_read_only_cache_with_valid_entries_still_loads(monkeypatch, isolated_cache):
    cc.obtain(SMALL, ARCH)
    cc.reset_memory_cache()
    monkeypatch.setattr(store, "writable_dir", lambda path: "PermissionError: read-only image")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a hit needs no write: no warning
        assert cc.obtain(SMALL, ARCH)[1] == "loaded"
    assert (cc.COUNTERS.compiles, cc.COUNTERS.disk_loads) == (1, 1)


# ------------------------------------------------------------------------- arch, CLI
@pytest.mark.parametrize("cap,arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((10, 3), "sm_103a"),
                                      ((8, 9), "sm_89"), ((8, 0), "sm_80"), ((12, 0), "sm_120")])
def test_current_arch_maps_capability_like_the_launcher(monkeypatch, cap, arch):
    from mamba3_step import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    assert cc.current_arch() == arch == launch.device_arch(torch.device("cuda", 0))


def test_current_arch_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cc.current_arch() == "sm_90a" == cc.DEFAULT_ARCH


def test_precompile_config_parsing():
    assert cc.specs_for_config("flagship") == [flagship_spec()]
    specs = cc.specs_for_config("all")
    assert len(specs) == 48 == len(set(specs))
    assert {(s.dstate, s.headdim, s.mimo) for s in specs} == {
        (n, d, r) for n in (32, 64, 128, 256) for d in (32, 64, 128) for r in (1, 2, 4, 8)}
    assert cc.specs_for_config("64,32,2,bfloat16,float16") == [
        flagship_spec(dstate=64, headdim=32, mimo=2, state_dtype="bfloat16", kv_dtype="float16")]
    assert cc.specs_for_config("flagship", pool=False, update_kv_state=False)[0].pool is False
    with pytest.raises(ValueError, match=r"N \(dstate\) must be one of"):
        cc.specs_for_config("48,64,4")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        cc.specs_for_config("128,64,4,float32,int8")
    with pytest.raises(ValueError, match="expected flagship"):
        cc.specs_for_config("128,64")


def test_precompile_cli_list_json(capsys):
    assert cli.main(["precompile", "--list", "--config", "all", "--arch", "sm_100a", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["count"] == 48 and out["arch"] == "sm_100a"
    assert cc.COUNTERS.compiles == 0
    assert cli.main(["precompile", "--list", "--config", "flagship", "--mode", "dense", "--no-z"]) == 0
    text = capsys.readouterr().out
    assert "N128 D64 R4 float32/bfloat16/bfloat16/bfloat16 tD64 w4 kv+outproj" in text
    assert cli.main(["precompile", "--config", "48,64,4"]) == 2
    assert "N (dstate) must be one of" in capsys.readouterr().err


def test_precompile_cli_compiles_then_loads(capsys, isolated_cache):
    argv = ["precompile", "--arch", ARCH, "--config", "32,32,1"]
    assert cli.main(argv + ["--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    (row,) = first["results"]
    assert row["how"] == "compiled" and row["spec"] == SMALL.key() and row["seconds"] > 0
    assert Path(row["entry"]) == _valid_entry(SMALL, isolated_cache)
    cc.reset_memory_cache()  # as a new process would
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "N32 D32 R1" in table and "loaded" in table and "0 compiled, 1 loaded" in table
