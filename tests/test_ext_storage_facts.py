"""slimgrad._ext: the storage facts of NOTE [Storage facts from the C++ API], checked against what
PyTorch states in Python, and the extension's lazy build and its failure path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from slimgrad import _ext, ownership
from tests._child import run_checks
from tests._ownership_helpers import storage_use_count

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def facts():
    if _ext.load() is None:
        pytest.fail(f"the C++ extension did not build: {_ext.error()}")
    return _ext.facts


def test_counts_match_pytorch(facts):
    t = torch.empty(6)
    f = facts(t)
    assert f[0] == t._use_count() == 1
    assert f[1] == storage_use_count(t) == 1
    assert f[3] == 0 and f[4] == 24 and f[5] == 1
    view = t.view(2, 3)
    assert facts(t)[1] == storage_use_count(t) == 2  # the view's TensorImpl
    assert facts(view)[6] == f[6] != facts(torch.empty(6))[6]  # same StorageImpl, another's
    del view
    assert facts(t)[1] == 1
    assert facts(t)[3] == 0 and storage_use_count(t) == 1  # asking made no storage object


def test_storage_object_and_weak_references_show(facts):
    from torch.multiprocessing.reductions import StorageWeakRef

    t = torch.empty(4)
    fresh = facts(t)
    t.untyped_storage()  # dropped: PyTorch keeps it alive with the storage
    kept = facts(t)
    assert kept[3] == 1 and kept[1] == fresh[1] + 1
    ref = StorageWeakRef(t.untyped_storage())
    assert facts(t)[2] == fresh[2] + 1
    del ref
    assert facts(t)[2] == fresh[2]


def test_tensor_use_count_sees_cpp_holders(facts):
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    assert facts(y)[0] == y._use_count()
    z = y.sin()  # sin saves its input: autograd's SavedVariable holds y's TensorImpl
    assert facts(y)[0] == y._use_count() == 2
    del z
    assert facts(y)[0] == 1


def test_foreign_memory_is_not_torch_owned(facts):
    np = pytest.importorskip("numpy")
    assert facts(torch.empty(3))[5] == 1 and facts(torch.randn(2, 3) @ torch.randn(3, 2))[5] == 1
    assert facts(torch.zeros(1 << 21))[5] == 1  # a large block the C library maps separately
    assert facts(torch.from_numpy(np.ones(3)))[5] == 0
    assert facts(torch.frombuffer(bytearray(16), dtype=torch.float32))[5] == 0
    assert facts(torch.ones(3).share_memory_())[5] == 0
    assert facts(torch.from_dlpack(np.ones(4)))[5] == 0
    t = torch.empty(5)
    t.share_memory_()  # the same StorageImpl, a new DataPtr
    assert facts(t)[5] == 0


def test_nbytes_and_no_storage(facts):
    big = torch.empty(100)
    big.resize_(10)
    assert facts(big)[4] == 400
    assert facts(torch.empty(0))[4] == 0
    with pytest.raises(TypeError):
        facts(object())


# One fresh child (tests/_child.py) for the two checks that need one, in this order: importing
# slimgrad and running an op build nothing (the cache stays empty, nothing tried); then, with no
# C++ compiler, reuse is off with the same gradients and `slimgrad env` says why.
_CHECK_IMPORT_AND_FORWARD = """
    import torch, slimgrad
    from slimgrad import _ext
    from slimgrad.ops import gelu
    gelu(torch.randn(5))
    built = sorted(p.name for p in _ext.cache_dir().glob("*"))
    assert _ext._state["tried"] is False and built == [], (_ext._state["tried"], built)
"""

_CHECK_NO_COMPILER = """
    import os, torch
    from slimgrad import _compat, _ext, ownership
    from tests._ownership_helpers import ExpSaved
    os.environ["CXX"] = os.path.join(os.environ["SLIMGRAD_CACHE"], "no-such-c++")

    def grads():
        x = torch.linspace(-1, 1, 7, requires_grad=True)
        ownership.reset_reuse_count()
        (ExpSaved.apply(x * 0.5) * 3).sum().backward()
        return x.grad, ownership.reuse_count()

    with ownership.reuse_disabled():
        ref, _ = grads()
    got, n = grads()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    feat = next(f for f in _compat.features() if f.name == "buffer reuse (ownership)")
    assert (n, feat.on) == (0, False), (n, feat.on)
    assert "no C++ compiler" in _ext.error() and "no C++ compiler" in feat.detail, feat.detail
"""


@pytest.fixture(scope="module")
def fresh_child(tmp_path_factory):
    env = {"SLIMGRAD_CACHE": str(tmp_path_factory.mktemp("ext_cache")), "SLIMGRAD_NO_REUSE": None}
    checks = {"import": _CHECK_IMPORT_AND_FORWARD, "no_compiler": _CHECK_NO_COMPILER}
    return run_checks(checks, env=env)


def test_import_and_forward_build_nothing(fresh_child):
    assert fresh_child["import"] == "ok", fresh_child["import"]


def test_without_a_compiler_reuse_is_off_same_gradients_and_env_says_why(fresh_child, monkeypatch):
    assert fresh_child["no_compiler"] == "ok", fresh_child["no_compiler"]
    # with a compiler (and this session's cached build): granted, the same bits (this process)
    from slimgrad import _compat
    from tests._ownership_helpers import ExpSaved

    monkeypatch.delenv(ownership.ENV_VAR, raising=False)

    def grads():
        x = torch.linspace(-1, 1, 7, requires_grad=True)
        ownership.reset_reuse_count()
        (ExpSaved.apply(x * 0.5) * 3).sum().backward()
        return x.grad, ownership.reuse_count()

    with ownership.reuse_disabled():
        ref, _ = grads()
    got, n = grads()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    feat = next(f for f in _compat.features() if f.name == "buffer reuse (ownership)")
    assert (n, feat.on) == (1, True), (n, feat.on, feat.detail)


def test_a_failed_build_is_recorded_for_slimgrad_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMGRAD_CACHE", str(tmp_path))
    monkeypatch.setattr(_ext, "_state", {"module": None, "error": None, "tried": False})
    assert _ext.probe()[0]  # a compiler is here: buildable

    def broken():
        raise RuntimeError("Error building extension\nstorage_facts.cpp:3:1: error: simulated")

    monkeypatch.setattr(_ext, "_build", broken)
    assert _ext.load() is None
    assert _ext.error() == "RuntimeError: storage_facts.cpp:3:1: error: simulated"
    monkeypatch.setattr(_ext, "_state", {"module": None, "error": None, "tried": False})
    ok, why = _ext.probe()  # as another process sees it
    assert not ok and "error: simulated" in why


def test_ownership_decisions_cost_microseconds(facts):
    # the storage facts of one tensor: one C call (the number is in the report)
    import timeit

    t = torch.empty(16)
    per_call = min(timeit.repeat(lambda: facts(t), number=2000, repeat=5)) / 2000
    assert per_call < 20e-6, per_call
    assert ownership.storage_facts_available()


def _fake_load(monkeypatch, seen, lock):
    # torch's load as far as its baton goes: what it finds in the folder when it starts
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: seen.append(lock.exists()))


def test_a_lock_its_builder_left_is_removed_however_young(tmp_path, monkeypatch):
    # NOTE [A build lock nobody holds]: torch's FileBaton waits forever on a lock a killed build
    # left behind; before, one younger than _STALE_LOCK_S was waited on (forever)
    monkeypatch.setenv("SLIMGRAD_CACHE", str(tmp_path))
    seen = []
    lock = _ext._build_dir() / "lock"
    _fake_load(monkeypatch, seen, lock)
    lock.parent.mkdir(parents=True)
    lock.touch()  # a builder killed a moment ago
    with pytest.warns(RuntimeWarning, match="removed the stale build lock .*lock; expected"):
        _ext._build()
    assert seen == [False] and not lock.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ext._build()  # nothing left behind: no warning
    assert seen == [False, False]


def test_a_live_builder_is_waited_for_and_its_lock_removed_once_it_is_killed(tmp_path, monkeypatch):
    # another process holds the build (slimgrad's flock, then torch's baton) and is killed
    # mid-build: this process waits while it lives, then goes on without its lock
    import signal
    import threading

    monkeypatch.setenv("SLIMGRAD_CACHE", str(tmp_path))
    path = _ext._build_dir()
    path.mkdir(parents=True)
    lock = path / "lock"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import sys, time
                from pathlib import Path
                from slimgrad import _ext
                path = Path(sys.argv[1])
                with _ext._build_lock(path):
                    (path / "lock").touch()  # torch's baton, taken and never released
                    print("building", flush=True)
                    time.sleep(600)
                """
            ),
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    try:
        assert child.stdout.readline().strip() == "building"
        seen = []
        _fake_load(monkeypatch, seen, lock)
        done = threading.Event()
        caught = []

        def load():
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                _ext._build()
            caught.extend(w)
            done.set()

        th = threading.Thread(target=load, daemon=True)
        th.start()
        assert not done.wait(1.0), "went on while the builder lives"
        assert lock.exists() and seen == []
        child.send_signal(signal.SIGKILL)  # killed mid-build: its flock goes, its lock stays
        assert done.wait(60), "still waiting after the builder was killed"
        assert seen == [False] and not lock.exists()
        assert [str(w.message).split(";")[0] for w in caught] == [
            f"slimgrad._ext: removed the stale build lock {lock}"
        ]
    finally:
        child.kill()
        child.wait()


def test_without_flock_only_an_old_lock_is_stale(tmp_path, monkeypatch):
    # where flock is unavailable (Windows, a file system that refuses it): the lock's age decides
    import fcntl

    def refused(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refused)
    monkeypatch.setenv("SLIMGRAD_CACHE", str(tmp_path))
    seen = []
    lock = _ext._build_dir() / "lock"
    _fake_load(monkeypatch, seen, lock)
    lock.parent.mkdir(parents=True)
    lock.touch()
    _ext._build()  # young: maybe a live builder; left for torch to wait on
    old = lock.stat().st_mtime - _ext._STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="removed the stale build lock"):
        _ext._build()
    assert seen == [True, False]


def test_no_ext_env_var_skips_the_build(monkeypatch):
    monkeypatch.setenv(_ext.ENV_VAR, "1")
    monkeypatch.setattr(_ext, "_state", {"module": None, "error": None, "tried": False})
    monkeypatch.setattr(_ext, "_build", lambda: pytest.fail("built despite SLIMGRAD_NO_EXT=1"))
    assert _ext.load() is None
    assert _ext.error() == f"turned off by {_ext.ENV_VAR}=1"
    assert _ext.probe() == (False, f"turned off by {_ext.ENV_VAR}=1")


def test_the_build_names_its_own_copies_of_the_sources(facts):
    # NOTE [The extension builds from copies in its own folder]: build.ninja names the copies in
    # the content-addressed folder, never this checkout's files, so another checkout with the same
    # sources finds nothing to rebuild; loading again does not rewrite the copies
    path = _ext._build_dir()
    ninja = (path / "build.ninja").read_text()
    for src in _ext.SOURCES:
        assert str(path / src.name) in ninja, ninja
        assert str(src) not in ninja, ninja
        assert (path / src.name).read_bytes() == src.read_bytes()
    stamps = [(path / s.name).stat().st_mtime_ns for s in _ext.SOURCES]
    _ext._sources_in(path)
    assert [(path / s.name).stat().st_mtime_ns for s in _ext.SOURCES] == stamps
