"""Without the simulator and without a GPU, the CUDA backend says what is missing."""

import os
import subprocess
import sys

import numpy as np
import pytest

import elastic_np as enp
from elastic_np._api import dispatch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(enp.__file__)))


def _gpu_present():
    try:
        from elastic_np import cuda
    except ImportError:
        return False
    return cuda.is_available()


pytestmark = pytest.mark.skipif(_gpu_present(), reason="a CUDA GPU is usable here")


def test_cuda_backend_without_gpu_raises_clear_error():
    q = np.ones((1, 1, 2, 4))
    with pytest.raises(enp.BackendUnavailableError) as info:
        enp.attention(q, q, q, backend="cuda")
    message = str(info.value)
    assert "pip install \"elastic_np[cuda]\"" in message
    assert "GPU" in message or "numba-cuda" in message


def test_cuda_backward_without_gpu_raises_clear_error():
    q = np.ones((1, 1, 2, 4))
    with pytest.raises(enp.BackendUnavailableError, match="elastic_np\\[cuda\\]"):
        enp.attention_backward(q, q, q, q, q, np.zeros((1, 1, 2)), backend="cuda")


def test_auto_does_not_pick_cuda_without_gpu():
    assert dispatch.cuda_is_available() is False


def test_missing_numba_cuda_is_named(monkeypatch):
    from elastic_np import cuda

    monkeypatch.setitem(sys.modules, "numba.cuda", None)  # import numba.cuda now fails
    assert cuda.is_available() is False
    with pytest.raises(enp.BackendUnavailableError, match="numba-cuda") as info:
        cuda.check_available()
    assert 'pip install "elastic_np[cuda]"' in str(info.value)


def test_importing_elastic_np_does_not_import_numba_cuda():
    code = "import sys, elastic_np; sys.exit('numba.cuda' in sys.modules or 'elastic_np.cuda' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def test_bench_without_gpu_raises_clear_error():
    pytest.importorskip("torch")
    from elastic_np.cli import _cuda_bench

    with pytest.raises(enp.BackendUnavailableError, match="GPU"):
        _cuda_bench.bench(1, 1, 8, 4)
