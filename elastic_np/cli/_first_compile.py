"""The first JIT compile of a kernel backend, both dtypes at once where the machine has the cores.

``elastic-np check`` compiles every specialisation its battery uses before
the battery starts (`compile_backend`). Numba compiles one function at a time
in a process, so with two or more cores the CPU backend's float64 kernels
compile in a second process while this one compiles the float32 ones; both
save to the same on-disk cache, from which the battery then loads them.

Numba saves a cache entry as: read the function's index, write it back with
the entry, write the data file the entry names; and loads one as: read the
index, read the data file. Two processes saving different specialisations of
one function at the same moment could leave the index naming the other's
code, so while they compile, both hold an exclusive lock on the cache
folder for each save and load (`locked_cache_index`).
"""

import contextlib
import os
import subprocess
import sys
import time

import numpy as np

from elastic_np import testing
from elastic_np.testing import _cases

#: The lock file `locked_cache_index` leaves in each Numba cache folder it writes to.
LOCK_NAME = ".elastic_np.lock"

#: The battery's cases that reach every kernel: prefill and decode, forward and backward, every stage.
WARMUP_CASES = ("plain", "combined", "modifiers combined", "combined, N=20")


def run_cases(name, dtypes):
    """Run backend ``name`` forward and backward on the `WARMUP_CASES`, in each of ``dtypes``."""
    fn, backward = testing.backend_functions(name)
    warmup = [c for c in _cases.CASES if c.name in WARMUP_CASES]
    for dtype in dtypes:
        for case in warmup:
            q, k, v, dout, options = _cases.draw_inputs(case, dtype)
            q, k, v, dout = (a.astype(dtype) for a in (q, k, v, dout))
            fn(q, k, v, **options)
            backward(dout, q, k, v, **options)


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _can_split():
    """Whether a second process may compile beside this one: two cores, and locks on files (POSIX)."""
    try:
        import fcntl  # noqa: F401 (what `locked_cache_index` needs)
    except ImportError:
        return False
    return _cores() >= 2


@contextlib.contextmanager
def locked_cache_index():
    """Within the block, this process saves and loads Numba cache entries under an exclusive file lock.

    The lock is the file `LOCK_NAME` in the cache folder of the function's
    module, taken with ``fcntl.flock`` around Numba's own save and load.
    """
    import fcntl

    from numba.core.caching import IndexDataCacheFile

    save, load = IndexDataCacheFile.save, IndexDataCacheFile.load

    @contextlib.contextmanager
    def lock(cache_file):
        try:
            handle = open(os.path.join(cache_file._cache_path, LOCK_NAME), "a")
        except OSError:  # no cache folder yet (nothing to load) or none writable: as Numba does
            yield
            return
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
            yield

    def locked_save(self, key, data):
        with lock(self):
            return save(self, key, data)

    def locked_load(self, key):
        with lock(self):
            return load(self, key)

    IndexDataCacheFile.save, IndexDataCacheFile.load = locked_save, locked_load
    try:
        yield
    finally:
        IndexDataCacheFile.save, IndexDataCacheFile.load = save, load


def compile_backend(name, dtypes):
    """Compile (or load from the cache) what the battery runs of backend ``name`` in ``dtypes``; seconds taken.

    For ``"cpu"`` with two dtypes on a machine that `_can_split`, the second
    dtype compiles in a child process at the same time. Should the child
    fail, the battery compiles that dtype itself when it first calls it.
    """
    start = time.perf_counter()
    dtypes = [np.dtype(d) for d in dtypes]
    if name != "cpu" or len(dtypes) < 2 or not _can_split():
        run_cases(name, dtypes)
        return time.perf_counter() - start
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    child = subprocess.Popen(
        [sys.executable, "-m", "elastic_np.cli._first_compile", name, *(d.name for d in dtypes[1:])],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        with locked_cache_index():
            run_cases(name, dtypes[:1])
            child.wait()
    finally:
        if child.poll() is None:  # this process failed first
            child.kill()
            child.wait()
    return time.perf_counter() - start


if __name__ == "__main__":
    with locked_cache_index():
        run_cases(sys.argv[1], [np.dtype(d) for d in sys.argv[2:]])
