"""``layout="bnhd"``: FlashAttention's ``(B, N, H, D)`` read in place, the bits of the transposed call."""

import importlib.util

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import DynamicWindow


def _swap(a):
    return np.ascontiguousarray(np.swapaxes(a, 1, 2))


def _case(name, dtype, seed=0):
    """``(q, k, v, options)`` in ``(B, N, H, D)``: prefill and decode shapes, every kind of option."""
    rng = np.random.default_rng(seed)
    B, H, Hkv, N, M, D = {"prefill": (2, 4, 2, 37, 45, 16), "decode": (2, 8, 2, 1, 300, 32),
                          "decode16": (1, 4, 2, 16, 90, 8), "n>m": (1, 2, 1, 50, 20, 8)}[name]
    q = rng.standard_normal((B, N, H, D)).astype(dtype)
    k, v = (rng.standard_normal((B, M, Hkv, D)).astype(dtype) for _ in range(2))
    options = [
        {},
        {"causal": True, "tau": rng.uniform(0.5, 2.0, H), "beta": 0.5, "nvm": True},
        {"window_size": (7, 2), "kv_lengths": rng.integers(1, M + 1, B), "align": "kv_lengths",
         "mask": rng.random((1, H, N, M)) > 0.2},
        {"softcap": 20.0, "alibi_slopes": rng.uniform(0.0, 0.3, H), "bias": rng.standard_normal((N, M)),
         "dynamic_window": DynamicWindow(rng.uniform(0.3, 0.9, H), sharpness=3.0)},
    ]
    return q, k, v, options


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", ["prefill", "decode", "decode16", "n>m"])
def test_bnhd_gives_the_bits_of_the_transposed_call(backend, dtype, shape):
    q, k, v, options_list = _case(shape, dtype)
    for options in options_list:
        out, lse = enp.attention(q, k, v, layout="bnhd", return_lse=True, backend=backend, **options)
        want, want_lse = enp.attention(_swap(q), _swap(k), _swap(v), return_lse=True, backend=backend, **options)
        assert out.shape == q.shape[:3] + v.shape[3:]
        assert np.array_equal(out, _swap(want)) and np.array_equal(lse, want_lse), options
        dout = np.random.default_rng(1).standard_normal(out.shape).astype(out.dtype)
        grads = enp.attention_backward(dout, q, k, v, out, lse, layout="bnhd", backend=backend, **options)
        wants = enp.attention_backward(_swap(dout), _swap(q), _swap(k), _swap(v), want, want_lse,
                                       backend=backend, **options)
        for name, given in (("dq", q), ("dk", k), ("dv", v)):
            got, expected = getattr(grads, name), getattr(wants, name)
            assert got.shape == given.shape and np.array_equal(got, _swap(expected)), (name, options)
        for name in ("dtau", "dbeta", "dsigma", "dbias"):
            got, expected = getattr(grads, name), getattr(wants, name)
            assert (got is None and expected is None) or np.array_equal(got, expected), name


def test_the_reference_module_takes_the_layout_too():
    q, k, v, _ = _case("prefill", np.float64)
    out, lse = enp.reference.attention(q, k, v, layout="bnhd", causal=True)
    want, _ = enp.reference.attention(_swap(q), _swap(k), _swap(v), causal=True)
    assert np.array_equal(out, _swap(want))
    grads = enp.reference.attention_backward(out, q, k, v, out, lse, layout="bnhd", causal=True)
    assert grads.dk.shape == k.shape


def test_a_shape_that_cannot_be_the_declared_layout_is_an_error():
    q, k, v, _ = _case("prefill", np.float32)
    # k and v given as (B, H, N, D) while bnhd was declared: heads and lengths do not fit
    with pytest.raises(ValueError, match="read as layout='bnhd', \\(B, length, heads, dim\\), from shapes"):
        enp.attention(q, _swap(k), _swap(v), layout="bnhd")
    with pytest.raises(ValueError, match="must have 4 dimensions \\(B, length, heads, dim\\) \\(layout='bnhd'\\)"):
        enp.attention(q[0], k, v, layout="bnhd")
    with pytest.raises(ValueError, match="`layout` must be 'bhnd'.*'bnhd'.*got 'BNHD'"):
        enp.attention(q, k, v, layout="BNHD")
    out, lse = enp.attention(q, k, v, layout="bnhd", return_lse=True)
    with pytest.raises(ValueError, match="`dout` must have shape \\(2, 37, 4, 16\\) \\(layout='bnhd'\\)"):
        enp.attention_backward(_swap(out), q, k, v, out, lse, layout="bnhd")


def test_inputs_are_not_written_and_outputs_are_new_arrays():
    q, k, v, _ = _case("prefill", np.float32)
    before = [a.copy() for a in (q, k, v)]
    out = enp.attention(q, k, v, layout="bnhd", causal=True, backend="cpu")
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v), before))
    assert not any(np.shares_memory(out, a) for a in (q, k, v))


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_adapter_and_module_take_the_layout():
    import torch

    import elastic_np.torch as enpt

    q, k, v, _ = _case("prefill", np.float64)
    tensors = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    out = enpt.attention(*tensors, layout="bnhd", causal=True, backend="cpu")
    out.square().sum().backward()
    swapped = [torch.tensor(_swap(a), requires_grad=True) for a in (q, k, v)]
    want = enpt.attention(*swapped, causal=True, backend="cpu")
    want.square().sum().backward()
    assert torch.equal(out, want.transpose(1, 2))
    for got, expected in zip(tensors, swapped):
        assert torch.equal(got.grad, expected.grad.transpose(1, 2))
    module = enpt.ElasticAttention(4, causal=True, backend="cpu")
    assert torch.equal(module(*tensors, layout="bnhd"), out)
    with pytest.raises(ValueError, match="built with num_heads=4, but `q` of shape \\(2, 4, 37, 16\\) has 37 heads "
                                         "on axis 2 \\(shape \\(B, N, H, D\\), layout='bnhd'\\)"):
        module(*swapped, layout="bnhd")


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_jax_adapter_takes_the_layout():
    import jax

    import elastic_np.jax as enpj

    q, k, v, _ = _case("decode16", np.float32)

    def loss(q, k, v, layout):
        return (enpj.attention(q, k, v, layout=layout, causal=True, backend="cpu") ** 2).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "bnhd")
    wants = jax.grad(loss, argnums=(0, 1, 2))(_swap(q), _swap(k), _swap(v), "bhnd")
    for got, want in zip(grads, wants):
        assert np.array_equal(np.asarray(got), _swap(np.asarray(want)))


@pytest.mark.skipif(importlib.util.find_spec("dask") is None, reason="dask is not installed")
def test_dask_adapter_takes_the_layout():
    import dask.array as da

    import elastic_np.dask as enpd

    q, k, v, _ = _case("prefill", np.float64)
    lazy = [da.from_array(q, chunks=(1, 20, 2, 16)), da.from_array(k, chunks=(1, 25, 2, 16)), v]
    out, lse = enpd.attention(*lazy, layout="bnhd", causal=True, return_lse=True, backend="reference")
    want, want_lse = enp.attention(q, k, v, layout="bnhd", causal=True, return_lse=True, backend="reference")
    assert out.shape == want.shape
    np.testing.assert_allclose(out.compute(scheduler="sync"), want, rtol=1e-13, atol=1e-13)
    grads = enpd.compute_grads(enpd.attention_backward(np.ones_like(want), *lazy, want, want_lse, layout="bnhd",
                                                       causal=True, backend="reference"), scheduler="sync")
    wants = enp.attention_backward(np.ones_like(want), q, k, v, want, want_lse, layout="bnhd", causal=True,
                                   backend="reference")
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(getattr(grads, name), getattr(wants, name), rtol=1e-12, atol=1e-12)
