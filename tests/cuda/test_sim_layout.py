"""``layout="bnhd"`` on the CUDA backend: host arrays give the bits of the transposed call; device arrays are refused."""

import numpy as np
import pytest

import elastic_np as enp


def _swap(a):
    return np.ascontiguousarray(np.swapaxes(a, 1, 2))


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("N", [19, 3])
def test_bnhd_host_arrays_give_the_bits_of_the_transposed_call(N):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, N, 4, 8))
    k, v = (rng.standard_normal((1, 23, 2, 8)) for _ in range(2))
    out, lse = enp.attention(q, k, v, layout="bnhd", causal=True, beta=0.5, return_lse=True, backend="cuda")
    want, want_lse = enp.attention(_swap(q), _swap(k), _swap(v), causal=True, beta=0.5, return_lse=True,
                                   backend="cuda")
    assert np.array_equal(out, _swap(want)) and np.array_equal(lse, want_lse)
    grads = enp.attention_backward(out, q, k, v, out, lse, layout="bnhd", causal=True, beta=0.5, backend="cuda")
    wants = enp.attention_backward(want, _swap(q), _swap(k), _swap(v), want, want_lse, causal=True, beta=0.5,
                                   backend="cuda")
    for name in ("dq", "dk", "dv"):
        assert np.array_equal(getattr(grads, name), _swap(getattr(wants, name))), name


def test_bnhd_device_arrays_are_refused_with_the_way_out():
    from numba import cuda

    q = cuda.to_device(np.zeros((1, 3, 2, 8)))
    with pytest.raises(ValueError, match="layout='bnhd' is not taken with device arrays.*q.transpose\\(1, 2\\)"):
        enp.attention(q, q, q, layout="bnhd", backend="cuda")
