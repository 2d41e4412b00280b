"""The CPU kernels' thread pool: a kernel runs as ``threads`` parts, each a contiguous share of its tasks."""

import concurrent.futures
import os
import threading

import numba
import numba.np.ufunc.parallel as _numba_parallel

from elastic_np.cpu import _config as config
from elastic_np.cpu._numba_private import inner

_pool = None  # (threads, executor)


_pool_lock = threading.Lock()


def _forget_pool():
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()  # a thread of the parent may have held it


os.register_at_fork(after_in_child=_forget_pool)  # a forked child has none of the threads


def thread_count():
    """The threads the kernels run on: `numba.get_num_threads`, without starting Numba's threads.

    ``numba.get_num_threads()`` first launches Numba's threading layer, which
    may load an OpenMP runtime beside another library's (PyTorch's), and that
    slows the other library's parallel code in the same process. The kernels
    never use that layer, so until something else has launched it (as
    ``numba.set_num_threads`` does) the count is its default,
    ``numba.config.NUMBA_NUM_THREADS``, the value it would report.
    """
    if getattr(_numba_parallel, "_is_initialized", True):
        return numba.get_num_threads()
    return numba.config.NUMBA_NUM_THREADS


def _run_tasks(kernel, *args, work=None):
    """Run ``kernel(*args, part, parts)`` on `thread_count` threads.

    With ``work`` (the multiply-adds of the call, an estimate) below
    `SERIAL_WORK`, on the calling thread alone.

    Thread ``part`` of ``parts`` runs its contiguous share of the kernel's
    tasks (`_task_range`; the kernels release the GIL). Every task writes
    outputs of its own, so the result has the same bits for every thread
    count. Threads instead of ``prange``: a parallel Numba function compiles
    its loop body again as a gufunc and LLVM optimises it once per level it
    is linked into, which doubled the first compile of these kernels.
    """
    global _pool
    threads = thread_count()
    if threads == 1 or (work is not None and work < config.SERIAL_WORK):
        kernel(*args, 0, 1)
        return
    with _pool_lock:  # another Python thread may replace the pool meanwhile
        if _pool is None or _pool[0] < threads:
            if _pool is not None:
                _pool[1].shutdown(wait=False)  # its idle threads exit; queued tasks still run
            _pool = (threads, concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="elastic_np"))
        futures = [_pool[1].submit(kernel, *args, t, threads) for t in range(threads)]
    for future in futures:
        future.result()


@inner(fastmath=False)
def _task_range(n, part, parts):
    """The tasks of thread ``part`` of ``parts``: a contiguous share of ``range(n)``.

    Contiguous, as ``prange`` schedules them: consecutive tasks alternate a
    cheap and a costly tile under a causal mask (`_zigzag`), so any run of
    them is balanced, where every ``parts``-th task would not be (with two
    threads, one would get every cheap tile).
    """
    return range(n * part // parts, n * (part + 1) // parts)


@inner(fastmath=False)
def _zigzag(t, n):
    """Visit tiles 0, n-1, 1, n-2, ...: cheap and costly causal tiles alternate."""
    return t // 2 if t % 2 == 0 else n - 1 - t // 2
