"""The first JIT compile of a kernel backend, both dtypes at once where the machine has the cores.

``elastic-np check`` compiles every specialisation its battery uses before
the battery starts (`compile_backend`). Numba compiles one function at a time
in a process, so with two or more cores the CPU backend's float64 kernels
compile in a second process while this one compiles the float32 ones; both
save to the same on-disk cache, from which the battery then loads them. The
child prints the names of the functions it compiled (none when it loaded
them all from the cache), so that ``check`` can say which it was.

Numba saves a cache entry as: read the function's index, write it back with
the entry, write the data file the entry names; and loads one as: read the
index, read the data file. Two processes saving different specialisations of
one function at the same moment could leave the index naming the other's
code, so while they compile, both hold an exclusive lock on the cache
folder for each save and load (`locked_cache_index`, which patches Numba's
private cache classes: only where `elastic_np.cpu._runtime.numba_private.enabled`
says the path ``two_process_check`` is on; else all compiles here).
"""

import json
import os
import subprocess
import sys
import warnings

from elastic_np import testing
from elastic_np._api import compile_report
from elastic_np._contract import _spec, _validation
from elastic_np._contract._errors import CompileWarning
from elastic_np.cpu._runtime.numba_private import enabled, locked_cache_index
from elastic_np.testing._cases import CASES, case_dtypes, draw_inputs, quantized_cache, unavailable

#: The backends that read a quantized cache.
_CACHE_BACKENDS = tuple(b for b in _spec.BACKENDS if "k_scale" in _spec.taken_by(b))

#: The battery's cases that reach every kernel: prefill and decode, forward and backward, every stage, and
#: the quantized caches' forwards (a float32 one: compiled while a second process compiles float64).
WARMUP_CASES = ("plain", "combined", "modifiers combined", "combined, N=20", *(c.name for c in CASES if c.cache))


def run_cases(name, dtypes, step=None):
    """Run backend ``name`` forward and backward on the `WARMUP_CASES`, in each of ``dtypes`` (a quantized
    cache's case forward only, in the dtypes it runs in: `elastic_np.testing._cases.case_dtypes`).

    ``step(text)``, if given, is told what runs next (``"float32 'plain', forward"``).
    """
    fn, backward = testing.backend_functions(name)
    warmup = [c for c in CASES if c.name in WARMUP_CASES and (c.cache is None or name in _CACHE_BACKENDS)
              and not unavailable(c)]
    step = step or (lambda text: None)
    for dtype in dtypes:
        for case in (c for c in warmup if case_dtypes(c, [dtype])):
            q, k, v, dout, options = draw_inputs(case, dtype)
            k, v, stored = quantized_cache(case, k, v)
            q, k, v, dout = (a.astype(dtype) for a in (q, k, v, dout))
            if stored is not None:
                k, v, options = stored[0], stored[1], {**options, **stored[2]}
            step(f"{dtype.name} {case.name!r}, forward")
            fn(q, k, v, **options)
            if stored is None:
                step(f"{dtype.name} {case.name!r}, backward")
                backward(dout, q, k, v, **options)


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _can_split():
    """Whether a second process may compile beside this one: the private path on, two cores, locks on files (POSIX)."""
    if not enabled("two_process_check"):
        return False
    try:
        import fcntl  # noqa: F401 (what `locked_cache_index` needs)
    except ImportError:
        return False
    return _cores() >= 2


def child_options():
    """``cwd`` and ``env`` of a child process that imports this very copy of elastic_np.

    ``python -m`` puts its working directory first on the path: run from a
    source checkout beside an installed copy (the README's ``pip install . &&
    elastic-np check``), the child would compile the checkout's kernels into
    another cache. It runs in the folder that holds this package instead.
    """
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    return {"cwd": package_root, "env": env}


def compile_backend(name, dtypes, step=None):
    """Compile (or load from the cache) what the battery runs of backend ``name`` in ``dtypes``.

    For ``"cpu"`` with two dtypes on a machine that `_can_split`, the second
    dtype compiles in a child process at the same time. Should the child
    fail, the battery compiles that dtype itself when it first calls it.
    ``step(text)`` is told what runs (`run_cases`).

    Returns the names of the functions the child compiled (a frozenset,
    empty without a child), or None when the child failed.
    """
    dtypes = [_validation.numpy_dtype(d) for d in dtypes]
    if name != "cpu" or len(dtypes) < 2 or not _can_split():
        run_cases(name, dtypes, step)
        return frozenset()
    child = subprocess.Popen(
        [sys.executable, "-m", "elastic_np.cli._first_compile", name, *(d.name for d in dtypes[1:])],
        **child_options(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        with locked_cache_index():
            run_cases(name, dtypes[:1], step)
            if step is not None:
                step(f"waiting for {', '.join(d.name for d in dtypes[1:])} in a second process")
            out, _ = child.communicate()
    finally:
        if child.poll() is None:  # this process failed first
            child.kill()
            child.wait()
    return _child_compiled(child.returncode, out)


def _child_compiled(returncode, out):
    """The names the child printed as its last line (a JSON list), or None when it failed."""
    lines = (out or "").strip().splitlines()
    if returncode != 0 or not lines:
        return None
    try:
        return frozenset(json.loads(lines[-1]))
    except (ValueError, TypeError):
        return None


if __name__ == "__main__":
    # the parent says what compiled (from the names printed here), not a CompileWarning
    warnings.filterwarnings("ignore", category=CompileWarning)
    with locked_cache_index(), compile_report.watch() as seen:
        run_cases(sys.argv[1], [_validation.numpy_dtype(d) for d in sys.argv[2:]])
    print(json.dumps(sorted(str(name) for name in seen.compiled)))
