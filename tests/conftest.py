"""Fixtures shared by the CPU kernel tests (``tests/cuda`` has its own ``small_tiles``), a Numba cache per worker,
no announcement of a compile."""

import os
import sys
import tempfile

import pytest

# The shared helpers (tests/support, on sys.path by setup.cfg's ``pythonpath``) fail with pytest's
# detailed assertion messages, as the test files do.
pytest.register_assert_rewrite(
    "adapter_cases", "double_backward_cases", "float32_rule", "mp_oracle", "oracle_checks", "reference_cases",
    "transformers_models", "window_edges",
)

# Under pytest-xdist (``-n``) each worker keeps a Numba cache of its own: two
# processes saving different specialisations of one function at the same time
# can leave Numba's cache index pointing at the other's code. Set before any
# test module imports numba (which reads the variable once). Runs with
# ELASTIC_NP_PUBLIC_NUMBA set need nothing more: the package caches their
# kernels in a folder of their own (elastic_np.cpu._runtime.numba_private.own_cache).
if os.environ.get("PYTEST_XDIST_WORKER") and "numba" not in sys.modules:
    _base = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "elastic_np-numba-cache")
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(_base, os.environ["PYTEST_XDIST_WORKER"])


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
