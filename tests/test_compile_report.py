"""`elastic_np._compile_report.watch`: what it sees, and that a call pays no listener registration."""

import threading

import numba
import numba.core.event
import pytest

from elastic_np import _compile_report


def fresh_function():
    """A Numba function not compiled yet (one per call: each compiles on its first call)."""

    @numba.njit(fastmath=False)
    def add_one(x):
        return x + 1

    return add_one


def test_sees_a_compile_in_the_block_and_not_outside():
    outside = fresh_function()
    with _compile_report.watch() as seen:
        fresh_function()(1)
    outside(1)
    assert "add_one" in {str(name).rsplit(".", 1)[-1] for name in seen.compiled}
    with _compile_report.watch() as quiet:
        pass
    assert not quiet.compiled and "no compile" in quiet.summary()


def test_nested_blocks_and_other_threads_see_it():
    with _compile_report.watch() as outer:
        with _compile_report.watch() as inner:
            worker = threading.Thread(target=fresh_function(), args=(1,))
            worker.start()
            worker.join()
    assert inner.compiled and outer.compiled == inner.compiled


def test_listeners_are_registered_once(monkeypatch):
    with _compile_report.watch():
        pass
    calls = []
    monkeypatch.setattr(numba.core.event, "register", lambda *args: calls.append(args))
    for _ in range(5):
        with _compile_report.watch():
            pass
    assert calls == []


def test_a_block_that_raises_stops_watching():
    with pytest.raises(ValueError):
        with _compile_report.watch() as raised:
            raise ValueError("inside")
    with _compile_report.watch() as seen:
        fresh_function()(1)
    assert seen.compiled and not raised.compiled
