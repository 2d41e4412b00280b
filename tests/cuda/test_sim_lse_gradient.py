"""The cotangent of ``lse`` (``dlse``) in the CUDA backward, held to the float64 oracle.

Run with ``NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda`` (see conftest).
The cases are those of ``test_sim_attention.py``; each backward also takes a
random ``dlse``, which enters every gradient through ``delta - dlse``.
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import reference
from elastic_np.cuda._launch import arrays as _arrays
from elastic_np.testing import _tolerances
from test_sim_attention import (
    ARRAY_FIELDS, CASES, GRAD_FIELDS, MOD_CASES, assert_float64_close, case_options, items, make_problem, max_error,
)

pytestmark = pytest.mark.usefixtures("small_tiles")


def dlse_for(q, seed=0):
    return np.random.default_rng(seed + 1000).standard_normal(q.shape[:3]).astype(q.dtype)


def run(backend, q, k, v, dout, opts, dlse):
    q, k, v, dout = (a.astype(np.float64) for a in (q, k, v, dout)) if backend == "reference" else (q, k, v, dout)
    out, lse = enp.attention(q, k, v, return_lse=True, backend=backend, **opts)
    grads = enp.attention_backward(dout, q, k, v, out, lse, dlse=dlse, backend=backend, **opts)
    return out, lse, grads


def assert_float32_rule(got, q, k, v, dout, opts, want, dlse):
    """The float32 rule of ``test_sim_attention.assert_float32_rule``, with the naive backward given ``dlse``."""
    orderings = _tolerances.naive_orderings(q, k, v, dout, opts, np.float32, dlse=dlse)
    summation = _tolerances.rounding_allowance(q, k, v, dout, opts, dlse=dlse)
    for (name, g), (_, w) in zip(items(*got), items(*want)):
        if name in ARRAY_FIELDS:
            assert np.asarray(g).dtype == np.float32, name
        allowed, naive_err = _tolerances.float32_allowed(w, [n[name] for n in orderings], summation.get(name))
        err = max_error(g, w)
        assert err <= allowed, (name, err, naive_err, allowed)


FLOAT64 = ["plain, N != M", "two-sided window, decoding", "elastic per head, GQA", "dynamic window with band",
           "kv_lengths and empty rows", "broadcast mask with empty rows", "ragged cache aligned to kv_lengths"]
MODIFIERS = ["full bias, GQA, nvm, beta per head", "(B, 1, 1, M) key padding, empty rows",
             "(B, H, N, 1) bias, dynamic window", "everything at once"]


def _case(name):
    if name in CASES:
        shape = CASES[name][0]
        return shape, case_options(name, shape)
    shape, options = MOD_CASES[name]
    return shape, options()


@pytest.mark.parametrize("name", FLOAT64 + MODIFIERS)
def test_float64_matches_reference(name):
    shape, opts = _case(name)
    q, k, v, dout = make_problem(1, **shape)
    dlse = dlse_for(q)
    copy = dlse.copy()
    got = run("cuda", q, k, v, dout, opts, dlse)
    assert_float64_close(got, run("reference", q, k, v, dout, opts, dlse))
    np.testing.assert_array_equal(dlse, copy)


@pytest.mark.parametrize("name", ["elastic per head, GQA", "kv_lengths and empty rows", "everything at once"])
def test_float32_rule(name):
    shape, opts = _case(name)
    q, k, v, dout = make_problem(2, **shape, dtype=np.float32)
    dlse = dlse_for(q)
    got = run("cuda", q, k, v, dout, opts, dlse)
    want = run("reference", q, k, v, dout, opts, dlse.astype(np.float64))
    assert_float32_rule(got, q, k, v, dout, opts, want, dlse)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", ["kv_lengths and empty rows", "everything at once"])
def test_no_dlse_is_zero_dlse_bit_for_bit(dtype, name):
    shape, opts = _case(name)
    q, k, v, dout = make_problem(3, **shape, dtype=dtype)
    none = run("cuda", q, k, v, dout, opts, None)[2]
    zeros = run("cuda", q, k, v, dout, opts, np.zeros(q.shape[:3], dtype))[2]
    for field in GRAD_FIELDS:
        np.testing.assert_array_equal(getattr(none, field), getattr(zeros, field), err_msg=field)


def test_device_dlse():
    from numba import cuda as numba_cuda

    opts = dict(causal=True, nvm=True, tau=0.7, beta=0.5)
    q, k, v, dout = make_problem(4, H=2, Hkv=1, N=10, M=15)
    dlse = dlse_for(q)
    host = run("cuda", q, k, v, dout, opts, dlse)[2]
    dq_, dk_, dv_, ddout = (numba_cuda.to_device(a) for a in (q, k, v, dout))
    out, lse = enp.attention(dq_, dk_, dv_, return_lse=True, backend="cuda", **opts)
    for given in (numba_cuda.to_device(dlse), dlse):  # on the device, and a host dlse with device arrays
        grads = enp.attention_backward(ddout, dq_, dk_, dv_, out, lse, dlse=given, backend="cuda", **opts)
        for name in ("dq", "dk", "dv"):
            assert _arrays.is_device(getattr(grads, name)), name
            np.testing.assert_array_equal(getattr(grads, name).copy_to_host(), getattr(host, name))
        assert grads.dtau == host.dtau and grads.dbeta == host.dbeta
    with pytest.raises(ValueError, match="`dlse` must have shape"):
        enp.attention_backward(ddout, dq_, dk_, dv_, out, lse, dlse=numba_cuda.to_device(np.ascontiguousarray(dlse[..., :3])),
                               backend="cuda", **opts)
    with pytest.raises(TypeError, match="`dlse` has dtype float32"):
        enp.attention_backward(ddout, dq_, dk_, dv_, out, lse, dlse=numba_cuda.to_device(dlse.astype(np.float32)),
                               backend="cuda", **opts)
    with pytest.raises(ValueError, match="`dlse` contains NaN"):
        enp.attention_backward(dout, q, k, v, *reference.attention(q, k, v, **opts), dlse=dlse * np.nan,
                               backend="cuda", **opts)
