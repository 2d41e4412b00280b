"""The CPU kernels' inputs: layout, mutation, determinism, dtypes and dispatch."""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import cpu
from elastic_np._api import dispatch
from elastic_np.cli import _bench
from oracle_checks import (
    DTYPES, MASK_B1NM, MASK_NM, SIGMA_BH, check_unmodified_and_deterministic, holds_half_bits, holds_user_variant,
    make_inputs,
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(small_tiles, dtype):
    q, k, v, dout = make_inputs(dtype)
    # Same values through transposed and strided views.
    qn = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    kn = np.concatenate([k, k], axis=3)[..., ::2]
    kn[...] = k
    vn = np.asfortranarray(v)
    doutn = np.asfortranarray(dout)
    assert not (qn.flags.c_contiguous or kn.flags.c_contiguous or vn.flags.c_contiguous)
    mask = np.asfortranarray(MASK_NM)
    opts = dict(causal=True, nvm=True, tau=0.7, mask=mask[None, None])
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
    outn, lsen = enp.attention(qn, kn, vn, return_lse=True, backend="cpu", **opts)
    np.testing.assert_array_equal(out, outn)
    np.testing.assert_array_equal(lse, lsen)
    g = enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", **opts)
    gn = enp.attention_backward(
        doutn, qn, kn, vn, np.asfortranarray(outn), lsen[..., ::-1][..., ::-1], backend="cpu", **opts
    )
    for field in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(g, field), getattr(gn, field))
    assert g.dtau == gn.dtau and g.dbeta == gn.dbeta


@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_unmodified_and_deterministic(small_tiles, dtype):
    q, k, v, dout = make_inputs(dtype)
    mask = MASK_B1NM.copy()
    sigma = SIGMA_BH.copy()
    tau = np.array([0.5, 1.0, 2.0, 0.8])
    beta = np.array([0.0, 0.3, 1.0, 2.5])
    lengths = np.array([20, 29])
    opts = dict(
        causal=True, kv_lengths=lengths, mask=mask, nvm=True, tau=tau, beta=beta,
        dynamic_window=enp.DynamicWindow(sigma, sharpness=3.0, threshold=0.05),
    )
    inputs = (q, k, v, dout, mask, sigma, tau, beta, lengths)
    check_unmodified_and_deterministic(q, k, v, dout, opts, inputs, "dsigma")


def test_dtype_errors():
    q, k, v, dout = make_inputs(np.float32)
    with pytest.raises(TypeError, match="`q` has dtype float128"):
        enp.attention(*(a.astype(np.longdouble) for a in (q, k, v)), backend="cpu")
    with pytest.raises(TypeError, match="share one dtype, got float16, float32, float32"):
        enp.attention(q.astype(np.float16), k, v, backend="cpu")
    with pytest.raises(TypeError, match="share one dtype"):
        enp.attention(q, k.astype(np.float64), v, backend="cpu")
    with pytest.raises(TypeError, match="`k`"):
        enp.attention(q, k.astype(np.int32), v, backend="cpu")
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu")
    with pytest.raises(TypeError, match="`dout` has dtype float64"):
        enp.attention_backward(dout.astype(np.float64), q, k, v, out, lse, backend="cpu")
    with pytest.raises(TypeError, match="`lse` has dtype float64"):
        enp.attention_backward(dout, q, k, v, out, lse.astype(np.float64), backend="cpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_dtype_follows_input(dtype):
    q, k, v, _ = make_inputs(dtype, N=5, M=7)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu")
    assert out.dtype == dtype and lse.dtype == dtype


def test_auto_backend_without_gpu():
    if dispatch.cuda_is_available():
        pytest.skip("a GPU is usable here, so 'auto' picks cuda")
    assert dispatch.get_backend("auto") is cpu
    q, k, v, _ = make_inputs(np.float32, N=5, M=7)
    np.testing.assert_array_equal(
        enp.attention(q, k, v, backend="auto"), enp.attention(q, k, v, backend="cpu")
    )


def test_is_available():
    assert cpu.is_available()
    cpu.check_available()
    assert np.dtype(np.float32) in cpu.dtypes and np.dtype(np.float64) in cpu.dtypes


def test_one_compiled_kernel_per_dtype():
    """Read-only, strided and broadcast inputs and masks reuse the same compiled kernels."""
    for dtype in (np.float32, np.float64):
        q, k, v = (a.astype(dtype) for a in _bench.make_inputs(1, 2, 9, 11, 4, seed=3))
        for a in (q, k, v):
            a.setflags(write=False)
        mask = np.broadcast_to(np.random.default_rng(0).random((9, 11)) < 0.8, (1, 2, 9, 11))
        for options in ({}, {"mask": mask}, {"mask": np.ones((9, 11), bool)}):
            out, lse = enp.attention(q, k[..., ::1], v, return_lse=True, backend="cpu", **options)
            out.setflags(write=False)
            enp.attention_backward(out, q, k, v, out, lse, backend="cpu", **options)
    for kernel in (cpu._prefill.forward._forward_kernel, cpu._prefill.backward._backward_prepare, cpu._prefill.backward._backward_kernel, cpu._prefill.key_tiles.sum_dq_shares):
        # a half is a dtype of its own; a user's variant compiles kernels of its own
        floats = [sig for sig in kernel.signatures if not holds_half_bits(sig) and not holds_user_variant(sig)]
        assert len(floats) <= 2, floats


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_value_checks_find_every_nan_and_inf(dtype):
    """`finite` and `below_inf` (the backward plan's and `check_cache`'s checks) against NumPy's, wherever the bad
    entry sits, on C-contiguous arrays (compiled) and strided ones (NumPy's path)."""
    from elastic_np.cpu._prefill.values import below_inf, finite

    a = np.random.default_rng(0).standard_normal((2, 3, 37, 5)).astype(dtype)
    assert finite(a) and below_inf(a) and finite(a[:, :, :0]) and below_inf(a[:, :, :0])
    for at in ((0, 0, 0, 0), (1, 2, 36, 4), (0, 1, 17, 3)):
        for bad in (np.nan, np.inf, -np.inf):
            b = a.copy()
            b[at] = bad
            for view in (b, b[:, :, ::2] if at[2] % 2 == 0 else b[:, :, 1::2], b.transpose(0, 2, 1, 3)):
                assert finite(view) == bool(np.isfinite(view).all())
                assert below_inf(view) == bool((view < np.inf).all())
            assert not finite(b) and below_inf(b) == (bad == -np.inf)
