"""The GPU benchmark's own passes (`elastic_np.cli._cuda_bench._ours`) on the CUDA simulator.

`bench` itself needs a GPU and torch with CUDA; what it times of ours runs
here on the benchmark's inputs (`_bench_arrays`), with and without the score
modifiers, and gives the library's answer.
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np.cli import _cuda_bench


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [None, "padding"])
def test_our_passes_run_the_cuda_backend(causal, bias):
    q, k, v, dout, bias_array = arrays = _cuda_bench._bench_arrays(1, 2, 8, 4, bias)
    options = _cuda_bench._modifiers(2, 5.0, True, bias_array) if bias else {}
    synced = []
    forward, forward_backward = _cuda_bench._ours(lambda: synced.append(1), arrays, causal, options)
    forward()
    forward_backward()
    assert len(synced) == 2
    out, lse = enp.attention(q, k, v, causal=causal, return_lse=True, backend="cuda", **options)
    want = enp.attention(q, k, v, causal=causal, return_lse=True, backend="reference", **options)
    np.testing.assert_allclose(out, want[0], rtol=1e-4, atol=1e-5)
