"""The CPU kernels' thread pool: Python threads, fork, resizing, small calls, no Numba threading layer."""

import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

import elastic_np as enp
from elastic_np import cpu
from oracle_checks import make_inputs


def test_concurrent_calls_from_python_threads_agree_with_sequential_ones():
    """Calls from several Python threads share the kernels' thread pool safely."""
    import concurrent.futures

    problems = [make_inputs(np.float32, seed=s) for s in range(4)]

    def run(inputs):
        q, k, v, dout = inputs
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", causal=True)
        return out, enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", causal=True).dq

    sequential = [run(p) for p in problems]
    with concurrent.futures.ThreadPoolExecutor(4) as callers:
        concurrent_results = list(callers.map(run, problems))
    for (out_a, dq_a), (out_b, dq_b) in zip(sequential, concurrent_results):
        np.testing.assert_array_equal(out_a, out_b)
        np.testing.assert_array_equal(dq_a, dq_b)


def _attention_cpu(q, k, v):
    return enp.attention(q, k, v, backend="cpu")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_the_kernels():
    """The thread pool does not survive a fork; the child makes its own (no hang)."""
    import multiprocessing
    import warnings

    q, k, v, _ = make_inputs(np.float32)
    want = _attention_cpu(q, k, v)  # the parent's pool exists now
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
        with multiprocessing.get_context("fork").Pool(1) as pool:
            got = pool.apply_async(_attention_cpu, (q, k, v)).get(timeout=300)
    np.testing.assert_array_equal(got, want)


def test_a_smaller_pool_is_shut_down_when_more_threads_are_asked_for(monkeypatch):
    import concurrent.futures

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two Numba threads")
    small = concurrent.futures.ThreadPoolExecutor(1)
    small.submit(int).result()  # one idle worker thread
    monkeypatch.setattr(cpu._threads, "_pool", (1, small))
    monkeypatch.setattr(cpu._config, "SERIAL_WORK", 0)
    q, k, v, _ = make_inputs(np.float32)
    threads = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        np.testing.assert_array_equal(_attention_cpu(q, k, v), _attention_cpu(q, k, v))
    finally:
        numba.set_num_threads(threads)
    assert cpu._threads._pool[0] == 2 and cpu._threads._pool[1] is not small
    with pytest.raises(RuntimeError, match="shutdown"):
        small.submit(int)  # shut down, its thread gone


@pytest.mark.parametrize("N", [1, 20])  # the decode kernel and the prefill forward
def test_a_small_call_runs_on_the_calling_thread(monkeypatch, N):
    """Below `cpu._config.SERIAL_WORK` the pool is not used (handing work to it costs more)."""
    monkeypatch.setattr(cpu._threads, "_pool", None)
    monkeypatch.setattr(cpu._threads, "thread_count", lambda: 2)
    q, k, v, _ = make_inputs(np.float32, N=N)
    want = _attention_cpu(q, k, v)
    assert cpu._threads._pool is None
    monkeypatch.setattr(cpu._config, "SERIAL_WORK", 0)
    np.testing.assert_array_equal(_attention_cpu(q, k, v), want)
    assert cpu._threads._pool is not None


def test_kernels_do_not_launch_numbas_threading_layer():
    """Launching it can load a second OpenMP runtime beside another library's (PyTorch's)."""
    code = textwrap.dedent(
        """
        import numba, numba.np.ufunc.parallel as parallel, numpy as np
        import elastic_np as enp
        from elastic_np import cpu
        q = np.ones((1, 2, 3, 4), np.float32)
        enp.attention(q, q, q, backend="cpu")
        enp.attention(q[:, :, :1], q, q, backend="cpu")  # the decode kernel
        assert not parallel._is_initialized, "launched"
        assert cpu.thread_count() == numba.config.NUMBA_NUM_THREADS
        numba.set_num_threads(1)  # the user's setting launches it, and is followed
        assert cpu.thread_count() == 1
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
