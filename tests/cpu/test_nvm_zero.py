"""NVM keeps a score that is exactly 0 (``s >= 0``), in every backend.

Integer-valued and zero-padded inputs give many exact zeros in ``q . k``;
``scale / tau`` that is not a power of two must not turn them into ``-eps``
(which NVM would remove: a discontinuity, not a rounding error). The CUDA
kernels have the same test in ``tests/cuda/test_sim_attention.py``.
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import cpu, reference
from oracle_checks import assert_matches_oracle

DTYPES = [np.float64, np.float32]


def integer_inputs(B=1, H=2, Hkv=1, N=20, M=23, D=6, pad=2, seed=0):
    """Entries in {-2, ..., 2}, the last ``pad`` head dims zero: many ``q . k`` are exactly 0."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-2, 3, (B, H, N, D)).astype(np.float64)
    k = rng.integers(-2, 3, (B, Hkv, M, D)).astype(np.float64)
    q[..., D - pad :] = 0.0
    k[..., D - pad :] = 0.0
    v = rng.standard_normal((B, Hkv, M, D))
    dout = rng.standard_normal((B, H, N, D))
    return q, k, v, dout


def test_the_issue_reproducer():
    q = np.array([[[[0.75, 0.25, 0.0, 0.0]]]])
    k = np.array([[[[1.0, -3.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]]])
    v = np.eye(3, 4)[None, None]
    for tau in (1.0, 0.3, 0.7):
        want = reference.attention(q, k, v, nvm=True, scale=0.3, tau=tau)[0]
        assert want[0, 0, 0, 0] > 0.2  # the zero score of the first key is kept
        for dtype in DTYPES:
            for n in (1, 20):  # the decode kernel and the prefill kernels
                qn = np.repeat(q, n, axis=2).astype(dtype)
                got = enp.attention(qn, k.astype(dtype), v.astype(dtype), nvm=True, scale=0.3, tau=tau,
                                    backend="cpu")
                np.testing.assert_allclose(got[:, :, -1:], want, rtol=1e-6, atol=1e-6)


OPTION_SETS = {
    "scale 0.3": dict(scale=0.3),
    "tau 0.3": dict(tau=0.3),
    "tau per head": dict(tau=np.array([0.7, 1.3]), scale=0.45),
    "softcap": dict(softcap=0.7, tau=0.3),
    "causal beta": dict(causal=True, beta=0.6, tau=0.7),
    "dynamic window": dict(dynamic_window=enp.DynamicWindow(0.6, threshold=0.05), tau=0.3),
    "gqa window": dict(window_size=(7, 3), tau=0.7, scale=0.3),
}


@pytest.mark.parametrize("N", [3, 20])  # the decode kernel and the prefill kernels
@pytest.mark.parametrize("name", list(OPTION_SETS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_keeps_exact_zero_scores(monkeypatch, dtype, name, N):
    monkeypatch.setattr(cpu._runtime.config, "BLOCK_Q", 8)  # several query and key tiles
    monkeypatch.setattr(cpu._runtime.config, "BLOCK_K", 5)
    opts = dict(OPTION_SETS[name], nvm=True)
    H, Hkv = (4, 2) if name == "gqa window" else (2, 1)
    q64, k64, v64, dout64 = integer_inputs(H=H, Hkv=Hkv, N=N)
    scores = np.einsum("bhnd,bhmd->bhnm", q64, np.repeat(k64, H // Hkv, axis=1))
    assert (scores == 0).mean() > 0.1  # the case this file is about
    q, k, v, dout = (a.astype(dtype) for a in (q64, k64, v64, dout64))
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
    grads = enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", **opts)
    ref_out, ref_lse = reference.attention(q64, k64, v64, **opts)
    ref_grads = reference.attention_backward(dout64, q64, k64, v64, ref_out, ref_lse, **opts)
    results = {"out": (out, ref_out), "lse": (lse, ref_lse)}
    for field in ("dq", "dk", "dv", "dtau", "dbeta", "dsigma"):
        if getattr(ref_grads, field) is not None:
            results[field] = (getattr(grads, field), getattr(ref_grads, field))
    for field, (got, want) in results.items():
        if dtype == np.float64:
            assert_matches_oracle(field, got, want, dtype)
        else:
            # Integer inputs make the naive float32 scores exact, so the float32
            # rule's naive baseline is too tight a yardstick here; a removed zero
            # score moves the result by 1e-2 or more, far above this bound.
            err = np.max(np.abs(np.asarray(got, np.float64) - want), initial=0.0)
            assert err <= 1e-4 * max(1.0, np.max(np.abs(want), initial=0.0)), (field, err)
