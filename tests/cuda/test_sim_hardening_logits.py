"""NVM under every scale, and rows with one key, on the CUDA kernels: the cases of ``tests/test_hardening_logits.py``.

Every CUDA kernel scores its entries with one device function
(`elastic_np.cuda._device.score.entry_logit`), which tests the sign of the final
``s = scale q . k`` (the modifiers added): right for any scale. The decode,
prefill and backward kernels call it alike, so a row with one kept key has
``p = exp(z - lse) = 1`` exactly in the backward: ``dv`` of that key is the
sum of ``dout`` over its rows. On a GPU these run on the hardware.
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import reference


@pytest.mark.parametrize("scale", [0.0, -1.0])
@pytest.mark.parametrize("N", [1, 16, 17])  # the decode kernel, and the prefill kernels
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_nvm_with_a_scale_that_is_not_positive(dtype, N, scale):
    q = np.ones((1, 1, N, 1), dtype)
    k = 1e3 * np.array([-1.0, -2.0], dtype).reshape(1, 1, 2, 1)
    v = np.array([1.0, 3.0], dtype).reshape(1, 1, 2, 1)
    dout = np.linspace(-1.0, 1.0, N, dtype=dtype).reshape(1, 1, N, 1)
    options = dict(scale=scale, nvm=True)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cuda", **options)
    grads = enp.attention_backward(dout, q, k, v, out, lse, backend="cuda", **options)
    want_out, want_lse = reference.attention(q, k, v, **options)
    want = reference.attention_backward(dout, q, k, v, want_out, want_lse, **options)
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(out, want_out, rtol=rtol)
    np.testing.assert_allclose(lse, want_lse, rtol=rtol)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(getattr(grads, name), getattr(want, name), rtol=rtol, atol=rtol, err_msg=name)


@pytest.mark.parametrize("N", [1, 5, 16, 17])
def test_a_row_with_one_key_has_p_exactly_one(N):
    """The diagonal's key alone (a window of width 1), with a bias, ALiBi, a soft-cap and ``tau = 1e-6``."""
    rng = np.random.default_rng(N)
    M = N + 3
    q = rng.standard_normal((1, 2, N, 4)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 1, M, 4)).astype(np.float32)
    dout = rng.integers(1, 4, (1, 2, N, 4)).astype(np.float32)
    options = dict(window_size=(0, 0), tau=1e-6, bias=rng.standard_normal((N, M)).astype(np.float32),
                   alibi_slopes=np.array([0.3, 0.7]), softcap=2.0)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cuda", **options)
    grads = enp.attention_backward(dout, q, k, v, out, lse, backend="cuda", **options)
    assert np.isfinite(lse).all()
    want_dv = np.zeros(v.shape, np.float32)
    want_dv[0, 0, M - N:] = dout[0].sum(axis=0)
    np.testing.assert_array_equal(grads.dv, want_dv)
