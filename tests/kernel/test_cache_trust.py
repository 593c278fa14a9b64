"""The compile cache's trust model (docs/compile-cache.md, "Trust model").

Nothing is loaded from a cache directory that another user could have written: the directory,
the directories above it and every entry are checked (owner, mode, file type) before a byte is
read or a library is opened. Another user is simulated by monkeypatching the uid the checks
compare with (``store._current_uid``), or, when the tests run as root, by a real ``chown``.

Letters (docs/contract.md): N state size, D head dim, R MIMO rank.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
import threading
import warnings
from pathlib import Path

import pytest

from mamba3_step.tools import cli
from mamba3_step import compile_cache as cc
from mamba3_step.compile_cache import store
from mamba3_step.spec import flagship_spec

ARCH = "sm_90a"
SMALL = flagship_spec(dstate=32, headdim=32, mimo=1)  # the cheapest real compile
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
OTHER_UID = 4242 if not IS_ROOT or os.geteuid() != 4242 else 4243


#: every test gets a fresh cache dir, memory cache, counters and warn-once state (conftest.py)
pytestmark = pytest.mark.usefixtures("isolated_cache")


class StandIn:
    """An exportable stand-in compiler (no cutlass): keys and entry paths are real, compiles are not."""

    def __init__(self):
        self.compiles = 0
        self.builder = cc.KernelBuilder(name="stand-in", compile=self._compile, sources=(), exportable=True)

    def _compile(self, spec, arch):
        self.compiles += 1
        return object()


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def _planted_library(tmp_path: Path, marker: Path) -> Path:
    """A shared library whose constructor writes ``marker``: what an attacker would plant."""
    linker = store.find_linker()
    if linker is None:
        pytest.skip("no C/C++ compiler to build the planted library")
    src = tmp_path / "planted.c"
    src.write_text(
        "#include <stdio.h>\n"
        f'__attribute__((constructor)) static void planted(void) {{ FILE *f = fopen("{marker}", "w"); '
        'if (f) { fputs("ran", f); fclose(f); } }\n'
        "int planted_function(void) { return 7; }\n"
    )
    so = tmp_path / "planted.so"
    subprocess.run([linker, "-shared", "-fPIC", "-o", str(so), str(src)], check=True, capture_output=True)
    return so


def _plant_entry(spec, library: Path) -> Path:
    """An entry for ``spec`` whose manifest matches ``library`` and this process's key exactly."""
    entry = cc.entry_path(spec, ARCH)
    entry.mkdir(parents=True)
    data = library.read_bytes()
    (entry / "kernel.so").write_bytes(data)
    (entry / "manifest.json").write_text(json.dumps({
        "key": cc.entry_key(spec, ARCH), "artifact": "kernel.so", "function_name": "planted_function",
        "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
    }))
    return entry


def _spy_loads(monkeypatch) -> list:
    loads = []
    real = store.load_library

    def spy(path, name):
        loads.append(str(path))
        return real(path, name)

    monkeypatch.setattr(store, "load_library", spy)
    return loads


def _obtain_warned(spec=SMALL):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        res = cc.obtain(spec, ARCH)
    return res, [str(w.message) for w in record if issubclass(w.category, cc.CompileCacheWarning)]


# ------------------------------------------------------------------ item 1: other users' directories
def test_library_planted_in_another_users_cache_is_never_loaded(tmp_path, monkeypatch, isolated_cache):
    """The victim's process used to dlopen it: the planted constructor ran as the victim."""
    cc.set_builder(StandIn().builder)
    marker = tmp_path / "constructor-ran"
    _plant_entry(SMALL, _planted_library(tmp_path, marker))
    loads = _spy_loads(monkeypatch)
    # the cache (all of it, as the planting user made it) belongs to someone else
    monkeypatch.setattr(store, "_current_uid", lambda: OTHER_UID, raising=False)
    (fn, how, _, entry), warned = _obtain_warned()
    assert not marker.exists(), "the planted library's constructor ran"
    assert loads == []
    assert (how, entry) == ("compiled-in-memory", None)
    assert len(warned) == 1 and "owned by uid" in warned[0] and str(isolated_cache) in warned[0]
    assert cc.COUNTERS.disk_loads == 0


@pytest.mark.skipif(not IS_ROOT, reason="a real foreign owner needs chown (root)")
def test_library_planted_in_a_cache_chowned_to_another_user_is_never_loaded(tmp_path, monkeypatch, isolated_cache):
    cc.set_builder(StandIn().builder)
    marker = tmp_path / "constructor-ran"
    entry = _plant_entry(SMALL, _planted_library(tmp_path, marker))
    for p in (isolated_cache, isolated_cache / "v1", entry.parent, entry, entry / "kernel.so",
              entry / "manifest.json"):
        os.lchown(p, OTHER_UID, OTHER_UID)
    loads = _spy_loads(monkeypatch)
    (_, how, _, _), warned = _obtain_warned()
    assert not marker.exists() and loads == [] and how == "compiled-in-memory"
    assert len(warned) == 1 and f"owned by uid {OTHER_UID}" in warned[0]


def test_world_writable_cache_directory_is_refused(tmp_path, monkeypatch, isolated_cache):
    """A 0777 cache directory (root-owned or not) is not used silently."""
    cc.set_builder(StandIn().builder)
    marker = tmp_path / "constructor-ran"
    _plant_entry(SMALL, _planted_library(tmp_path, marker))
    os.chmod(isolated_cache, 0o777)
    loads = _spy_loads(monkeypatch)
    (_, how, _, _), warned = _obtain_warned()
    assert not marker.exists() and loads == [] and how == "compiled-in-memory"
    assert len(warned) == 1 and "writable by group or others" in warned[0]


def test_a_cache_path_through_a_link_and_dotdot_is_checked_where_it_is_read(tmp_path, monkeypatch):
    """``private/link/../cache`` with ``link`` pointing into a world-writable directory: checked
    lexically it was ``private/cache`` (trusted), opened it was ``shared/cache``, where a library
    planted by anyone was loaded. The resolved directory is the one checked."""
    cc.set_builder(StandIn().builder)
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    (shared / "sub").mkdir(parents=True)
    os.chmod(shared, 0o777)  # world-writable, not sticky: anyone may create shared/cache
    (private / "link").symlink_to(shared / "sub")
    monkeypatch.setenv(cc.ENV_CACHE_DIR, str(private / "link" / ".." / "cache"))
    assert cc.cache_dir() == shared / "cache"
    marker = tmp_path / "constructor-ran"
    _plant_entry(SMALL, _planted_library(tmp_path, marker))
    loads = _spy_loads(monkeypatch)
    (_, how, _, _), warned = _obtain_warned()
    assert not marker.exists(), "the planted library's constructor ran"
    assert loads == [] and how == "compiled-in-memory"
    assert len(warned) == 1 and str(shared) in warned[0]


def test_a_link_swapped_between_the_check_and_the_load_changes_nothing(tmp_path, monkeypatch):
    """The cache dir is given through a link, the link is re-pointed at another directory (with a
    planted entry) right after the trust check: the lookup stays in the directory it checked."""
    cc.set_builder(StandIn().builder)
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    for d in (mine, theirs):
        d.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(theirs)
    monkeypatch.setenv(cc.ENV_CACHE_DIR, str(link / "cache"))
    marker = tmp_path / "constructor-ran"
    _plant_entry(SMALL, _planted_library(tmp_path, marker))  # under theirs/cache
    link.unlink()
    link.symlink_to(mine)  # the user's own, empty cache: what the check will see
    real_check = store.tree_problem

    def check_then_swap(root, arch_dir):
        problem = real_check(root, arch_dir)
        link.unlink()
        link.symlink_to(theirs)  # swapped after the check, before any entry is opened
        return problem

    monkeypatch.setattr(store, "tree_problem", check_then_swap)
    loads = _spy_loads(monkeypatch)
    (_, how, _, _), _ = _obtain_warned()
    assert not marker.exists(), "the planted library's constructor ran"
    assert all(str(theirs) not in p for p in loads)
    assert how in ("compiled", "compiled-in-memory")


def test_directories_above_the_cache_must_not_be_writable_by_others(tmp_path, monkeypatch):
    """Anyone who can rename a directory above the cache can swap the cache; a sticky directory
    (like /tmp) is fine, since others cannot rename what they do not own there."""
    cc.set_builder(StandIn().builder)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv(cc.ENV_CACHE_DIR, str(shared / "cache"))
    (_, how, _, _), warned = _obtain_warned()
    assert how == "compiled-in-memory" and len(warned) == 1 and str(shared) in warned[0]
    assert store.tree_problem(shared / "cache", cc.entry_path(SMALL, ARCH).parent) is not None
    os.chmod(shared, 0o1777)  # sticky, owned by this user
    assert store.tree_problem(shared / "cache", cc.entry_path(SMALL, ARCH).parent) is None


def test_a_trusted_cache_still_loads_its_own_entries(isolated_cache):
    """The guard: what this user wrote (the real kernel) is loaded, without a warning."""
    _, how, _, entry = cc.obtain(SMALL, ARCH)
    assert how == "compiled"
    cc.reset_memory_cache()
    (_, how, _, _), warned = _obtain_warned()
    assert how == "loaded" and warned == []


def test_entry_writable_by_others_inside_a_trusted_cache_is_rebuilt(isolated_cache):
    _, how, _, entry = cc.obtain(SMALL, ARCH)
    os.chmod(entry / "kernel.so", 0o777)
    cc.reset_memory_cache()
    _, how, _, entry2 = cc.obtain(SMALL, ARCH)
    assert (how, entry2) == ("rebuilt", entry) and cc.COUNTERS.rebuilds == 1
    assert _mode(entry / "kernel.so") & 0o022 == 0 and _mode(entry / "manifest.json") & 0o022 == 0


@pytest.mark.skipif(not IS_ROOT, reason="a real foreign owner needs chown (root)")
def test_entry_owned_by_another_user_inside_a_trusted_cache_is_rebuilt(isolated_cache):
    _, _, _, entry = cc.obtain(SMALL, ARCH)
    os.lchown(entry / "manifest.json", OTHER_UID, OTHER_UID)
    cc.reset_memory_cache()
    _, how, _, _ = cc.obtain(SMALL, ARCH)
    assert how == "rebuilt" and cc.COUNTERS.disk_loads == 0
    assert os.lstat(entry / "manifest.json").st_uid == os.geteuid()


# ------------------------------------------------------------------ item 2: how the cache touches the disk
def test_cache_directories_and_files_are_private_even_under_umask_000(tmp_path, monkeypatch):
    """Directories are created private (not 0755, nor 0777 under umask 000), missing parents included."""
    root = tmp_path / "a" / "b" / "cache"
    monkeypatch.setenv(cc.ENV_CACHE_DIR, str(root))
    old = os.umask(0)
    try:
        _, how, _, entry = cc.obtain(SMALL, ARCH)
    finally:
        os.umask(old)
    assert how == "compiled"
    for d in (tmp_path / "a", tmp_path / "a" / "b", root, root / "v1", entry.parent, entry):
        assert _mode(d) == 0o700, (d, oct(_mode(d)))
    assert _mode(entry / "manifest.json") == 0o600
    assert _mode(entry / "kernel.so") & 0o077 == 0
    cc.reset_memory_cache()
    assert cc.obtain(SMALL, ARCH)[1] == "loaded"


def test_lock_file_symlink_is_not_followed(tmp_path, isolated_cache):
    """A planted symlink at the lock path used to make the process create the file it points to."""
    cc.set_builder(StandIn().builder)
    entry = cc.entry_path(SMALL, ARCH)
    entry.parent.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "created-through-the-link"
    os.symlink(victim, entry.parent / f".{entry.name}.lock")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stand-in cannot export: in-memory, warned
        cc.obtain(SMALL, ARCH)
    assert not os.path.lexists(victim)


def _try_load_with_timeout(entry, key, seconds=10.0):
    result = {}
    t = threading.Thread(target=lambda: result.update(r=store.try_load(entry, key)), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():  # release the reader stuck on a FIFO, then fail
        for name in ("manifest.json", "kernel.so"):
            try:
                fd = os.open(entry / name, os.O_WRONLY | os.O_NONBLOCK)
                os.close(fd)
            except OSError:
                pass
        t.join(5)
        pytest.fail("try_load hung on a FIFO")
    return result["r"]


@pytest.mark.parametrize("fifo", ["manifest.json", "kernel.so"])
def test_fifo_in_an_entry_is_refused_without_hanging(fifo, tmp_path):
    """A FIFO planted as manifest.json or kernel.so used to block the process forever."""
    cc.set_builder(StandIn().builder)
    entry = cc.entry_path(SMALL, ARCH)
    entry.mkdir(parents=True, mode=0o700)
    data = b"\x7fELF not really"
    (entry / "manifest.json").write_text(json.dumps({
        "key": cc.entry_key(SMALL, ARCH), "artifact": "kernel.so", "function_name": "f",
        "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    (entry / "kernel.so").write_bytes(data)
    (entry / fifo).unlink()
    os.mkfifo(entry / fifo, 0o600)
    fn, problem = _try_load_with_timeout(entry, cc.entry_key(SMALL, ARCH))
    assert fn is None and "regular file" in problem


def test_dangling_symlink_entry_is_discarded_and_rebuilt(tmp_path, isolated_cache):
    """Used to make every process compile in memory for that spec, for good (rename onto the link failed)."""
    entry = cc.entry_path(SMALL, ARCH)
    entry.parent.mkdir(parents=True, mode=0o700)
    os.symlink(tmp_path / "nowhere", entry)
    (_, how, _, got), warned = _obtain_warned()
    assert (how, got, warned) == ("rebuilt", entry, [])
    assert stat.S_ISDIR(os.lstat(entry).st_mode)
    assert not [p for p in entry.parent.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    cc.reset_memory_cache()
    assert cc.obtain(SMALL, ARCH)[1] == "loaded"


def test_symlinked_entry_to_a_valid_directory_is_not_followed(tmp_path, isolated_cache, monkeypatch):
    _, _, _, entry = cc.obtain(SMALL, ARCH)
    elsewhere = tmp_path / "elsewhere"
    os.rename(entry, elsewhere)
    os.symlink(elsewhere, entry)
    cc.reset_memory_cache()
    loads = _spy_loads(monkeypatch)
    _, how, _, _ = cc.obtain(SMALL, ARCH)
    assert how == "rebuilt" and not any(str(elsewhere) in p for p in loads)


def _lock_out(monkeypatch, root: Path):
    """Make everything strictly inside ``root`` fail with EACCES, as a mode-000 directory does for
    anyone but root (the tests may run as root, for whom modes do not apply)."""
    root = os.path.abspath(root)

    def inside(path) -> bool:
        try:
            p = os.path.abspath(os.fsdecode(path))
        except TypeError:
            return False  # a file descriptor
        return p.startswith(root + os.sep)

    for name in ("stat", "lstat", "open", "mkdir", "listdir", "scandir", "rename", "unlink", "rmdir"):
        real = getattr(os, name)

        def wrapper(path, *args, _real=real, **kwargs):
            if inside(path):
                raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, wrapper)


def test_unreadable_cache_falls_back_to_memory_with_the_warning(isolated_cache, monkeypatch):
    """A cache made unreadable by permissions used to raise PermissionError out of the call."""
    cc.set_builder(StandIn().builder)
    isolated_cache.mkdir(mode=0o700)
    _lock_out(monkeypatch, isolated_cache)
    (_, how, _, entry), warned = _obtain_warned()
    assert (how, entry) == ("compiled-in-memory", None)
    assert len(warned) == 1 and "PermissionError" in warned[0]


@pytest.mark.skipif(IS_ROOT, reason="modes do not restrict root")
def test_mode_000_cache_falls_back_to_memory_with_the_warning(isolated_cache):
    cc.set_builder(StandIn().builder)
    isolated_cache.mkdir(mode=0o700)
    os.chmod(isolated_cache, 0)
    try:
        (_, how, _, _), warned = _obtain_warned()
    finally:
        os.chmod(isolated_cache, 0o700)
    assert how == "compiled-in-memory" and len(warned) == 1


# ------------------------------------------------------------------ precompile: say when nothing was saved
def test_precompile_fails_when_nothing_could_be_saved(tmp_path, capsys):
    """It used to exit 0 with an empty cache (an image build would pass)."""
    cc.set_builder(StandIn().builder)
    blocker = tmp_path / "a-regular-file"
    blocker.write_text("")
    assert cli.main(["precompile", "--arch", ARCH, "--config", "32,32,1", "--cache-dir", str(blocker)]) == 1
    err = capsys.readouterr().err
    assert "not saved" in err and str(blocker) in err


def test_precompile_json_counts_what_was_not_saved(tmp_path, capsys):
    cc.set_builder(StandIn().builder)
    blocker = tmp_path / "a-regular-file"
    blocker.write_text("")
    assert cli.main(["precompile", "--arch", ARCH, "--config", "32,32,1", "--cache-dir", str(blocker),
                     "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["unsaved"] == 1 and out["results"][0]["how"] == "compiled-in-memory"


def test_precompile_empty_cache_dir_is_a_usage_error(capsys):
    """--cache-dir '' used to fall back to the default directory without a word."""
    assert cli.main(["precompile", "--list", "--cache-dir", ""]) == 2
    assert "--cache-dir" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["sm_999f", "sm_91a", "sm_75"])
def test_precompile_unknown_arch_is_a_usage_error(arch, capsys):
    """sm_999f used to pass the format check and die with KeyError (exit 1)."""
    assert cli.main(["precompile", "--arch", arch, "--config", "32,32,1"]) == 2
    err = capsys.readouterr().err
    assert arch in err and "sm_90a" in err and "sm_100a" in err
    with pytest.raises(ValueError, match=rf"^arch: expected one of .*got '{arch}'"):
        cc.get_compiled(SMALL, arch)


def test_supported_arches_are_the_dsls():
    """The list the checks use is the compiler's own list of targets (kept by hand, checked here)."""
    enums = pytest.importorskip("cutlass.base_dsl.enums")
    from mamba3_step.arch import SUPPORTED_ARCHS

    assert set(SUPPORTED_ARCHS) == set(enums.Arch.__members__)  # aliases (sm_101 = sm_110) included


@pytest.mark.parametrize("manifest", [
    b"[" * 200_000 + b"]" * 200_000,  # the json module recurses once per level
    b'{"key": ' * 5000 + b"0" + b"}" * 5000,
    b'{"key": "' + b"x" * (1 << 16) + b'"}',  # past the size bound
    b"\xff\xfe not text",
])
def test_a_manifest_that_cannot_be_parsed_within_bounds_is_corrupt_and_rebuilt(manifest, isolated_cache):
    """Any entry whose manifest is not a JSON object within the size and depth bounds is discarded and
    rebuilt, on every lookup path, without an exception escaping."""
    _, _, _, entry = cc.obtain(SMALL, ARCH)
    (entry / "manifest.json").write_bytes(manifest)
    cc.reset_memory_cache()
    (_, how, _, got), warned = _obtain_warned()
    assert (how, got, warned) == ("rebuilt", entry, [])
    assert cc.COUNTERS.rebuilds == 1
    cc.reset_memory_cache()
    assert cc.obtain(SMALL, ARCH)[1] == "loaded"


def test_manifest_depth_bound_leaves_room_for_real_manifests(isolated_cache):
    """The bound refuses no manifest the cache writes (3 levels), and counts brackets in strings as text."""
    _, _, _, entry = cc.obtain(SMALL, ARCH)
    data = (entry / "manifest.json").read_bytes()
    assert store.parse_manifest(data) == json.loads(data)
    deep_text = json.dumps({"key": "[" * 100, "n": [[[1]]]}).encode()
    assert store.parse_manifest(deep_text) == json.loads(deep_text)
    with pytest.raises(ValueError, match="nests deeper"):
        store.parse_manifest(b"[" * (store.MANIFEST_MAX_DEPTH + 1) + b"]" * (store.MANIFEST_MAX_DEPTH + 1))
