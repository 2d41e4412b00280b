"""`elastic-np check`'s first compile: the second dtype in a child process, Numba's cache under a lock."""

import os
import subprocess
import sys

import numpy as np
import pytest

from elastic_np.cli import _first_compile
from elastic_np.testing import _cases
from elastic_np.cpu._runtime import numba_private as _numba_private

pytest.importorskip("fcntl")

SAVES = """
import sys
from numba.core.caching import IndexDataCacheFile
from elastic_np.cli._first_compile import locked_cache_index
folder, who, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
cache = IndexDataCacheFile(cache_path=folder, filename_base="f", source_stamp="stamp")
with locked_cache_index():
    for n in range(count):
        cache.save((who, n), f"{who}-{n}")
"""


def test_two_processes_saving_under_the_lock_keep_every_entry(tmp_path):
    # Without the lock both read the index, each writes it back with its own
    # entry only, and entries (or the data files they name) are lost.
    from numba.core.caching import IndexDataCacheFile

    count = 150
    runs = [
        subprocess.Popen([sys.executable, "-c", SAVES, str(tmp_path), who, str(count)], stderr=subprocess.PIPE)
        for who in ("a", "b")
    ]
    assert all(run.wait(timeout=300) == 0 for run in runs), [run.stderr.read() for run in runs]
    cache = IndexDataCacheFile(cache_path=str(tmp_path), filename_base="f", source_stamp="stamp")
    for who in ("a", "b"):
        for n in range(count):
            assert cache.load((who, n)) == f"{who}-{n}"
    assert (tmp_path / _numba_private.LOCK_NAME).exists()


def test_the_lock_holds_only_inside_the_block(tmp_path):
    from numba.core.caching import IndexDataCacheFile

    save, load = IndexDataCacheFile.save, IndexDataCacheFile.load
    cache = IndexDataCacheFile(cache_path=str(tmp_path), filename_base="f", source_stamp="stamp")
    with _first_compile.locked_cache_index():
        assert IndexDataCacheFile.save is not save
        assert cache.load("key") is None  # nothing saved yet
        cache.save("key", [1, 2])
        assert cache.load("key") == [1, 2]
    assert (IndexDataCacheFile.save, IndexDataCacheFile.load) == (save, load)
    assert cache.load("key") == [1, 2]


class _Child:
    """A child process that compiled ``_Child.printed`` (its stdout) and exited with ``_Child.exit_code``."""

    printed, exit_code = '["_forward_kernel", "_exp_f64"]\n', 0

    def __init__(self, command, **kwargs):
        self.command, self.env, self.returncode = command, kwargs["env"], None
        _Child.started.append(self)

    def communicate(self):
        self.returncode = _Child.exit_code
        return _Child.printed, None

    def wait(self):
        return self.returncode

    def poll(self):
        return self.returncode


@pytest.mark.parametrize("cores, private, split", [(2, True, True), (1, True, False), (2, False, False)])
def test_the_second_dtype_compiles_in_a_child_where_there_are_cores(monkeypatch, cores, private, split):
    """Only with the private path ``two_process_check`` on (it patches Numba's cache classes)."""
    ran = []
    _Child.started = []
    on = _numba_private.PATHS if private else ()
    monkeypatch.setattr(_numba_private, "_ON", frozenset(on))
    monkeypatch.setattr(_first_compile, "run_cases", lambda name, dtypes, step=None: ran.append((name, list(dtypes))))
    monkeypatch.setattr(_first_compile, "_cores", lambda: cores)
    monkeypatch.setattr(subprocess, "Popen", _Child)
    steps = []
    child_compiled = _first_compile.compile_backend("cpu", (np.float32, np.float64), step=steps.append)
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    if split:
        assert ran == [("cpu", [f32])]
        # what the child printed: the parent adds it to what it reports as compiled
        assert child_compiled == {"_forward_kernel", "_exp_f64"}
        assert steps == ["waiting for float64 in a second process"]
        (child,) = _Child.started
        assert child.command[1:] == ["-m", "elastic_np.cli._first_compile", "cpu", "float64"]
        # the child imports this very package, whatever its working folder
        root = os.path.dirname(os.path.dirname(os.path.dirname(_first_compile.__file__)))
        assert child.env["PYTHONPATH"].split(os.pathsep)[0] == os.path.abspath(root)
    else:
        assert ran == [("cpu", [f32, f64])] and not _Child.started and child_compiled == frozenset()
    ran.clear()
    assert _first_compile.compile_backend("reference", (np.float64,)) == frozenset()
    assert ran == [("reference", [f64])]


@pytest.mark.parametrize("printed, exit_code, names", [
    ("[]\n", 0, frozenset()),  # loaded everything from the cache
    ("numba says hello\n[\"_decode_kernel\"]\n", 0, {"_decode_kernel"}),
    ('["_decode_kernel"]\n', 1, None),  # failed after printing
    ("", 0, None),
    ("Traceback ...\n", 0, None),
])
def test_what_the_child_compiled_or_none_when_it_failed(monkeypatch, printed, exit_code, names):
    monkeypatch.setattr(_numba_private, "_ON", frozenset(_numba_private.PATHS))
    monkeypatch.setattr(_first_compile, "run_cases", lambda name, dtypes, step=None: None)
    monkeypatch.setattr(_first_compile, "_cores", lambda: 2)
    monkeypatch.setattr(subprocess, "Popen", _Child)
    monkeypatch.setattr(_Child, "printed", printed)
    monkeypatch.setattr(_Child, "exit_code", exit_code)
    _Child.started = []
    assert _first_compile.compile_backend("cpu", ("float32", "float64")) == names


def test_run_cases_says_what_runs_next(monkeypatch):
    from elastic_np import testing

    calls = []
    monkeypatch.setattr(testing, "backend_functions", lambda name: (
        lambda *a, **o: calls.append("forward"), lambda *a, **o: calls.append("backward")))
    steps = []
    _first_compile.run_cases("cpu", [np.dtype(np.float64)], step=lambda text: steps.append((text, len(calls))))
    assert steps[:2] == [("float64 'plain', forward", 0), ("float64 'plain', backward", 1)]
    float_cases = [c for c in _cases.CASES if c.name in _first_compile.WARMUP_CASES and c.cache is None]
    assert len(steps) == 2 * len(float_cases) == len(calls)  # a quantized cache's cases: q in float32 or a half
    steps.clear()
    calls.clear()
    _first_compile.run_cases("cpu", [np.dtype(np.float32)], step=lambda text: steps.append((text, len(calls))))
    caches = [c for c in _cases.CASES if c.name in _first_compile.WARMUP_CASES and c.cache is not None
              and not _cases.unavailable(c)]
    assert caches and [text for text, _ in steps[-len(caches):]] == [f"float32 {c.name!r}, forward" for c in caches]
    assert len(steps) == 2 * len(float_cases) + len(caches) == len(calls)  # forward only


def test_the_child_command_runs_the_module_as_a_script_cleanly(tmp_path):
    """``python -m elastic_np.cli._first_compile``: the tools' package does not import the module first
    (runpy would warn that it runs a second copy)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(_first_compile.__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "elastic_np.cli._first_compile", "reference", "float64"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert _first_compile._child_compiled(result.returncode, result.stdout) == frozenset()  # the oracles never compile


def test_the_child_imports_this_copy_even_beside_another(tmp_path, monkeypatch):
    """Run from a folder holding another elastic_np (a source checkout), the child still imports this one."""
    decoy = tmp_path / "elastic_np"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy copy')\n")
    monkeypatch.chdir(tmp_path)
    import elastic_np

    found = subprocess.run([sys.executable, "-c", "import elastic_np; print(elastic_np.__file__)"],
                           capture_output=True, text=True, check=True, **_first_compile.child_options())
    assert found.stdout.strip() == elastic_np.__file__
    plain = subprocess.run([sys.executable, "-c", "import elastic_np"], capture_output=True, text=True)
    assert "the decoy copy" in plain.stderr  # what the child would import without them
