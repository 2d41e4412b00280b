"""Fixtures shared by the CPU kernel tests (``tests/cuda`` has its own ``small_tiles``)."""

import pytest


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 queries x 5 keys: every test shape spans several of both, on every thread."""
    from elastic_np import cpu

    monkeypatch.setattr(cpu._config, "BLOCK_Q", 8)
    monkeypatch.setattr(cpu._config, "BLOCK_K", 5)
    monkeypatch.setattr(cpu._config, "SERIAL_WORK", 0)
