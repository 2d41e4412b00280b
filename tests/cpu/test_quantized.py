"""Quantized caches (int8, float8): `quantize_kv`, the checks of a call, and the CPU kernels against the oracle.

The oracle reads the dequantized cache in float64; a kernel may be at most
twice as far from it as a naive float32 evaluation on the same dequantized
cache, plus the kit's rounding allowance, as for a float cache
(`elastic_np.testing._tolerances.float32_allowed`, the issue's rule).
The `small_tiles` fixture cuts the decode kernel's tiles and splits small, so
that short caches cross several of both.
"""

import tracemalloc

import ml_dtypes
import numba
import numpy as np
import pytest
from numba import njit

import elastic_np as enp
from elastic_np import reference
from elastic_np._contract import _quantized, _spec
from elastic_np.cpu._runtime import config
from elastic_np.cpu._tiles.halves import bits, widen
from elastic_np.cpu._tiles.quantized import UNIT
from elastic_np.testing import _tolerances
from oracle_checks import assert_matches_oracle, decode_cases, make_inputs

FORMATS = ("int8", "float8_e4m3fn", "float8_e5m2")


@pytest.fixture
def small_tiles(monkeypatch):
    """Decode tiles of 37 keys (a few rows) and splits of at least 7 keys, into as many as 64 tasks."""
    monkeypatch.setattr(config, "DECODE_BLOCK_K", 74)
    monkeypatch.setattr(config, "SERIAL_WORK", 0)
    monkeypatch.setattr(config, "DECODE_MIN_SPLIT_KEYS", 7)
    monkeypatch.setattr(config, "DECODE_MIN_TASKS", 64)


def _dequantized(data, scale):
    """``(B, Hkv, M, D)`` bytes times a scalar, ``(Hkv,)``, per-token ``(B, Hkv, M)`` or per-group ``(B, Hkv, M,
    D // G)`` scale, in float64 (written out here, apart from the library's)."""
    scale = np.asarray(scale, dtype=np.float64)
    if scale.ndim <= 1:
        return data.astype(np.float64) * scale.reshape(-1, 1, 1)
    if scale.ndim == 3:
        scale = scale[..., None]
    return data.astype(np.float64) * np.repeat(scale, data.shape[-1] // scale.shape[-1], axis=-1)


def _group_size(dim):
    """A group size for a head dim: the largest of 32, 16, 4, 3, 2, 1 below it that divides it."""
    return max(g for g in (32, 16, 4, 3, 2, 1) if dim % g == 0 and g < max(dim, 2))


def _quantized_case(fmt, granularity="head", seed=0, **shape):
    """``q`` (float32) and a quantized ``(k, v, k_scale, v_scale)`` of `make_inputs`' arrays, in ``(B, H, N, D)``;
    ``granularity`` "group": groups of `_group_size` columns."""
    q, k, v, _ = make_inputs(np.float32, seed=seed, **shape)
    k, v = 3.0 * k, 0.5 * v  # scales away from 1
    (kd, ks), (vd, vs) = (enp.quantize_kv(a, fmt, scale=granularity, group_size=_group_size(a.shape[-1])
                                          if granularity == "group" else None) for a in (k, v))
    return q, kd, vd, ks, vs


def _in_layout(scale, layout):
    """A scale of a ``(B, Hkv, M, D)`` cache for the cache stored in ``layout``."""
    return scale.swapaxes(1, 2) if layout == "bnhd" and np.ndim(scale) >= 3 else scale


def _check_against_oracle(q, kd, vd, ks, vs, opts, layout="bhnd"):
    """The cpu kernels' ``out`` and ``lse`` of a quantized cache within the rule; ``q, kd, vd`` in (B, H, N, D)."""
    given = [a if layout == "bhnd" else np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, kd, vd)]
    scales = [np.ascontiguousarray(_in_layout(s, layout)) for s in (ks, vs)]
    out, lse = enp.attention(*given, k_scale=scales[0], v_scale=scales[1], layout=layout, return_lse=True,
                             backend="cpu", **opts)
    if layout == "bnhd":
        out = out.transpose(0, 2, 1, 3)
    kf, vf = _dequantized(kd, ks), _dequantized(vd, vs)
    want_out, want_lse = reference.attention(q.astype(np.float64), kf, vf, **opts)
    naive = _tolerances.naive_orderings(q, kf, vf, None, opts, np.float32, backward=False)
    # the kit's allowance for what no reordering samples (the logits' rounding), as for a float cache
    rounding = _tolerances.rounding_allowance(q, kf, vf, np.ones(want_out.shape), opts)
    assert_matches_oracle("out", out, want_out, np.float32, [n["out"] for n in naive], rounding.get("out"))
    assert_matches_oracle("lse", lse, want_lse, np.float32, [n["lse"] for n in naive], rounding.get("lse"))
    return out, lse


class TestQuantizeKv:
    def test_int8_rounds_to_nearest_even_with_the_largest_magnitude_at_127(self):
        x = np.array([127.0, 2.5, 3.5, -2.5, -127.0, 0.4], dtype=np.float32).reshape(1, 1, 1, 6)
        data, scale = enp.quantize_kv(x, "int8")
        assert data.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (1,)
        assert scale[0] == 1.0
        assert data.ravel().tolist() == [127, 2, 4, -2, -127, 0]

    @pytest.mark.parametrize("fmt, largest", [("float8_e4m3fn", 448.0), ("float8_e5m2", 57344.0)])
    def test_float8_maps_the_largest_magnitude_to_the_largest_finite(self, fmt, largest):
        x = np.random.default_rng(1).standard_normal((2, 3, 5, 8)).astype(np.float32)
        data, scale = enp.quantize_kv(x, fmt)
        assert data.dtype == getattr(ml_dtypes, fmt) and scale.shape == (3,)
        per_head = np.abs(data.astype(np.float64)).max(axis=(0, 2, 3))
        np.testing.assert_array_equal(per_head, largest)
        half_spacing = 2.0 ** -4 if fmt == "float8_e4m3fn" else 2.0 ** -3  # 3 or 2 bits of mantissa
        err = np.abs(_dequantized(data, scale) - x)
        # relative to the value, or to the smallest normal's spacing below it (subnormals)
        assert (err <= half_spacing * np.maximum(np.abs(x), scale[None, :, None, None] * largest * 2.0 ** -12)).all()

    def test_per_tensor_and_bnhd_scales(self):
        x = np.random.default_rng(2).standard_normal((2, 3, 5, 8)).astype(np.float32)
        x[:, 1] *= 10.0
        data, scale = enp.quantize_kv(x, "int8", scale="tensor")
        assert scale.shape == () and scale == np.float32(np.abs(x).max() / 127)
        bhnd, per_head = enp.quantize_kv(x, "int8")
        bnhd, per_head_bnhd = enp.quantize_kv(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), "int8", layout="bnhd")
        np.testing.assert_array_equal(per_head, per_head_bnhd)
        np.testing.assert_array_equal(bhnd, bnhd.transpose(0, 2, 1, 3))
        assert per_head[1] > 5 * per_head[0]

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("granularity, group", [("token", 8), ("group", 4), ("group", None)])
    def test_per_token_and_per_group_scales(self, fmt, granularity, group):
        """One scale per token and head (or per group of its columns): each one's largest magnitude at the
        format's largest finite, in either layout; 32 columns a group by default."""
        x = np.random.default_rng(3).standard_normal((2, 3, 5, 64 if group is None else 8)).astype(np.float32)
        x[:, :, 2] *= 100.0
        size = None if granularity == "token" else group
        data, scale = enp.quantize_kv(x, fmt, scale=granularity, group_size=size)
        G = group or 32
        assert scale.dtype == np.float32
        assert scale.shape == ((2, 3, 5) if granularity == "token" else (2, 3, 5, x.shape[-1] // G))
        largest = np.abs(data.astype(np.float64)).reshape(*x.shape[:3], -1, G).max(axis=-1)
        np.testing.assert_array_equal(largest, _quantized.LARGEST[fmt])
        amax = np.abs(x.astype(np.float64)).reshape(*x.shape[:3], -1, G).max(axis=-1)
        np.testing.assert_array_equal(scale.reshape(amax.shape), (amax / _quantized.LARGEST[fmt]).astype(np.float32))
        bnhd, bnhd_scale = enp.quantize_kv(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), fmt, scale=granularity,
                                           group_size=size, layout="bnhd")
        assert np.array_equal(bnhd.view(np.uint8), data.transpose(0, 2, 1, 3).view(np.uint8))
        np.testing.assert_array_equal(bnhd_scale, scale.swapaxes(1, 2))

    def test_a_head_of_zeros_has_scale_one(self):
        data, scale = enp.quantize_kv(np.zeros((1, 2, 3, 4)), "float8_e4m3fn")
        assert scale.tolist() == [1.0, 1.0] and not data.astype(np.float32).any()

    @pytest.mark.parametrize("args, kwargs, error, match", [
        ((np.ones((1, 1, 2, 2)), "int4"), {}, TypeError, "`dtype` must be one of int8"),
        ((np.ones((1, 1, 2, 2)), "int8"), {"scale": "token", "group_size": 2}, ValueError, "goes with scale='group'"),
        ((np.ones((1, 1, 2, 6)), "int8"), {"scale": "group", "group_size": 4}, ValueError, "must divide"),
        ((np.ones((1, 1, 2, 6)), "int8"), {"scale": "group", "group_size": 0}, ValueError, "positive int"),
        ((np.ones((1, 1, 2, 2)), "int8"), {"scale": "channel"}, ValueError, "`scale` must be one of"),
        ((np.ones((1, 2, 2)), "int8"), {}, ValueError, "4 dimensions"),
        ((np.full((1, 1, 2, 2), np.nan), "int8"), {}, ValueError, "NaN or inf"),
        ((np.ones((1, 1, 2, 2)), "int8"), {"layout": "nhd"}, ValueError, "`layout`"),
    ])
    def test_bad_arguments(self, args, kwargs, error, match):
        with pytest.raises(error, match=match):
            enp.quantize_kv(*args, **kwargs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_stored_byte_widens_to_its_value(fmt):
    """Every byte of each format, through the kernels' scalar widening, against ``ml_dtypes``."""
    dtype = np.dtype(np.int8) if fmt == "int8" else np.dtype(getattr(ml_dtypes, fmt))
    stored = np.arange(256, dtype=np.uint8).view(dtype)

    @njit
    def widened(a):
        out = np.empty(a.shape[0], dtype=np.float32)
        for i in range(a.shape[0]):
            out[i] = widen(a[i])
        return out

    got = widened(bits(stored)).astype(np.float64) / UNIT[fmt]
    np.testing.assert_array_equal(got, stored.astype(np.float64))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("N", [1, 5])
@pytest.mark.parametrize("case", list(decode_cases(2, 4, 5, 97)))
def test_decode_matches_the_oracle(small_tiles, fmt, N, case):
    opts = decode_cases(2, 4, N, 97)[case]
    q, kd, vd, ks, vs = _quantized_case(fmt, N=N, M=97, D=20, Dv=12)
    _check_against_oracle(q, kd, vd, ks, vs, opts)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("granularity", ["token", "group"])
@pytest.mark.parametrize("case", ["plain", "window", "kv-lengths", "nvm-tau-beta", "bias", "everything"])
def test_decode_with_per_token_and_per_group_scales_matches_the_oracle(small_tiles, fmt, granularity, case):
    """Head dims 20 (groups of 4) and 12 (groups of 4), 1 and 5 queries: tiles across splits, grouped heads."""
    for N in (1, 5):
        q, kd, vd, ks, vs = _quantized_case(fmt, granularity, N=N, M=97, D=20, Dv=12)
        _check_against_oracle(q, kd, vd, ks, vs, decode_cases(2, 4, N, 97)[case])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("granularity", ["tensor", "head", "token", "group"])
def test_layouts_and_scales(small_tiles, fmt, layout, granularity):
    """16 queries (the stacked-rows kernel, for a quantized cache), grouped heads, head dims 100 (whole chunks of
    bytes and a masked one) and 33."""
    q, kd, vd, ks, vs = _quantized_case(fmt, granularity, B=1, H=8, Hkv=2, N=16, M=150, D=100, Dv=33)
    _check_against_oracle(q, kd, vd, ks, vs, dict(causal=True, tau=0.7, beta=0.3), layout)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("opts", [{}, dict(causal=True, softcap=2.0), dict(window_size=(9, 3), tau=1.5, beta=1.0)],
                         ids=["plain", "causal-softcap", "window-tau-beta"])
@pytest.mark.parametrize("granularity", ["head", "token", "group"])
def test_prefill_matches_the_oracle(fmt, opts, granularity):
    q, kd, vd, ks, vs = _quantized_case(fmt, granularity, N=40, M=61, D=16, Dv=16)
    _check_against_oracle(q, kd, vd, ks, vs, opts)


def test_the_reference_reads_the_dequantized_cache():
    q, kd, vd, ks, vs = _quantized_case("float8_e4m3fn", N=3, M=11)
    got = enp.attention(q, kd, vd, k_scale=ks, v_scale=vs, causal=True, backend="reference")
    want = reference.attention(q.astype(np.float64), _dequantized(kd, ks), _dequantized(vd, vs), causal=True)[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
@pytest.mark.parametrize("N", [2, 40])
def test_a_half_query_reads_a_quantized_cache(half, N):
    q, kd, vd, ks, vs = _quantized_case("int8", B=1, N=N, M=300, D=32, Dv=32)
    q_half = q.astype(ml_dtypes.bfloat16 if half == "bfloat16" else np.float16)
    out = enp.attention(q_half, kd, vd, k_scale=ks, v_scale=vs, backend="cpu")
    assert out.dtype == q_half.dtype
    want = enp.attention(q_half.astype(np.float32), kd, vd, k_scale=ks, v_scale=vs, backend="cpu")
    np.testing.assert_array_equal(out, want.astype(q_half.dtype))  # the float32 result, rounded once


@pytest.mark.parametrize("fmt", FORMATS)
def test_bits_do_not_depend_on_the_thread_count(fmt):
    q, kd, vd, ks, vs = _quantized_case(fmt, B=1, H=8, Hkv=2, N=2, M=4100, D=64, Dv=64)
    before = numba.get_num_threads()
    try:
        results = []
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            results.append(enp.attention(q, kd, vd, k_scale=ks, v_scale=vs, causal=True, backend="cpu"))
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("granularity", ["head", "token", "group"])
def test_decode_makes_no_dequantized_copy(granularity):
    """A decoding step on a 16 MiB int8 cache allocates far less than the 64 MiB of a float32 copy."""
    q, kd, vd, ks, vs = _quantized_case("int8", granularity, B=1, H=32, Hkv=8, N=1, M=8192, D=128, Dv=128)
    enp.attention(q, kd, vd, k_scale=ks, v_scale=vs, backend="cpu")  # compiled, planned
    tracemalloc.start()
    try:
        enp.attention(q, kd, vd, k_scale=ks, v_scale=vs, backend="cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20, f"peak {peak / 2**20:.2f} MiB"


@pytest.mark.parametrize("granularity", ["token", "group"])
@pytest.mark.parametrize("B, N, M", [(1, 1, 0), (0, 1, 5), (1, 0, 5), (2, 20, 0), (1, 20, 1)])
def test_empty_batches_rows_and_caches_with_fine_scales(granularity, B, N, M):
    """No keys (every row empty: zeros, ``lse`` -inf), no queries, no batch entries, a single key, decode and
    prefill: the reference's results, the scales' shapes following the cache's."""
    q, kd, vd, ks, vs = _quantized_case("int8", granularity, B=B, H=4, Hkv=2, N=N, M=M, D=8, Dv=8)
    assert ks.shape[:3] == (B, 2, M)
    got = enp.attention(q, kd, vd, k_scale=ks, v_scale=vs, return_lse=True, backend="cpu")
    want = enp.attention(q, kd, vd, k_scale=ks, v_scale=vs, return_lse=True, backend="reference")
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("granularity", ["head", "group"])
def test_prefill_makes_no_dequantized_copy(granularity):
    """Prefill dequantizes a key tile at a time into its scratch: 64 queries on an 8,192-key int8 cache allocate
    their output (0.125 MiB) and little else, not the 16 MiB of float32 keys and values."""
    q, kd, vd, ks, vs = _quantized_case("int8", granularity, B=1, H=8, Hkv=2, N=64, M=8192, D=64, Dv=64)
    enp.attention(q, kd, vd, k_scale=ks, v_scale=vs, causal=True, backend="cpu")
    tracemalloc.start()
    try:
        enp.attention(q, kd, vd, k_scale=ks, v_scale=vs, causal=True, backend="cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"peak {peak / 2**20:.2f} MiB"


@pytest.mark.parametrize("fmt, byte", [("float8_e4m3fn", 0x7F), ("float8_e5m2", 0x7C), ("float8_e5m2", 0xFE)])
@pytest.mark.parametrize("N, D, at", [(1, 8, 3), (1, 128, 70), (40, 8, 3), (40, 128, 70)])
@pytest.mark.parametrize("granularity", ["head", "group"])
def test_a_nan_or_inf_in_a_float8_cache_is_an_error(fmt, byte, N, D, at, granularity):
    """Head dim 8: the tails' scalar and masked paths; 128: whole chunks of key bytes and blocks of values; per
    group (of 4 and of 32 columns), the bytes dequantized into scratch, one at a time and a vector at a time."""
    q, kd, vd, ks, vs = _quantized_case(fmt, granularity, B=1, N=N, M=50, D=D, Dv=D)
    for name in ("k", "v"):
        bad = {"k": kd.copy(), "v": vd.copy()}
        bad[name].view(np.uint8)[0, 1, 17, at] = byte
        with pytest.raises(ValueError, match=f"`{name}` contains NaN or inf"):
            enp.attention(q, bad["k"], bad["v"], k_scale=ks, v_scale=vs, backend="cpu")


def _error_cases():
    q, kd, vd, ks, vs = _quantized_case("int8", B=1, N=2, M=9)

    def ones(shape):
        return np.ones(shape, dtype=np.float32)

    def zero_at(shape):
        scale = ones(shape)
        scale.flat[-1] = 0.0
        return scale

    def nan_at(shape):
        scale = ones(shape).astype(np.float16)
        scale.flat[3] = np.nan
        return scale

    k, v = kd.astype(np.float32), vd.astype(np.float32)
    e4m3 = kd.astype(ml_dtypes.float8_e4m3fn)
    return [
        ("k without its scale", (q, kd, vd), dict(v_scale=vs), ValueError, "pass its scale `k_scale`"),
        ("v without its scale", (q, kd, vd), dict(k_scale=ks), ValueError, "pass its scale `v_scale`"),
        ("a scale with a float cache", (q, k, v), dict(k_scale=1.0), ValueError, "`k_scale` is given but `k`"),
        ("a scale of the wrong shape", (q, kd, vd), dict(k_scale=np.ones(3), v_scale=vs), ValueError,
         r"shape \(Hkv,\) = \(2,\)"),
        ("a per-token scale of the wrong shape", (q, kd, vd), dict(k_scale=ones((1, 2, 8)), v_scale=ones((1, 2, 9))),
         ValueError, r"`k_scale` of shape \(1, 2, 8\) is neither per token, \(1, 2, 9\)"),
        ("groups that do not divide D", (q, kd, vd), dict(k_scale=ones((1, 2, 9, 3)), v_scale=ones((1, 2, 9))),
         ValueError, "G dividing D = 8"),
        ("a float64 per-token scale", (q, kd, vd), dict(k_scale=np.ones((1, 2, 9)), v_scale=ones((1, 2, 9))),
         TypeError, "must be float32 or float16, got float64"),
        ("a zero per-token scale", (q, kd, vd), dict(k_scale=ones((1, 2, 9)), v_scale=zero_at((1, 2, 9))),
         ValueError, "`v_scale` must be finite and > 0 everywhere, got 0.0"),
        ("a NaN per-group scale", (q, kd, vd), dict(k_scale=nan_at((1, 2, 9, 2)), v_scale=ones((1, 2, 9, 4))),
         ValueError, "`k_scale` must be finite and > 0 everywhere, got nan"),
        ("per-token keys, per-head values", (q, kd, vd), dict(k_scale=ones((1, 2, 9)), v_scale=vs), ValueError,
         "both be per token or per group, or neither"),
        ("a zero scale", (q, kd, vd), dict(k_scale=0.0, v_scale=vs), ValueError, "`k_scale` must be finite and > 0"),
        ("a negative scale", (q, kd, vd), dict(k_scale=ks, v_scale=-vs), ValueError, "`v_scale` must be finite"),
        ("a NaN scale", (q, kd, vd), dict(k_scale=np.array([1.0, np.nan]), v_scale=vs), ValueError,
         "`k_scale` must be finite"),
        ("an inf scale", (q, kd, vd), dict(k_scale=ks, v_scale=np.inf), ValueError, "`v_scale` must be finite"),
        ("mixed quantized and float", (q, kd, v), dict(k_scale=ks), TypeError, "both be quantized"),
        ("two quantized dtypes", (q, kd, e4m3), dict(k_scale=ks, v_scale=vs), TypeError, "both be quantized"),
        ("a quantized q", (kd[:, :1].repeat(4, axis=1), kd, vd), dict(k_scale=ks, v_scale=vs), TypeError,
         "`q` has the quantized dtype"),
    ]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("label, arrays, scales, error, match", _error_cases(), ids=[c[0] for c in _error_cases()])
def test_bad_calls_are_errors_that_mutate_nothing(backend, label, arrays, scales, error, match):
    copies = [a.copy() for a in arrays] + [np.copy(s) for s in scales.values()]
    with pytest.raises(error, match=match):
        enp.attention(*arrays, backend=backend, **scales)
    for before, after in zip(copies, list(arrays) + list(scales.values())):
        np.testing.assert_array_equal(before, after)


def test_what_is_not_supported_yet_says_so():
    q, kd, vd, ks, vs = _quantized_case("int8", B=1, N=2, M=9)
    out, lse = enp.attention(q, kd, vd, k_scale=ks, v_scale=vs, return_lse=True, backend="cpu")
    for backend in ("cpu", "reference"):
        with pytest.raises(TypeError, match="no gradient through a quantized cache"):
            enp.attention_backward(np.ones_like(out), q, kd, vd, out, lse, k_scale=ks, v_scale=vs, backend=backend)
    with pytest.raises(TypeError, match="`q` in float32, bfloat16 or float16"):
        enp.attention(q.astype(np.float64), kd, vd, k_scale=ks, v_scale=vs, backend="cpu")
    with pytest.raises(ValueError, match="backend 'cuda' does not take `k_scale`"):
        _spec.check_support(dict(k_scale=ks), "cuda")
    packed = dict(cu_seqlens_q=[0, 2], cu_seqlens_k=[0, 9])  # they are taken: tests/api/test_varlen_quantized.py
    with pytest.raises(ValueError, match="`k_scale`"):
        enp.varlen_attention(q[0].transpose(1, 0, 2), kd[0].transpose(1, 0, 2), vd[0].transpose(1, 0, 2), **packed)
    kf = kd[0].transpose(1, 0, 2).copy()
    with pytest.raises(TypeError, match="no gradient through a quantized cache"):
        enp.varlen_attention_backward(np.ones((2, 4, 8)), q[0].transpose(1, 0, 2), kf, kf, np.ones((2, 4, 8)),
                                      np.zeros((2, 4)), **packed, k_scale=np.ones((9, 2), np.float32),
                                      v_scale=np.ones((9, 2), np.float32), backend="cpu")


def test_the_torch_adapter_reads_an_int8_cache():
    torch = pytest.importorskip("torch")
    import elastic_np.torch as enp_torch

    q, kd, vd, ks, vs = _quantized_case("int8", B=1, N=2, M=40)
    got = enp_torch.attention(*(torch.from_numpy(a) for a in (q, kd, vd)), k_scale=torch.from_numpy(ks),
                              v_scale=torch.from_numpy(vs))
    np.testing.assert_array_equal(got.numpy(), enp.attention(q, kd, vd, k_scale=ks, v_scale=vs, backend="cpu"))


def test_planned_calls_keep_each_format_apart():
    """Repeated calls with scalar scales go through `attention`'s plans, a growing cache through their resized kin:
    each format of the same shapes has its own."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 8, 1, 32)).astype(np.float32)
    for M in (100, 101, 101, 102):
        for fmt in FORMATS:
            kd, _ = enp.quantize_kv(rng.standard_normal((1, 2, M, 32)), fmt, scale="tensor")
            got = enp.attention(q, kd, kd, k_scale=0.01, v_scale=0.02, backend="cpu")
            want = enp.attention(q, kd, kd, k_scale=0.01, v_scale=0.02, backend="reference")
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_every_kind_of_scale_shares_one_compiled_kernel():
    # per-head scales reach the kernels as operands of no scale a row (`cache_scales.NO_FINE`), never as None: a
    # kernel compiled for per-head scales serves per-token and per-group ones (of float32) too
    from elastic_np.cpu._decode.decode import _decode_kernel
    from elastic_np.cpu._prefill.forward import _forward_kernel

    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((1, 64, 2, 32)).astype(np.float32) for _ in range(2))
    for scale in ("head", "tensor", "token", "group"):
        group = 16 if scale == "group" else None
        (kd, ks), (vd, vs) = (enp.quantize_kv(a, "int8", scale=scale, group_size=group, layout="bnhd") for a in (k, v))
        for N in (1, 40):  # the decode kernel, the prefill kernel
            q = rng.standard_normal((1, N, 4, 32)).astype(np.float32)
            enp.attention(q, kd, vd, layout="bnhd", k_scale=ks, v_scale=vs, backend="cpu")
    decode_fine = [sig[6] for sig in _decode_kernel.signatures if "int8" in str(sig[1])]
    prefill_quant = [sig[5] for sig in _forward_kernel.signatures if "int8" in str(sig[1])]
    assert decode_fine and prefill_quant
    assert not any(isinstance(fine, numba.types.NoneType) for fine in decode_fine), decode_fine
    assert not any("none" in str(quant) for quant in prefill_quant), prefill_quant
