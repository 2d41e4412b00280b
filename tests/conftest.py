"""Fixtures shared by the CPU kernel tests (``tests/cuda`` has its own ``small_tiles``), the Numba caches of the
pytest-xdist workers (the kernels compiled once, before the workers start), no announcement of a compile."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

# The shared helpers (tests/support, on sys.path by setup.cfg's ``pythonpath``) fail with pytest's
# detailed assertion messages, as the test files do.
pytest.register_assert_rewrite(
    "adapter_cases", "double_backward_cases", "float32_rule", "mp_oracle", "oracle_checks", "reference_cases",
    "transformers_models", "window_edges",
)

#: This folder. Never on sys.path: there its folders torch, jax, dask and transformers would pass for those
#: packages where they are not installed (``python -m pytest`` run in it puts it there, as does
#: tests/cuda/test_sim_hardening.py, for a helper that is in tests/support now).
TESTS = os.path.dirname(os.path.abspath(__file__))


def _tests_off_sys_path():
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != TESTS]


_tests_off_sys_path()


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """`TESTS` off sys.path again after each file's import."""
    yield
    _tests_off_sys_path()


# Under pytest-xdist (``-n``) each worker keeps a Numba cache of its own: two
# processes saving different specialisations of one function at the same time
# can leave Numba's cache index pointing at the other's code. So that the
# kernels do not compile once in every worker, the controller compiles them
# before the workers start (`pytest_sessionstart`) into one cache, ``shared``,
# in processes that save under the package's lock on the index (as ``elastic-np
# check`` does); each worker's cache starts as a copy of it (hard links: Numba
# replaces a file it saves, never writes into one), read and added to by that
# worker alone. Set before any test module imports numba (which reads the
# variable once). Runs with ELASTIC_NP_PUBLIC_NUMBA set compile into a folder of
# their own under the same cache (elastic_np.cpu._runtime.numba_private.own_cache).
CACHE_BASE = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "elastic_np-numba-cache")
SHARED = os.path.join(CACHE_BASE, "shared")
#: Names what `SHARED` holds: a new name after every fill that compiled something.
SHARED_ID = os.path.join(CACHE_BASE, "shared.id")
#: The name of the fill a worker's cache was copied from.
SEEDED = ".seeded-from"


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _seed_worker_cache(own):
    """Make ``own`` a copy of `SHARED` unless it is one of the latest fill already (keeping what it added)."""
    shared_id = _read(SHARED_ID)
    if shared_id is None or not os.path.isdir(SHARED) or _read(os.path.join(own, SEEDED)) == shared_id:
        return
    shutil.rmtree(own, ignore_errors=True)
    shutil.copytree(SHARED, own, copy_function=_link_or_copy, ignore=shutil.ignore_patterns(".elastic_np.lock"))
    with open(os.path.join(own, SEEDED), "w") as f:
        f.write(shared_id)


if os.environ.get("PYTEST_XDIST_WORKER") and "numba" not in sys.modules:
    _own = os.path.join(CACHE_BASE, os.environ["PYTEST_XDIST_WORKER"])
    _seed_worker_cache(_own)
    os.environ["NUMBA_CACHE_DIR"] = _own

#: A process of the fill, given its number, its dtypes and every dtype: every kernel path of the CPU backend
#: (`elastic_np.warmup`) side by side with the others, saving and loading under the package's file lock on Numba's
#: index; where the lock is off (Numba's private internals unused), the first process alone, in every dtype.
#: Prints how many functions it compiled.
_FILL = """
import sys
import elastic_np
from elastic_np.cpu._runtime.numba_private import enabled, locked_cache_index
first, mine, every = sys.argv[1] == "0", sys.argv[2].split(","), sys.argv[3].split(",")
if enabled("two_process_check"):
    with locked_cache_index():
        print(elastic_np.warmup(mine, backend="cpu", second_order=True).compiled)
else:
    print(elastic_np.warmup(every, backend="cpu", second_order=True).compiled if first else 0)
"""

#: The dtypes of each process of the fill (the halves compute in float32); one process where there is one core.
_FILL_GROUPS = (("float32", "float16"), ("float64", "bfloat16"))


def _fill_shared_cache():
    """Compile the CPU backend's kernels into `SHARED` (`_FILL`), in two processes side by side; a new `SHARED_ID`
    when anything compiled. Returns a line for the terminal."""
    spec = importlib.util.find_spec("elastic_np")  # without importing it (and Numba) in this process
    root = os.path.dirname(os.path.dirname(spec.origin))
    env = dict(os.environ, NUMBA_CACHE_DIR=SHARED,
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    every = sum(_FILL_GROUPS, ())
    groups = _FILL_GROUPS if cores >= 2 else (every,)
    start = time.perf_counter()
    runs = [subprocess.Popen([sys.executable, "-c", _FILL, str(i), ",".join(group), ",".join(every)], cwd=root,
                             env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for i, group in enumerate(groups)]
    results = [run.communicate() + (run.returncode,) for run in runs]
    seconds = time.perf_counter() - start
    failed = [err.strip().splitlines()[-1:] for _, err, code in results if code != 0]
    if failed:
        return f"elastic_np: compiling the kernels for the workers failed ({failed}); each worker compiles its own"
    compiled = sum(int(out.split()[-1]) for out, _, _ in results)
    if compiled or _read(SHARED_ID) is None:
        with open(SHARED_ID, "w") as f:
            f.write(uuid.uuid4().hex)
    return (f"elastic_np: the CPU kernels for the workers in {seconds:.0f} s: {compiled} functions compiled "
            f"({len(groups)} processes), the rest loaded, in {SHARED}")


def pytest_sessionstart(session):
    """Under pytest-xdist, before the workers start (xdist starts them last): `_fill_shared_cache`. Not for the
    CUDA simulator's runs, which hardly call the CPU kernels, nor where nothing runs."""
    config = session.config
    if (not config.pluginmanager.has_plugin("dsession") or config.option.collectonly
            or os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")):
        return
    os.makedirs(SHARED, exist_ok=True)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    line = _fill_shared_cache()
    if reporter is not None:
        reporter.write_line(line)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n`` without ``--dist`` (xdist's ``load``): work stealing, so that a worker out of tests takes some of
    another's queue rather than wait idle for it (the tests take from a millisecond to a minute)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


#: Files of tests that take from 10 s to a minute each (PTX of every kernel; new processes compiling the kernels
#: into empty caches, on purpose): run first under pytest-xdist, so that no worker is left running one of them
#: at the end while the other has run out of tests.
SLOW_FILES = ("cuda/test_cuda_ptx.py", "cpu/test_tiles_compile.py", "cpu/test_numba_private.py", "docs/test_asv.py",
              "api/test_compile_report.py")
#: Tests that compile the same kernels the fill leaves out, in groups matched against their node ids: a quantized
#: cache's (one per format and kind of scale, which the kit's cases, the torch adapter's, the benchmark scripts and
#: the decoding page reach too), and a user's variants' (which Numba caches in the process only). Each group starts
#: the share of the tests one worker gets first (`_order`), so that it compiles each of those kernels once, while
#: the other worker compiles the other group's.
SHARED_COMPILES = (
    ("cpu/test_quantized.py", "api/test_varlen_quantized.py", "torch/test_torch_quantized.py", "api/test_warmup.py",
     "cpu/test_halves.py", "docs/test_benchmark_scripts.py", "testing/test_conformance.py", "cli/test_cli.py",
     "[decoding.rst]"),
    ("variants/", "torch/test_torch_variants.py", "[variants.rst]"),
)


def _group(item):
    """The index of the `SHARED_COMPILES` group ``item`` belongs to, or None."""
    return next((n for n, group in enumerate(SHARED_COMPILES) if any(part in item.nodeid for part in group)), None)


def _order(items, workers):
    """``items`` in the order xdist's work stealing should hand them out: it gives worker ``w`` a contiguous share
    (``len(pending) // workers left``) and moves tests from the end of a worker's queue to a worker out of tests.
    The first share starts with `SLOW_FILES` (so that no worker is left running one of them at the end while the
    other has run out of tests), the shares then with a group of `SHARED_COMPILES` each (the last takes those
    left), each filled up with the other tests, in collection order."""
    slow = [item for item in items if item.nodeid.split("::")[0].endswith(SLOW_FILES)]
    groups = [[] for _ in range(max(workers, 1))]
    rest = []
    for item in items:
        if item in slow:
            continue
        n = _group(item)
        if n is None:
            rest.append(item)
        else:
            groups[min(n, len(groups) - 1)].append(item)
    groups[0][:0] = slow
    ordered, pending = [], len(items)
    for w, share in enumerate(groups):
        size = pending // (len(groups) - w)
        fill = max(size - len(share), 0) if w < len(groups) - 1 else len(rest)
        share = share + rest[:fill]
        rest = rest[fill:]
        ordered += share
        pending -= len(share)
    return ordered


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the tests in `_order` (the workers' collections stay alike)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = _order(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def pytest_configure(config):
    """The suite's processes never announce a compile (`elastic_np.CompileWarning`, once a process): in a cold
    cache, a test that turns warnings into errors would fail on whichever call compiled first. The tests of the
    announcement use a notice of their own (tests/api/test_compile_report.py); the processes tests start have theirs.
    """
    from elastic_np._api import compile_report  # imports no Numba

    compile_report.NOTICE.due = False


@pytest.fixture(autouse=True)
def pool_never_late(monkeypatch):
    """A worker late for a call makes the next like it run on the calling thread (`cpu._runtime.threads._late_for`):
    off in the tests, whose calls then use the pool as `SERIAL_WORK` says, whatever the machine's load."""
    from elastic_np.cpu._runtime import config as _config

    monkeypatch.setattr(_config, "LATE_WORKER_SECONDS", 0.0)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 queries x 5 keys: every test shape spans several of both, on every thread."""
    from elastic_np import cpu

    monkeypatch.setattr(cpu._runtime.config, "BLOCK_Q", 8)
    monkeypatch.setattr(cpu._runtime.config, "BLOCK_K", 5)
    monkeypatch.setattr(cpu._runtime.config, "SERIAL_WORK", 0)


@pytest.fixture(params=["stacked-rows", "key-major"])
def decode_tiles(request, monkeypatch):
    """The decode kernels' key tiles of 5 and splits of at least 7 keys, into as many as 64 tasks; each of the two
    kernels (``test_decode``, ``test_lse_gradient``)."""
    from elastic_np import cpu

    monkeypatch.setattr(cpu._runtime.config, "DECODE_KEY_MAJOR_QUERIES", 1 if request.param == "key-major" else 17)
    monkeypatch.setattr(cpu._runtime.config, "DECODE_BLOCK_K", 5)
    monkeypatch.setattr(cpu._runtime.config, "SERIAL_WORK", 0)
    monkeypatch.setattr(cpu._runtime.config, "DECODE_MIN_SPLIT_KEYS", 7)
    monkeypatch.setattr(cpu._runtime.config, "DECODE_MIN_TASKS", 64)
