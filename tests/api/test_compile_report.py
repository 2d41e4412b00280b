"""`elastic_np._api.compile_report`: what `watch` sees, that a call pays no listener registration, and the
announcement of a process's first compile (`elastic_np.CompileWarning`)."""

import inspect
import os
import subprocess
import sys
import threading
import types
import warnings

import numba
import numba.core.event
import numpy as np
import pytest

import elastic_np as enp
from elastic_np._api import compile_report


def fresh_function():
    """A Numba function not compiled yet (one per call: each compiles on its first call)."""

    @numba.njit(fastmath=False)
    def add_one(x):
        return x + 1

    return add_one


def test_sees_a_compile_in_the_block_and_not_outside():
    outside = fresh_function()
    with compile_report.watch() as seen:
        fresh_function()(1)
    outside(1)
    assert "add_one" in {str(name).rsplit(".", 1)[-1] for name in seen.compiled}
    with compile_report.watch() as quiet:
        pass
    assert not quiet.compiled and "no compile" in quiet.summary()


def test_nested_blocks_and_other_threads_see_it():
    with compile_report.watch() as outer:
        with compile_report.watch() as inner:
            worker = threading.Thread(target=fresh_function(), args=(1,))
            worker.start()
            worker.join()
    assert inner.compiled and outer.compiled == inner.compiled


def test_listeners_are_registered_once(monkeypatch):
    with compile_report.watch():
        pass
    calls = []
    monkeypatch.setattr(numba.core.event, "register", lambda *args: calls.append(args))
    for _ in range(5):
        with compile_report.watch():
            pass
    assert calls == []


def test_a_block_that_raises_stops_watching():
    with pytest.raises(ValueError):
        with compile_report.watch() as raised:
            raise ValueError("inside")
    with compile_report.watch() as seen:
        fresh_function()(1)
    assert seen.compiled and not raised.compiled


# ---------------------------------------------------------------------------
# The announcement of a process's first compile (`elastic_np.CompileWarning`)
# ---------------------------------------------------------------------------


@pytest.fixture
def notice(monkeypatch):
    """A notice still due (the suite's own is made already: tests/conftest.py)."""
    fresh = compile_report._Notice()
    monkeypatch.setattr(compile_report, "NOTICE", fresh)
    return fresh


@pytest.fixture
def package_function(monkeypatch):
    """A maker of fresh Numba functions of a module in the package (the notice announces only its compiles)."""
    module = types.ModuleType("elastic_np._compile_probe")
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def make():
        exec("def add_one(x):\n    return x + 1\n", module.__dict__)
        return numba.njit(fastmath=False)(module.add_one)

    return make


def test_the_first_compile_is_announced_once_at_the_callers_line(notice, package_function):
    first, second = package_function(), package_function()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with compile_report.reported("cpu", "forward", np.dtype(np.float32)):
            line = inspect.currentframe().f_lineno + 1
            assert first(1) == 2
        with compile_report.reported("cpu", "backward", np.dtype(np.float64)) as seen:
            second(1)
    assert seen.compiled  # a second compile, and no second notice
    assert [w.category for w in caught] == [enp.CompileWarning]
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    message = str(caught[0].message)
    for part in ("cpu backend's forward for float32", "seconds, once", "cache", "elastic_np.warmup()",
                 "elastic-np warmup", "category=elastic_np.CompileWarning"):
        assert part in message
    assert not notice.due and not notice.blocks


def test_what_is_not_announced(notice, package_function):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with compile_report.reported("cpu", "forward", "float32"):
            fresh_function()(1)  # not the package's code
        package_function()(1)  # the package's, outside a call
        with compile_report.unannounced(), compile_report.reported("cpu", "forward", "float32"):
            package_function()(1)  # asked for (`elastic_np.warmup`)
    assert caught == [] and notice.due
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=enp.CompileWarning)
        with compile_report.reported("cpu", "forward", "float32"):
            package_function()(1)
    assert caught == [] and not notice.due  # silenced by the filter


def test_an_error_filter_raises_in_the_callers_thread_after_the_compile(notice, package_function):
    compiled_in_a_thread = package_function()
    with warnings.catch_warnings():
        warnings.simplefilter("error", enp.CompileWarning)
        with pytest.raises(enp.CompileWarning, match="cpu backend's forward for bfloat16"):
            with compile_report.reported("cpu", "forward", "bfloat16"):
                worker = threading.Thread(target=compiled_in_a_thread, args=(1,))
                worker.start()
                worker.join()
    with compile_report.watch() as seen:
        assert compiled_in_a_thread(2) == 3
    assert not seen.compiled and not notice.blocks


# A fresh process, logging unconfigured: ``python SCRIPT [filtered] CALL...``
# makes the calls named (a decode forward; with a soft-cap; with a dynamic
# window), printing how many functions each compiled.
CALLS = r"""
import sys
import warnings

import numpy as np

import elastic_np as enp
from elastic_np._api import compile_report

if sys.argv[1] == "filtered":
    warnings.filterwarnings("ignore", category=enp.CompileWarning)
rng = np.random.default_rng(0)
q, (k, v) = rng.standard_normal((1, 4, 1, 16)), rng.standard_normal((2, 1, 2, 30, 16))
OPTIONS = {"plain": {}, "softcap": {"softcap": 5.0}, "window": {"dynamic_window": enp.DynamicWindow(2.0)}}
for name in sys.argv[2:]:
    with compile_report.watch() as seen:
        enp.attention(q, k, v, backend="cpu", **OPTIONS[name])  # the call
    print(len(seen.compiled))
"""


def test_a_fresh_process_announces_its_first_compile_on_stderr_once(tmp_path):
    script = tmp_path / "calls.py"
    script.write_text(CALLS)
    line = CALLS.splitlines().index(next(t for t in CALLS.splitlines() if t.endswith("# the call"))) + 1
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "empty cache"))

    def run(*args):
        done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                              timeout=600)
        assert done.returncode == 0, done.stderr
        return [int(n) for n in done.stdout.split()], done.stderr

    compiled, stderr = run("shown", "plain", "softcap")  # an empty cache: both compile
    assert all(compiled) and stderr.count(": CompileWarning: ") == 1, (compiled, stderr)
    assert f"{script}:{line}: CompileWarning: elastic_np is compiling the cpu backend's forward for float64" in stderr
    compiled, stderr = run("shown", "plain", "softcap")  # loaded from the cache the first run filled
    assert compiled == [0, 0] and "CompileWarning" not in stderr, stderr
    compiled, stderr = run("filtered", "plain", "window")
    assert compiled[0] == 0 and compiled[1] > 0 and "CompileWarning" not in stderr, stderr
