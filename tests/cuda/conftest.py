"""CUDA tests run in two invocations.

- ``NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda``: the kernels on the
  CUDA simulator (``test_sim_*.py``). The variable must be set before numba is
  imported, hence a process of its own, so the simulator never leaks into the
  other tests.
- the main ``python -m pytest``: everything here that needs no simulator (the
  error without a GPU, PTX compilation); the kernel tests (``test_sim_*.py``)
  are collected too when a real CUDA GPU is usable, so that on a GPU machine
  ``python -m pytest tests/cuda`` runs them on the hardware.
"""

import importlib
import os
import sys

import pytest

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")

# The files here import each other by name (``from test_sim_attention import ...``): this folder on sys.path
# (pytest's importlib mode, setup.cfg, puts no test folder there). They import what they share with the CPU
# tests by the names of the test files that once held it; that is in tests/support now (on sys.path by
# setup.cfg's ``pythonpath``), under these names until the files here import it by its own.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)
for _old, _new in {"test_hardening_window": "window_edges", "test_properties_float32": "float32_rule",
                   "test_torch_adapter": "adapter_cases"}.items():
    sys.modules.setdefault(_old, importlib.import_module(_new))


def _gpu_usable():
    try:
        from elastic_np import cuda
    except ImportError:
        return False
    return cuda.is_available()


if SIMULATOR:
    collect_ignore_glob = ["test_cuda_*.py"]
elif not _gpu_usable():
    collect_ignore_glob = ["test_sim_*.py"]


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of a few rows, so that small problems still run on multi-block grids."""
    from elastic_np.cuda._runtime import config as _cuda_config

    for name, value in {
        "FORWARD_BLOCK_Q": 8,
        "FORWARD_BLOCK_K": 8,
        "DQ_BLOCK_Q": 8,
        "DQ_BLOCK_K": 4,
        "DKDV_BLOCK_K": 8,
        "DKDV_BLOCK_Q": 4,
        "DBIAS_THREADS": 4,
        # the delta kernel: 16 rows a block; the decode merge kernel: 2 output columns a thread pass
        "DELTA_THREADS": 16,
        "DECODE_MERGE_THREADS": 2,
        # decode: rows of 1 to 4 lanes (K/V tiles of 2 to 8 keys), 16 threads a block, and
        # split-KV until there are 32 blocks, splits of at least 8 keys
        "DECODE_THREADS": 16,
        "DECODE_LANES": 4,
        "DECODE_MIN_BLOCKS": 32,
        "DECODE_MIN_SPLIT_KEYS": 8,
        # the tensor-core forward: one warp (16 query rows) a block, key tiles of 32
        "TC_FORWARD_WARPS": 1,
        "TC_KEYS": {4: 32, 8: 32},
        # the tensor-core backward (when on): one warp (16 rows or keys) a block, tiles of 16
        "TC_BACKWARD_WARPS": 1,
        "TC_BACKWARD_TILES": dict.fromkeys(_cuda_config.TC_BACKWARD_TILES, 16),
    }.items():
        monkeypatch.setattr(_cuda_config, name, value)


@pytest.fixture
def decode_runs(monkeypatch):
    """Record the key splits of every decode launch (and so that one happened)."""
    from elastic_np.cuda._launch import decode as _cuda_decode_launch

    calls = []
    launch = _cuda_decode_launch.launch

    def spy(*args):
        n_split = launch(*args)
        calls.append(n_split)
        return n_split

    monkeypatch.setattr(_cuda_decode_launch, "launch", spy)
    return calls
