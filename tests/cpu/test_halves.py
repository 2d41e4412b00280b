"""bfloat16 and float16 in the CPU kernels: the kit's rule for every case, the float32 kernels' bits, bad input."""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import cpu, testing
from elastic_np.testing import _battery
from elastic_np.testing._cases import CAPABILITIES, OPTION_NAMES

ml_dtypes = pytest.importorskip("ml_dtypes")

HALVES = [np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)]
half_ids = [d.name for d in HALVES]


def _draw(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(dtype)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint16)


@pytest.mark.parametrize("dtype", half_ids)
def test_every_kit_case_within_the_rule(dtype):
    """Forward, backward and decode of every case of the kit, in the dtype's rule (twice a naive float32 evaluation's
    error); a user's variant's cases aside (tests/variants/test_variant_kit.py, float32 computing the halves' tiles)."""
    fn, backward = testing.backend_functions("cpu")
    report = _battery.run_battery(fn, backward=backward, supported=set(OPTION_NAMES) | set(CAPABILITIES),
                                  dtypes=[dtype])
    assert {name for name, _ in report.skipped} == {"score_mod, mask_mod", "score_mod, block_mask"}
    assert report, str(report)
    assert {row.dtype for row in report.rows} == {dtype}


# (B, H, Hkv, N, M, D): the prefill kernel (N = 70), the decode kernel with rows stacked (N = 1) and key-major (N = 16)
SHAPES = [(2, 4, 2, 70, 150, 32), (1, 8, 2, 1, 1100, 64), (1, 4, 4, 16, 300, 16)]
OPTIONS = [dict(), dict(causal=True, tau=0.7, beta=0.5), dict(softcap=5.0, alibi_slopes=np.linspace(0.1, 0.5, 4),
                                                              window_size=(40, 0), causal=True)]


def _heads(options, H):
    """``options`` with ALiBi's slopes cut to ``H`` heads."""
    if "alibi_slopes" in options:
        return dict(options, alibi_slopes=np.resize(options["alibi_slopes"], H))
    return options


@pytest.mark.parametrize("dtype", half_ids)
@pytest.mark.parametrize("shape", SHAPES, ids=["prefill", "decode rows", "decode heads"])
@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "causal tau beta", "modifiers window"])
def test_bits_of_the_float32_kernels_rounded(monkeypatch, dtype, shape, options):
    """The values of a half are exact in float32: ``out`` is the float32 kernels' on them, rounded to nearest even.

    With the float32 products: a bfloat16 prefill forward on AMX tiles sums in the unit's order (``tests/cpu/test_amx.py``).
    """
    monkeypatch.setattr(cpu._runtime.config, "AMX", False)
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    B, H, Hkv, N, M, D = shape
    options = _heads(options, H)
    q, k, v = _draw((B, H, N, D), dtype, 1), _draw((B, Hkv, M, D), dtype, 2), _draw((B, Hkv, M, D), dtype, 3)
    dout = _draw((B, H, N, D), dtype, 4)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **options)
    wide = [a.astype(np.float32) for a in (q, k, v)]
    out32, lse32 = enp.attention(*wide, return_lse=True, backend="cpu", **options)
    assert out.dtype == dtype and lse.dtype == np.float32
    np.testing.assert_array_equal(_bits(out), _bits(out32.astype(dtype)))
    np.testing.assert_array_equal(lse, lse32)
    grads = enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", **options)
    grads32 = enp.attention_backward(dout.astype(np.float32), *wide, out.astype(np.float32), lse, backend="cpu",
                                     **options)
    for name in ("dq", "dk", "dv"):
        got, want = getattr(grads, name), getattr(grads32, name)
        assert got.dtype == dtype
        np.testing.assert_array_equal(_bits(got), _bits(want.astype(dtype)), err_msg=name)
    for name in ("dtau", "dbeta"):
        np.testing.assert_array_equal(getattr(grads, name), getattr(grads32, name), err_msg=name)


@pytest.mark.parametrize("dtype", half_ids)
def test_bias_and_its_gradient_in_the_dtype(dtype):
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = _draw((1, 2, 20, 8), dtype, 1), _draw((1, 2, 30, 8), dtype, 2), _draw((1, 2, 30, 8), dtype, 3)
    bias = _draw((1, 1, 20, 30), dtype, 5)
    out, lse = enp.attention(q, k, v, bias=bias, return_lse=True, backend="cpu")
    grads = enp.attention_backward(out, q, k, v, out, lse, bias=bias, backend="cpu")
    wide = [a.astype(np.float32) for a in (q, k, v)]
    out32, lse32 = enp.attention(*wide, bias=bias.astype(np.float32), return_lse=True, backend="cpu")
    np.testing.assert_array_equal(_bits(out), _bits(out32.astype(dtype)))
    grads32 = enp.attention_backward(out.astype(np.float32), *wide, out.astype(np.float32), lse,
                                     bias=bias.astype(np.float32), backend="cpu")
    assert grads.dbias.dtype == dtype and grads.dbias.shape == bias.shape
    np.testing.assert_array_equal(_bits(grads.dbias), _bits(grads32.dbias.astype(dtype)))


@pytest.mark.parametrize("dtype", half_ids)
@pytest.mark.parametrize("N", [1, 40])
def test_bnhd_and_strided_inputs_unchanged(dtype, N):
    """``(B, N, H, D)`` storage read in place, a strided view copied; outputs in the layout; no input mutated."""
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = _draw((1, N, 4, 16), dtype, 1), _draw((1, 64, 2, 16), dtype, 2), _draw((1, 64, 2, 32), dtype, 3)
    kept = [a.copy() for a in (q, k, v)]
    out, lse = enp.attention(q, k, v, layout="bnhd", causal=True, return_lse=True, backend="cpu")
    as_bhnd = [np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v)]
    want, want_lse = enp.attention(*as_bhnd, causal=True, return_lse=True, backend="cpu")
    assert out.shape == (1, N, 4, 32) and out.flags.c_contiguous
    np.testing.assert_array_equal(_bits(out.transpose(0, 2, 1, 3)), _bits(want))
    np.testing.assert_array_equal(lse, want_lse)
    grads = enp.attention_backward(out, q, k, v, out, lse, layout="bnhd", causal=True, backend="cpu")
    assert grads.dk.shape == k.shape and grads.dk.dtype == dtype
    strided = [a[:, :, ::2] for a in as_bhnd]  # every other query and key: a strided view
    got = enp.attention(*strided, backend="cpu")
    np.testing.assert_array_equal(_bits(got), _bits(enp.attention(*(a.copy() for a in strided), backend="cpu")))
    for before, after in zip(kept, (q, k, v)):
        np.testing.assert_array_equal(_bits(before), _bits(after))


def test_reference_computes_in_float64():
    q = _draw((1, 1, 5, 4), ml_dtypes.bfloat16)
    out = enp.attention(q, q, q, backend="reference")
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, enp.attention(*(q.astype(np.float64),) * 3, backend="reference"), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", half_ids)
def test_nan_in_a_half_cache_is_found(dtype):
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = _draw((1, 8, 1, 16), dtype, 1), _draw((1, 2, 700, 16), dtype, 2), _draw((1, 2, 700, 16), dtype, 3)
    v[0, 1, 600, 3] = np.nan
    with pytest.raises(ValueError, match="`v` contains NaN or inf"):
        enp.attention(q, k, v, backend="cpu")
    k[0, 0, 5, 0] = np.inf
    with pytest.raises(ValueError, match="`k` contains NaN or inf"):
        enp.attention(q, k, v, backend="cpu")


def test_bad_dtypes_name_the_argument():
    q = _draw((1, 1, 4, 8), ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="must share one dtype.*bfloat16, float32"):
        enp.attention(q, q.astype(np.float32), q, backend="cpu")
    with pytest.raises(TypeError, match=r"`k` must be a real floating-point array, got dtype uint16.*ml_dtypes"):
        enp.attention(q, q.view(np.uint16), q, backend="cpu")
    with pytest.raises(TypeError, match=r"`q` .*int16.*np.float16"):
        enp.attention(q.astype(np.float16).view(np.int16), q, q, backend="cpu")
    with pytest.raises(TypeError, match="`q` has the quantized dtype float8_e4m3fn: only `k` and `v`"):
        enp.attention(q.astype(ml_dtypes.float8_e4m3fn), q, q, backend="cpu")
    out, lse = enp.attention(q, q, q, return_lse=True, backend="cpu")
    with pytest.raises(TypeError, match="`lse` has dtype bfloat16, expected float32"):
        enp.attention_backward(out, q, q, q, out, lse.astype(ml_dtypes.bfloat16), backend="cpu")
    with pytest.raises(TypeError, match="`dout` has dtype float32, expected bfloat16"):
        enp.attention_backward(out.astype(np.float32), q, q, q, out, lse, backend="cpu")


def test_cuda_refuses_halves_by_name():
    host = pytest.importorskip("elastic_np.cuda._launch.arrays")
    q = _draw((1, 1, 4, 8), ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="`q` has dtype bfloat16; this backend takes float32, float64"):
        host.prepare(q, q, q)
