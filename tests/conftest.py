"""Fixtures shared by the CPU kernel tests (``tests/cuda`` has its own ``small_tiles``), and a Numba cache per worker."""

import os
import sys
import tempfile

import pytest

# Under pytest-xdist (``-n``) each worker keeps a Numba cache of its own: two
# processes saving different specialisations of one function at the same time
# can leave Numba's cache index pointing at the other's code. Set before any
# test module imports numba (which reads the variable once).
# With ELASTIC_NP_PUBLIC_NUMBA set (Numba's private internals not used, see
# elastic_np.cpu._numba_private) the same functions compile to other code:
# those runs get a cache folder of their own, with or without workers.
_PUBLIC = os.environ.get("ELASTIC_NP_PUBLIC_NUMBA", "").strip() not in ("", "0")
if (os.environ.get("PYTEST_XDIST_WORKER") or _PUBLIC) and "numba" not in sys.modules:
    _base = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "elastic_np-numba-cache")
    if _PUBLIC:
        _base = os.path.join(_base, "public-" + os.environ["ELASTIC_NP_PUBLIC_NUMBA"].strip().replace(",", "-"))
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(_base, os.environ.get("PYTEST_XDIST_WORKER", "main"))


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 queries x 5 keys: every test shape spans several of both, on every thread."""
    from elastic_np import cpu

    monkeypatch.setattr(cpu._config, "BLOCK_Q", 8)
    monkeypatch.setattr(cpu._config, "BLOCK_K", 5)
    monkeypatch.setattr(cpu._config, "SERIAL_WORK", 0)
