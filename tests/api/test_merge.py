"""merge_attention: partials over disjoint key sets against the oracle over their union.

Each shard's partial is the attention over a slice of the keys with
``beta = 0``; the options that depend on a key's position (``causal``,
``kv_lengths``, ``mask``, ``bias``) are carried over to the slice. The merge
must give `elastic_np.reference.attention` over all the keys with the sink
``beta``: float64 to ``1e-12 * max(1, max|oracle|)``.
"""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import elastic_np as enp
from elastic_np import reference as ref

H = 4
EPS32 = float(np.finfo(np.float32).eps)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _inputs(seed=0, B=2, Hkv=2, N=7, M=13, D=5, Dv=3, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, N, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, M, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, M, Dv)).astype(dtype)
    return q, k, v


def _shard_options(q, k, lo, hi, *, causal=False, kv_lengths=None, mask=None, bias=None, **rest):
    """The options of the attention over keys ``lo:hi`` that keep there what ``options`` keep.

    ``causal`` is bottom-right aligned to the whole key length, so a shard
    gets it as a mask; ``kv_lengths`` counts from the shard's first key.
    """
    B, _, N, _ = q.shape
    M = k.shape[2]
    opts = dict(rest)
    keep = np.ones((B, H, N, M), dtype=bool)
    if causal:
        keep &= np.arange(M)[None, :] <= np.arange(N)[:, None] + (M - N)
    if mask is not None:
        keep &= np.broadcast_to(mask, keep.shape)
    if causal or mask is not None:
        opts["mask"] = keep[..., lo:hi]
    if kv_lengths is not None:
        opts["kv_lengths"] = np.clip(np.asarray(kv_lengths) - lo, 0, hi - lo)
    if bias is not None:
        opts["bias"] = np.broadcast_to(bias, keep.shape)[..., lo:hi]
    return opts


def _partials(q, k, v, cuts, options, attention=ref.attention):
    """``(outs, lses)`` of the shards ``k[:, :, a:b]`` between consecutive ``cuts``, with beta = 0."""
    outs, lses = [], []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        opts = _shard_options(q, k, lo, hi, **options)
        out, lse = attention(q, k[:, :, lo:hi], v[:, :, lo:hi], beta=0.0, **opts)
        outs.append(out)
        lses.append(lse)
    return outs, lses


def _cpu_attention(q, k, v, **opts):
    return enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)


def _random_cuts(rng, M, shards):
    """``shards + 1`` cut points from 0 to M; repeated points make empty shards."""
    inner = np.sort(rng.integers(0, M + 1, size=shards - 1))
    return [0, *inner.tolist(), M]


def _worst(got, want):
    """Largest difference, with the ``-inf`` entries required at the same places."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg="-inf entries differ")
    finite = ~np.isneginf(want)
    assert np.isfinite(got[finite]).all(), "NaN or inf"
    return float(np.abs(got[finite] - want[finite]).max(initial=0.0))


def _scale(arrays):
    """``max(1, max |finite entry|)`` of an array or a list of arrays."""
    arrays = arrays if isinstance(arrays, list) else [arrays]
    finite = [np.abs(a[np.isfinite(a)]).max(initial=0.0) for a in map(np.asarray, arrays)]
    return max(1.0, float(max(finite)))


def assert_close64(got, want):
    """The project's float64 rule: ``max|got - want| <= 1e-12 * max(1, max|want|)``."""
    err, bound = _worst(got, want), 1e-12 * _scale(want)
    assert err <= bound, f"worst |diff| {err:.3e} > {bound:.1e}"


OPTIONS = {
    "plain": {},
    "nvm": dict(nvm=True),
    "causal": dict(causal=True),
    "causal-nvm-tau": dict(causal=True, nvm=True, tau=np.array([0.5, 1.0, 2.0, 0.7])),
    "mask": dict(mask=np.random.default_rng(1).random((2, 1, 7, 13)) > 0.6),
    "kv-lengths": dict(kv_lengths=np.array([0, 9])),
    "bias-inf": dict(bias=np.where(np.random.default_rng(2).random((7, 13)) < 0.3, -np.inf,
                                   np.random.default_rng(3).standard_normal((7, 13)))),
    "everything": dict(causal=True, nvm=True, kv_lengths=np.array([11, 4]),
                       mask=np.random.default_rng(4).random((7, 13)) > 0.2, scale=2.0),
}

BETAS = {
    "zero": 0.0,
    "scalar": 0.75,
    "per-head": np.array([0.0, 0.3, 1.0, 5.0]),
    "huge": 1e300,
    "tiny": 1e-300,
}


# ---------------------------------------------------------------------------
# Against the oracle over the union of the keys
# ---------------------------------------------------------------------------


class TestAgainstUnion:
    @pytest.mark.parametrize("beta", BETAS.values(), ids=BETAS.keys())
    @pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
    def test_random_splits(self, options, beta):
        q, k, v = _inputs()
        want_out, want_lse = ref.attention(q, k, v, beta=beta, **options)
        rng = np.random.default_rng(5)
        for shards in (1, 2, 3, 6):
            cuts = _random_cuts(rng, 13, shards)
            outs, lses = _partials(q, k, v, cuts, options)
            out, lse = enp.merge_attention(outs, lses, beta=beta)
            assert out.dtype == lse.dtype == np.float64
            assert_close64(out, want_out)
            assert_close64(lse, want_lse)

    def test_empty_shards_and_shards_that_empty_rows(self):
        # NVM with a large negative scale removes every key of many rows in a
        # shard; the mask empties whole rows of the middle shard; two shards have no keys.
        q, k, v = _inputs(seed=6)
        mask = np.ones((2, H, 7, 13), dtype=bool)
        mask[:, :, 2:5, 3:8] = False
        options = dict(nvm=True, mask=mask, kv_lengths=np.array([13, 3]))
        cuts = [0, 0, 3, 8, 8, 13, 13]
        outs, lses = _partials(q, k, v, cuts, options)
        assert np.isneginf(lses[0]).all() and np.isneginf(lses[-1]).all()
        assert np.isneginf(lses[2][:, :, 2:5]).all()  # the mask's rows, kept nowhere in the shard
        assert np.isneginf(lses[2][1]).all()  # kv_lengths: batch 1 keeps only keys 0-2
        beta = np.array([0.0, 0.3, 1.0, 5.0])
        out, lse = enp.merge_attention(outs, lses, beta=beta)
        want_out, want_lse = ref.attention(q, k, v, beta=beta, **options)
        assert_close64(out, want_out)
        assert_close64(lse, want_lse)

    @settings(max_examples=40, deadline=None)
    @given(
        seed=st.integers(0, 2**32 - 1),
        M=st.integers(0, 12),
        shards=st.integers(1, 5),
        beta=st.one_of(st.floats(0, 10), st.lists(st.floats(0, 10), min_size=H, max_size=H)),
        nvm=st.booleans(),
        causal=st.booleans(),
    )
    def test_property_any_split(self, seed, M, shards, beta, nvm, causal):
        q, k, v = _inputs(seed=seed % 1000, B=1, N=4, M=M)
        options = dict(nvm=nvm, causal=causal)
        cuts = _random_cuts(np.random.default_rng(seed), M, shards)
        outs, lses = _partials(q, k, v, cuts, options)
        out, lse = enp.merge_attention(outs, lses, beta=np.asarray(beta))
        want_out, want_lse = ref.attention(q, k, v, beta=np.asarray(beta), **options)
        assert_close64(out, want_out)
        assert_close64(lse, want_lse)

    def test_partials_in_any_order(self):
        q, k, v = _inputs(seed=7)
        outs, lses = _partials(q, k, v, [0, 2, 5, 5, 13], dict(nvm=True))
        want_out, want_lse = ref.attention(q, k, v, beta=0.5, nvm=True)
        for order in ([3, 2, 1, 0], [1, 3, 0, 2]):
            out, lse = enp.merge_attention([outs[i] for i in order], [lses[i] for i in order], beta=0.5)
            assert_close64(out, want_out)
            assert_close64(lse, want_lse)

    def test_merges_of_merges(self):
        # A merge with beta = 0 is itself a partial over the union of its keys.
        q, k, v = _inputs(seed=8)
        outs, lses = _partials(q, k, v, [0, 3, 6, 10, 13], dict(causal=True))
        left = enp.merge_attention(outs[:2], lses[:2])
        right = enp.merge_attention(outs[2:], lses[2:])
        out, lse = enp.merge_attention([left[0], right[0]], [left[1], right[1]], beta=2.0)
        want_out, want_lse = ref.attention(q, k, v, beta=2.0, causal=True)
        assert_close64(out, want_out)
        assert_close64(lse, want_lse)


class TestKernelPartials:
    """Partials from the CPU kernels, merged in their dtype."""

    def test_float64_cpu_partials(self):
        q, k, v = _inputs(seed=9)
        options = dict(nvm=True, kv_lengths=np.array([13, 5]))
        outs, lses = _partials(q, k, v, [0, 4, 4, 11, 13], options, attention=_cpu_attention)
        beta = np.array([0.0, 0.3, 1.0, 5.0])
        out, lse = enp.merge_attention(outs, lses, beta=beta)
        want_out, want_lse = ref.attention(q, k, v, beta=beta, **options)
        assert_close64(out, want_out)
        assert_close64(lse, want_lse)

    def test_float32_cpu_partials(self):
        # out is a convex combination of the partial outs with weights
        # exp(lse_p - lse), and lse moves by at most the largest move of an
        # lse_p: errors e_out and e_lse in the partials move out by at most
        # e_out + 2 e_lse max|out_p| (to first order), and lse by e_lse; the
        # result's rounding adds eps/2 of each scale.
        q, k, v = _inputs(seed=10, dtype=np.float32)
        options = dict(nvm=True, kv_lengths=np.array([13, 5]))
        cuts = [0, 4, 4, 11, 13]
        outs, lses = _partials(q, k, v, cuts, options, attention=_cpu_attention)
        oracle = _partials(*(a.astype(np.float64) for a in (q, k, v)), cuts, options)
        err_out = max(_worst(o, w) for o, w in zip(outs, oracle[0]))
        err_lse = max(_worst(l, w) for l, w in zip(lses, oracle[1]))
        beta = np.array([0.0, 0.3, 1.0, 5.0])
        out, lse = enp.merge_attention(outs, lses, beta=beta)
        assert out.dtype == lse.dtype == np.float32
        want_out, want_lse = ref.attention(*(a.astype(np.float64) for a in (q, k, v)), beta=beta, **options)
        scale_outs, scale_lse = _scale(oracle[0]), _scale(want_lse)
        assert _worst(out, want_out) <= err_out + 2.01 * err_lse * scale_outs + EPS32 * scale_outs
        assert _worst(lse, want_lse) <= err_lse + EPS32 * scale_lse

    @pytest.mark.parametrize("beta", [0.0, 0.75, np.array([0.0, 0.3, 1.0, 5.0])])
    def test_float32_rounded_partials_within_a_few_ulps(self, beta):
        # The float64 partials rounded to float32: each lse_p moves by at most
        # eps/2 |lse_p|, so each weight exp(lse_p - lse) by eps * max|lse|
        # relatively; with the roundings of out_p and of the result, out is
        # within eps (max|lse| + 1) max|out_p| and lse within eps max|lse|.
        q, k, v = _inputs(seed=11)
        options = dict(causal=True, nvm=True)
        outs, lses = _partials(q, k, v, [0, 5, 5, 9, 13], options)
        out, lse = enp.merge_attention([o.astype(np.float32) for o in outs],
                                       [l.astype(np.float32) for l in lses], beta=beta)
        assert out.dtype == lse.dtype == np.float32
        want_out, want_lse = ref.attention(q, k, v, beta=beta, **options)
        scale_lse = _scale(lses + [want_lse])
        assert _worst(out, want_out) <= 1.01 * EPS32 * (scale_lse + 1) * _scale(outs)
        assert _worst(lse, want_lse) <= 1.01 * EPS32 * scale_lse


# ---------------------------------------------------------------------------
# Edge cases, dtypes and shapes
# ---------------------------------------------------------------------------


class TestEdgeCases:
    def test_row_with_nothing_kept_anywhere(self):
        B, N, Dv = 2, 3, 5
        rng = np.random.default_rng(12)
        outs = [rng.standard_normal((B, H, N, Dv)) for _ in range(3)]
        lses = [rng.standard_normal((B, H, N)) for _ in range(3)]
        for lse in lses:
            lse[1, :, 2] = -np.inf  # row (1, :, 2) is empty in every partial
        beta = np.array([0.0, 0.5, 1.0, 3.0])
        with np.errstate(divide="ignore"):
            log_beta = np.log(beta)
        for dtype in (np.float64, np.float32):
            out, lse = enp.merge_attention([o.astype(dtype) for o in outs],
                                           [l.astype(dtype) for l in lses], beta=beta)
            np.testing.assert_array_equal(out[1, :, 2], 0.0)
            np.testing.assert_array_equal(lse[1, :, 2], log_beta.astype(dtype))
            assert lse[1, 0, 2] == -np.inf
            assert np.isfinite(out).all() and np.isfinite(lse[0]).all()

    def test_empty_partial_contributes_nothing_whatever_its_out(self):
        rng = np.random.default_rng(13)
        outs = [rng.standard_normal((1, H, 3, 2)) for _ in range(2)]
        lses = [rng.standard_normal((1, H, 3)) for _ in range(2)]
        garbage = 1e300 * rng.standard_normal((1, H, 3, 2))
        empty = np.full((1, H, 3), -np.inf)
        want = enp.merge_attention(outs, lses, beta=0.4)
        got = enp.merge_attention([outs[0], garbage, outs[1]], [lses[0], empty, lses[1]], beta=0.4)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])

    @pytest.mark.parametrize("dtype", [np.float32, np.float64])
    def test_one_partial_without_beta_is_returned_unchanged(self, dtype):
        rng = np.random.default_rng(14)
        out0 = rng.standard_normal((2, H, 3, 5)).astype(dtype)
        lse0 = (10 * rng.standard_normal((2, H, 3))).astype(dtype)
        lse0[0, 1, 1] = -np.inf
        out0[0, 1, 1] = 0.0
        out, lse = enp.merge_attention([out0], [lse0])
        np.testing.assert_array_equal(out, out0)
        np.testing.assert_array_equal(lse, lse0)
        assert not np.shares_memory(out, out0) and not np.shares_memory(lse, lse0)

    def test_far_apart_lses_without_warnings(self):
        outs = [np.ones((1, H, 2, 1)), 2 * np.ones((1, H, 2, 1)), 3 * np.ones((1, H, 2, 1))]
        lses = [np.full((1, H, 2), 1e308), np.full((1, H, 2), -1e308), np.full((1, H, 2), 0.0)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, lse = enp.merge_attention(outs, lses, beta=np.array([0.0, 1.0, 1e300, 2.0]))
        np.testing.assert_array_equal(out, 1.0)
        np.testing.assert_array_equal(lse, 1e308)

    def test_sink_dominates(self):
        # lse = log(e^-700 + 1) ~ 1e-304 keeps its relative accuracy; out ~ e^-700 is not flushed.
        out, lse = enp.merge_attention([np.ones((1, H, 1, 2))], [np.full((1, H, 1), -700.0)], beta=1.0)
        np.testing.assert_allclose(lse, np.log1p(np.exp(-700.0)), rtol=1e-15, atol=0)
        np.testing.assert_allclose(out, np.exp(-700.0), rtol=1e-15, atol=0)
        assert np.exp(-700.0) > 0 and np.log1p(np.exp(-700.0)) > 0

    def test_no_warning_for_empty_rows_and_zero_beta(self):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, lse = enp.merge_attention(np.zeros((2, 1, H, 3, 2)), np.full((2, 1, H, 3), -np.inf))
        np.testing.assert_array_equal(out, 0.0)
        assert np.isneginf(lse).all()


class TestDtypesAndShapes:
    def _parts(self, P=3, shape=(2, H, 3, 5), seed=15):
        rng = np.random.default_rng(seed)
        outs = rng.standard_normal((P, *shape))
        lses = rng.standard_normal((P, *shape[:-1]))
        lses[1, ..., :1, 2:3] = -np.inf  # rows (:, 0, 2) empty in partial 1, where the shape has them
        return outs, lses

    @pytest.mark.parametrize("dtype", [np.float32, np.float64])
    def test_sequence_and_stacked_array_give_the_same_bits(self, dtype):
        outs, lses = (a.astype(dtype) for a in self._parts())
        stacked = enp.merge_attention(outs, lses, beta=0.3)
        as_list = enp.merge_attention(list(outs), list(lses), beta=0.3)
        as_tuple = enp.merge_attention(tuple(outs), tuple(lses), beta=0.3)
        for got in (as_list, as_tuple):
            for a, b in zip(got, stacked):
                assert a.dtype == b.dtype == dtype
                np.testing.assert_array_equal(a, b)

    def test_nested_lists_are_array_like_partials(self):
        outs, lses = self._parts(P=2)
        want = enp.merge_attention(outs, lses, beta=0.3)
        got = enp.merge_attention([o.tolist() for o in outs], [l.tolist() for l in lses], beta=0.3)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])

    def test_float64_result_is_the_reference_bit_for_bit(self):
        outs, lses = self._parts()
        beta = np.array([0.0, 0.3, 1.0, 5.0])
        got = enp.merge_attention(outs, lses, beta=beta)
        want = ref.merge_attention(outs, lses, beta=beta)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])

    def test_float32_result_is_the_reference_rounded(self):
        outs, lses = (a.astype(np.float32) for a in self._parts())
        got = enp.merge_attention(outs, lses, beta=0.3)
        want = ref.merge_attention(outs, lses, beta=0.3)
        assert want[0].dtype == want[1].dtype == np.float64
        np.testing.assert_array_equal(got[0], want[0].astype(np.float32))
        np.testing.assert_array_equal(got[1], want[1].astype(np.float32))

    def test_reference_takes_any_real_float_and_mixed_dtypes(self):
        outs, lses = self._parts(P=2)
        mixed = ([outs[0].astype(np.float16), outs[1]], [lses[0].astype(np.float32), lses[1]])
        got = ref.merge_attention(*mixed, beta=0.3)
        want = ref.merge_attention(*(([a.astype(np.float64) for a in x]) for x in mixed), beta=0.3)
        assert got[0].dtype == got[1].dtype == np.float64
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])

    @pytest.mark.parametrize("shape", [(0, H, 3, 5), (2, H, 0, 5), (2, H, 3, 0), (2, 0, 3, 5)])
    def test_empty_arrays(self, shape):
        outs, lses = self._parts(P=2, shape=shape)
        beta = 0.5 if shape[1] == 0 else np.array([0.0, 0.3, 1.0, 5.0])
        for fn, dtype in ((enp.merge_attention, np.float32), (ref.merge_attention, np.float64)):
            out, lse = fn(outs.astype(np.float32), lses.astype(np.float32), beta=beta)
            assert out.shape == shape and lse.shape == shape[:-1]
            assert out.dtype == lse.dtype == dtype

    @pytest.mark.parametrize("stacked", [True, False])
    @pytest.mark.parametrize("fn", [enp.merge_attention, ref.merge_attention])
    @pytest.mark.parametrize("dtype", [np.float32, np.float64])
    def test_inputs_are_not_mutated(self, fn, dtype, stacked):
        outs, lses = (a.astype(dtype) for a in self._parts())
        beta = np.array([0.0, 0.3, 1.0, 5.0])
        saved = [a.copy() for a in (outs, lses, beta)]
        args = (outs, lses) if stacked else (list(outs), list(lses))
        out, lse = fn(*args, beta=beta)
        for a, b in zip((outs, lses, beta), saved):
            np.testing.assert_array_equal(a, b)
        assert not np.shares_memory(out, outs) and not np.shares_memory(lse, lses)


# ---------------------------------------------------------------------------
# Bad input: a clear error naming the argument
# ---------------------------------------------------------------------------


def _good(P=2, shape=(1, H, 3, 2)):
    outs = [np.zeros(shape) for _ in range(P)]
    lses = [np.zeros(shape[:-1]) for _ in range(P)]
    return outs, lses


def _with(which, p, index, value):
    outs, lses = _good()
    (outs if which == "outs" else lses)[p][index] = value
    return outs, lses


BAD = {
    "no-partial": (([], []), {}, ValueError, "`outs`"),
    "no-partial-stacked": ((np.zeros((0, 1, H, 3, 2)), np.zeros((0, 1, H, 3))), {}, ValueError, "`outs`"),
    "count-mismatch": ((_good()[0], _good(P=3)[1]), {}, ValueError, "`lses`"),
    "outs-shapes-differ": (([np.zeros((1, H, 3, 2)), np.zeros((1, H, 3, 4))], _good()[1]), {},
                           ValueError, "`outs`"),
    "lses-shape": ((_good()[0], [np.zeros((1, H, 3)), np.zeros((1, H, 4))]), {}, ValueError, "`lses`"),
    "single-partial-not-stacked": ((np.zeros((1, H, 3, 2)), np.zeros((1, H, 3))), {}, ValueError, "`outs`"),
    "outs-3d": (([np.zeros((H, 3, 2))], [np.zeros((H, 3))]), {}, ValueError, "`outs`"),
    "lses-stacked-ndim": ((np.zeros((2, 1, H, 3, 2)), np.zeros((2, 1, H, 3, 1))), {}, ValueError, "`lses`"),
    "lse-nan": (_with("lses", 1, (0, 1, 2), np.nan), {}, ValueError, "`lses`"),
    "lse-plus-inf": (_with("lses", 0, (0, 0, 0), np.inf), {}, ValueError, "`lses`"),
    "out-nan": (_with("outs", 1, (0, 2, 1, 0), np.nan), {}, ValueError, "`outs`"),
    "out-inf": (_with("outs", 0, (0, 0, 0, 1), -np.inf), {}, ValueError, "`outs`"),
    "beta-negative": (_good(), dict(beta=-0.1), ValueError, "`beta`"),
    "beta-nan": (_good(), dict(beta=np.nan), ValueError, "`beta`"),
    "beta-inf": (_good(), dict(beta=np.inf), ValueError, "`beta`"),
    "beta-per-head-negative": (_good(), dict(beta=np.array([0.0, 1.0, -1.0, 0.0])), ValueError, "`beta`"),
    "beta-shape": (_good(), dict(beta=np.ones(3)), ValueError, "`beta`"),
    "beta-bool": (_good(), dict(beta=True), TypeError, "`beta`"),
    "outs-int": (([np.zeros((1, H, 3, 2), dtype=int)] * 2, _good()[1]), {}, TypeError, "`outs`"),
    "lses-complex": ((_good()[0], [np.zeros((1, H, 3), dtype=complex)] * 2), {}, TypeError, "`lses`"),
    "lses-bool": ((_good()[0], [np.zeros((1, H, 3), dtype=bool)] * 2), {}, TypeError, "`lses`"),
    "outs-not-a-sequence": (((o for o in _good()[0]), _good()[1]), {}, TypeError, "`outs`"),
    "lses-a-dict": ((_good()[0], {0: np.zeros((1, H, 3))}), {}, TypeError, "`lses`"),
}


@pytest.mark.parametrize("fn", [enp.merge_attention, ref.merge_attention])
@pytest.mark.parametrize("args, kwargs, error, match", BAD.values(), ids=BAD.keys())
def test_bad_input_names_the_argument(fn, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        fn(*args, **kwargs)


KERNEL_DTYPE_ERRORS = {
    "float16-outs": (([np.zeros((1, H, 3, 2), np.float16)] * 2, _good()[1]), "`outs`"),
    "float16-lses": (([np.zeros((1, H, 3, 2), np.float32)] * 2, [np.zeros((1, H, 3), np.float16)] * 2), "`lses`"),
    "mixed-outs": (([np.zeros((1, H, 3, 2), np.float32), np.zeros((1, H, 3, 2))], _good()[1]), "`outs`"),
    "mixed-with-lses": (([np.zeros((1, H, 3, 2), np.float32)] * 2, _good()[1]), "`lses`"),
}


@pytest.mark.parametrize("args, match", KERNEL_DTYPE_ERRORS.values(), ids=KERNEL_DTYPE_ERRORS.keys())
def test_public_merge_takes_one_kernel_dtype(args, match):
    with pytest.raises(TypeError, match=match):
        enp.merge_attention(*args)


def test_error_says_which_partial_and_where():
    outs, lses = _with("lses", 1, (0, 2, 1), np.nan)
    with pytest.raises(ValueError, match=r"`lses` contains NaN or \+inf .*partial 1.*\[0, 2, 1\]"):
        enp.merge_attention(outs, lses)
