"""The float64 vector oracles: softmax, log_softmax, nvm, elastic_softmax, online_softmax, VJPs."""

import warnings

import numpy as np
import pytest
import scipy.special
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from elastic_np import reference as ref
from elastic_np.testing import gradcheck

# Expected values computed once with mpmath at 50 significant digits:
#   m = max(x); lse = m + log(fsum(exp(x - m))); softmax = exp(x - lse)
# (values below the float64 range are written as they parse: 0.0).
MPMATH_SOFTMAX = {
    "small": (
        [1.0, 2.0, 3.0],
        [0.090030573170380457998, 0.24472847105479765247, 0.66524095577482188953],
        [-2.4076059644443803045, -1.4076059644443803045, -0.40760596444438030448],
    ),
    "near_700": (
        [700.0, 699.5, 698.0, -700.0],
        [0.57409699296769455953, 0.34820742788373485248, 0.077695579148570587986, 0.0],
        [-0.55495691964199064844, -1.0549569196419906484, -2.5549569196419906484, -1400.5549569196419906],
    ),
    "near_minus_700": (
        [-700.0, -700.5, -702.0, -699.25],
        [0.25914349202052236554, 0.15717847317544298582, 0.035071257891522275382, 0.54860677691251237326],
        [-1.3503733474515566018, -1.8503733474515566018, -3.3503733474515566018, -0.6003733474515566018],
    ),
    "mixed_1e3": (
        [1000.0, -1000.0, 999.0, 0.0],
        [0.73105857863000487925, 0.0, 0.26894142136999512075, 0.0],
        [-0.31326168751822283405, -2000.3132616875182228, -1.313261687518222834, -1000.3132616875182228],
    ),
    "dominant_max": (
        [20.0, 4.75, 0.0, -3.0],
        [0.99999975959931862356, 2.3823690947785265601e-7, 2.0611531269358225722e-9, 1.026187716473903464e-10],
        [-2.4040071027268430317e-7, -15.250000240400710273, -20.000000240400710273, -23.000000240400710273],
    ),
    "spread": (
        [0.1, -3.7, 12.5, 12.25, -0.5],
        [2.3153653651814187583e-6, 5.1796510348141050335e-8, 0.56217445576564503729,
         0.43782190637302521249, 1.270699454220657404e-6],
        [-12.97594305774679034, -16.775943057746790524, -0.575943057746790346,
         -0.825943057746790346, -13.575943057746790346],
    ),
}

# elastic_softmax(x, tau, beta) = exp(nvm(x)/tau) / (sum exp(nvm(x)/tau) + beta), mpmath, 50 digits.
MPMATH_ELASTIC = [
    ([-1.0, 0.0, 1.0, 2.0], 0.5, 1.0,
     [0.0, 0.015628124127437557374, 0.1154770858986877297, 0.85326666584643715555]),
    ([3.0, -2.0, 700.0, 699.0], 1.0, 0.25,
     [1.4477657263477608937e-303, 0.0, 0.73105857863000487925, 0.26894142136999512075]),
    ([1e4, 9999.0, -5.0], 1.0, 2.0, [0.73105857863000487925, 0.26894142136999512075, 0.0]),
    ([0.5, 0.25, 0.0], 0.001, 3.0, [1.0, 2.6691902155412763935e-109, 7.1245764067412855315e-218]),
]

finite_floats = st.floats(-50, 50, allow_nan=False, allow_infinity=False)


def random_array(rng, shape, low=-3.0, high=3.0):
    return rng.uniform(low, high, size=shape)


def random_shape_and_axis(rng):
    """A shape of 1 to 3 dimensions of sizes 1 to 4, and a valid axis (possibly negative)."""
    ndim = int(rng.integers(1, 4))
    return tuple(rng.integers(1, 5, size=ndim)), int(rng.integers(-ndim, ndim))


def away_from_zero(rng, shape, margin=0.05):
    """Random values with |x| >= margin, so NVM's jump at 0 stays out of finite differences."""
    x = rng.uniform(margin, 3.0, size=shape)
    return x * rng.choice([-1.0, 1.0], size=shape)


class TestSoftmax:
    @pytest.mark.parametrize("shape, axis", [((7,), 0), ((3, 5), -1), ((3, 5), 0), ((2, 3, 4), 1)])
    def test_agrees_with_scipy(self, shape, axis):
        x = random_array(np.random.default_rng(1), shape, -20, 20)
        np.testing.assert_allclose(ref.softmax(x, axis=axis), scipy.special.softmax(x, axis=axis), rtol=1e-14)

    @pytest.mark.parametrize("case", sorted(MPMATH_SOFTMAX))
    def test_mpmath_values(self, case):
        x, expected, _ = MPMATH_SOFTMAX[case]
        np.testing.assert_allclose(ref.softmax(x), expected, rtol=1e-13, atol=0)

    def test_masked_entries_and_empty_row(self):
        x = np.array([[0.0, -np.inf, 1.0], [-np.inf, -np.inf, -np.inf]])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = ref.softmax(x)
        kept = scipy.special.softmax([0.0, 1.0])
        np.testing.assert_allclose(y[0], [kept[0], 0.0, kept[1]], rtol=1e-15)
        np.testing.assert_array_equal(y[1], 0.0)

    def test_returns_float64_for_lower_precision(self):
        y = ref.softmax(np.array([1.0, 2.0], dtype=np.float32))
        assert y.dtype == np.float64

    def test_input_not_modified(self):
        x = np.array([3.0, 1.0, 2.0])
        x.setflags(write=False)
        ref.softmax(x)
        np.testing.assert_array_equal(x, [3.0, 1.0, 2.0])

    @pytest.mark.parametrize("bad", [[1, 2, 3], [1 + 0j, 2 + 0j], [True, False]])
    def test_rejects_non_real_float_dtypes(self, bad):
        with pytest.raises(TypeError, match="`x`"):
            ref.softmax(np.array(bad))

    @pytest.mark.parametrize("bad", [np.nan, np.inf])
    def test_check_finite(self, bad):
        x = np.array([1.0, bad])
        with pytest.raises(ValueError, match="`x` contains NaN or \\+inf"):
            ref.softmax(x)
        with np.errstate(invalid="ignore"):  # inf - inf: the caller opted out of the check
            assert np.isnan(ref.softmax(x, check_finite=False)).any()

    def test_empty_axis_and_bad_axis(self):
        with pytest.raises(ValueError, match="empty reduction axis"):
            ref.softmax(np.zeros((3, 0)))
        with pytest.raises(ValueError, match="`axis`"):
            ref.softmax(np.zeros(3), axis=1)
        with pytest.raises(TypeError, match="`axis`"):
            ref.softmax(np.zeros(3), axis=0.5)

    @settings(max_examples=50, deadline=None)
    @given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6), elements=finite_floats),
           st.floats(-100, 100))
    def test_properties(self, x, shift):
        y = ref.softmax(x, axis=-1)
        assert np.all((y >= 0) & (y <= 1))
        np.testing.assert_allclose(y.sum(axis=-1), 1.0, rtol=1e-14)
        np.testing.assert_allclose(ref.softmax(x + shift, axis=-1), y, rtol=1e-12, atol=1e-300)


class TestLogSoftmax:
    @pytest.mark.parametrize("shape, axis", [((7,), 0), ((3, 5), -1), ((3, 5), 0), ((2, 3, 4), 2)])
    def test_agrees_with_scipy(self, shape, axis):
        x = random_array(np.random.default_rng(2), shape, -20, 20)
        # SciPy forms log(sum exp(x - max)) without log1p, so an entry near 0 (a dominant
        # maximum) carries an absolute error of a few ulp of 1 there; elsewhere 1e-14 relative.
        np.testing.assert_allclose(ref.log_softmax(x, axis=axis), scipy.special.log_softmax(x, axis=axis),
                                   rtol=1e-14, atol=4 * np.finfo(float).eps)

    @pytest.mark.parametrize("case", sorted(MPMATH_SOFTMAX))
    def test_mpmath_values(self, case):
        x, _, expected = MPMATH_SOFTMAX[case]
        np.testing.assert_allclose(ref.log_softmax(x), expected, rtol=1e-13, atol=0)

    def test_masked_entries_and_empty_row(self):
        x = np.array([[0.0, -np.inf], [-np.inf, -np.inf]])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = ref.log_softmax(x)
        np.testing.assert_array_equal(y, [[0.0, -np.inf], [-np.inf, -np.inf]])

    def test_exp_is_softmax(self):
        x = random_array(np.random.default_rng(3), (4, 9), -30, 30)
        np.testing.assert_allclose(np.exp(ref.log_softmax(x)), ref.softmax(x), rtol=1e-13)


class TestNvm:
    def test_values(self):
        np.testing.assert_array_equal(ref.nvm([-2.0, -1e-300, 0.0, -0.0, 1e-300, 3.5]),
                                      [-np.inf, -np.inf, 0.0, 0.0, 1e-300, 3.5])

    def test_nan_stays_nan_and_shape_kept(self):
        y = ref.nvm(np.array([[np.nan, -1.0]]))
        assert y.shape == (1, 2) and np.isnan(y[0, 0]) and y[0, 1] == -np.inf


class TestElasticSoftmax:
    @pytest.mark.parametrize("x, tau, beta, expected", MPMATH_ELASTIC)
    def test_mpmath_values(self, x, tau, beta, expected):
        np.testing.assert_allclose(ref.elastic_softmax(x, tau=tau, beta=beta), expected, rtol=1e-13, atol=0)

    def test_eps_softmax(self):
        rng = np.random.default_rng(4)
        x = random_array(rng, (5, 8), -4, 4)
        eps = 1e-3
        e = np.exp(ref.nvm(x))
        expected = e / (e.sum(axis=-1, keepdims=True) + eps)
        np.testing.assert_allclose(ref.elastic_softmax(x, tau=1.0, beta=eps), expected, rtol=1e-14)

    def test_off_by_one_softmax(self):
        x = random_array(np.random.default_rng(5), (3, 6))
        e = np.exp(x)
        np.testing.assert_allclose(ref.elastic_softmax(x, nvm=False, beta=1.0), e / (1 + e.sum(-1, keepdims=True)), rtol=1e-14)

    def test_plain_softmax_when_no_nvm_no_beta(self):
        x = random_array(np.random.default_rng(6), (3, 6))
        np.testing.assert_allclose(ref.elastic_softmax(x, tau=0.7, nvm=False), ref.softmax(x / 0.7), rtol=1e-14)

    @pytest.mark.parametrize("beta", [0.0, 0.5])
    @pytest.mark.parametrize("use_nvm", [True, False])
    def test_empty_row_is_zero_without_warning(self, beta, use_nvm):
        x = np.array([[-1.0, -2.0, -0.5], [1.0, -1.0, 2.0]]) if use_nvm else np.array([[-np.inf] * 3, [1.0, -1.0, 2.0]])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = ref.elastic_softmax(x, beta=beta, nvm=use_nvm)
        np.testing.assert_array_equal(y[0], 0.0)
        assert np.isfinite(y).all() and y[1].sum() > 0

    @pytest.mark.parametrize("x, tau", [([1e4, 1e4 - 1, 3.0], 1.0), ([2.0, 1.0, 0.5], 1e-3), ([-1e4, -1e4 + 1], 1.0)])
    def test_no_overflow(self, x, tau):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for use_nvm in (True, False):
                y = ref.elastic_softmax(x, tau=tau, beta=0.5, nvm=use_nvm)
                assert np.isfinite(y).all() and 0 <= y.sum() <= 1

    def test_huge_beta_relative_to_logits(self):
        # beta * exp(-m) overflows when every logit is far below 0: the output is 0, not NaN.
        y = ref.elastic_softmax([-1000.0, -1001.0], beta=1.0, nvm=False)
        np.testing.assert_array_equal(y, 0.0)

    @pytest.mark.parametrize("name, kwargs", [
        ("tau", {"tau": 0.0}), ("tau", {"tau": -1.0}), ("tau", {"tau": np.inf}), ("tau", {"tau": np.nan}),
        ("beta", {"beta": -1e-9}), ("beta", {"beta": np.inf}), ("beta", {"beta": np.nan}),
    ])
    def test_bad_parameters(self, name, kwargs):
        with pytest.raises(ValueError, match=f"`{name}`"):
            ref.elastic_softmax([1.0, 2.0], **kwargs)

    def test_bad_parameter_types(self):
        with pytest.raises(TypeError, match="`tau`"):
            ref.elastic_softmax([1.0], tau="1")
        with pytest.raises(TypeError, match="`beta`"):
            ref.elastic_softmax([1.0], beta=True)

    @settings(max_examples=50, deadline=None)
    @given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=2, max_side=8), elements=finite_floats),
           st.floats(0.05, 10), st.floats(0, 10), st.booleans())
    def test_properties(self, x, tau, beta, use_nvm):
        y = ref.elastic_softmax(x, tau=tau, beta=beta, nvm=use_nvm)
        assert np.all((y >= 0) & (y <= 1))
        sums = y.sum(axis=-1)
        assert np.all(sums <= 1 + 1e-14)
        kept = (x >= 0).any(axis=-1) if use_nvm else np.ones(sums.shape, bool)
        if beta == 0:
            np.testing.assert_allclose(sums[kept], 1.0, rtol=1e-14)
        # monotone: more sink mass, less attention everywhere
        y_more = ref.elastic_softmax(x, tau=tau, beta=beta + 1.0, nvm=use_nvm)
        assert np.all(y_more <= y * (1 + 1e-14))
        assert np.all(y_more.sum(axis=-1) <= sums * (1 + 1e-14))

    @settings(max_examples=30, deadline=None)
    @given(hnp.arrays(np.float64, st.integers(1, 10), elements=st.floats(-20, 20)), st.floats(-5, 5),
           st.floats(0.2, 5), st.floats(0.01, 5))
    def test_shift_invariance_only_where_it_holds(self, x, shift, tau, beta):
        # Without NVM a shift c of the logits is a rescaling of beta by exp(-c/tau); it is
        # invariant exactly when beta = 0.
        shifted = ref.elastic_softmax(x + shift, tau=tau, beta=beta, nvm=False)
        rescaled = ref.elastic_softmax(x, tau=tau, beta=beta * np.exp(-shift / tau), nvm=False)
        np.testing.assert_allclose(shifted, rescaled, rtol=1e-11, atol=1e-300)
        np.testing.assert_allclose(ref.elastic_softmax(x + shift, tau=tau, nvm=False),
                                   ref.elastic_softmax(x, tau=tau, nvm=False), rtol=1e-11, atol=1e-300)

    def test_nvm_breaks_shift_invariance(self):
        x = np.array([-0.5, 1.0])
        assert ref.elastic_softmax(x)[0] == 0.0
        assert ref.elastic_softmax(x + 1.0)[0] > 0.0


class TestOnlineSoftmax:
    @settings(max_examples=25, deadline=None)
    @given(hnp.arrays(np.float64, st.integers(1, 1000), elements=st.floats(-700, 700)))
    def test_equals_softmax_for_every_block_size(self, x):
        expected = ref.softmax(x)
        for block_size in [None, *range(1, x.size + 2)]:
            np.testing.assert_allclose(ref.online_softmax(x, block_size=block_size), expected,
                                       rtol=1e-13, atol=1e-300)

    def test_axis_and_masked_rows(self):
        x = random_array(np.random.default_rng(7), (4, 6, 5), -10, 10)
        x[1, :, 2] = -np.inf
        for axis in (0, 1, -1):
            np.testing.assert_allclose(ref.online_softmax(x, block_size=2, axis=axis), ref.softmax(x, axis=axis), rtol=1e-13)
        empty = np.full((2, 3), -np.inf)
        np.testing.assert_array_equal(ref.online_softmax(empty, block_size=2), 0.0)

    def test_increasing_maximum_rescales(self):
        # each element raises the max: every step exercises the exp(m_old - m_new) rescaling
        x = np.arange(50, dtype=float) * 10
        np.testing.assert_allclose(ref.online_softmax(x), ref.softmax(x), rtol=1e-13, atol=1e-300)

    @pytest.mark.parametrize("block_size", [0, -1])
    def test_bad_block_size(self, block_size):
        with pytest.raises(ValueError, match="`block_size`"):
            ref.online_softmax([1.0], block_size=block_size)
        with pytest.raises(TypeError, match="`block_size`"):
            ref.online_softmax([1.0], block_size=1.5)


class TestSoftmaxVjp:
    @pytest.mark.parametrize("seed", range(4))
    def test_gradcheck(self, seed):
        rng = np.random.default_rng(seed)
        shape, axis = random_shape_and_axis(rng)
        x = random_array(rng, shape)
        dy = random_array(rng, shape)
        dx = ref.softmax_vjp(ref.softmax(x, axis=axis), dy, axis=axis)
        gradcheck(lambda x: ref.softmax(x, axis=axis), {"x": x}, {"x": dx}, dout=dy)

    def test_shape_mismatch(self):
        with pytest.raises(ValueError, match="`dy`"):
            ref.softmax_vjp(np.ones(3) / 3, np.ones(2))


class TestElasticSoftmaxVjp:
    @pytest.mark.parametrize("seed", range(8))
    def test_gradcheck(self, seed):
        rng = np.random.default_rng(seed)
        shape, axis = random_shape_and_axis(rng)
        use_nvm = bool(seed % 2)
        tau = float(rng.uniform(0.3, 3.0))
        beta = float(rng.uniform(0.1, 3.0))
        x = away_from_zero(rng, shape)
        dy = random_array(rng, shape)
        dx, dtau, dbeta = ref.elastic_softmax_vjp(x, dy, tau=tau, beta=beta, axis=axis, nvm=use_nvm)
        gradcheck(
            lambda x, tau, beta: ref.elastic_softmax(x, tau=tau, beta=beta, axis=axis, nvm=use_nvm),
            {"x": x, "tau": tau, "beta": beta},
            {"x": dx, "tau": dtau, "beta": dbeta},
            dout=dy,
        )

    @pytest.mark.parametrize("use_nvm", [True, False])
    def test_gradcheck_at_beta_zero(self, use_nvm):
        # beta = 0 is the edge of the domain: central differences for x and tau, a one-sided
        # difference (error O(h)) for beta.
        rng = np.random.default_rng(11)
        x, dy = away_from_zero(rng, (3, 5)), random_array(rng, (3, 5))
        dx, dtau, dbeta = ref.elastic_softmax_vjp(x, dy, tau=0.8, beta=0.0, nvm=use_nvm)
        gradcheck(lambda x, tau: ref.elastic_softmax(x, tau=tau, nvm=use_nvm),
                  {"x": x, "tau": 0.8}, {"x": dx, "tau": dtau}, dout=dy)
        h = 1e-7
        loss = lambda beta: np.sum(dy * ref.elastic_softmax(x, tau=0.8, beta=beta, nvm=use_nvm))
        np.testing.assert_allclose(dbeta, (loss(h) - loss(0.0)) / h, rtol=1e-5)

    def test_empty_row_gradients_are_finite(self):
        x = np.array([[-1.0, -2.0], [0.5, 1.0]])
        dy = np.ones_like(x)
        for beta in (0.0, 1.0):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                dx, dtau, dbeta = ref.elastic_softmax_vjp(x, dy, beta=beta)
            assert np.isfinite(dx).all() and np.isfinite(dtau) and np.isfinite(dbeta)
            np.testing.assert_array_equal(dx[0], 0.0)

    def test_returns_python_floats(self):
        dx, dtau, dbeta = ref.elastic_softmax_vjp([1.0, 2.0], [1.0, 0.0], tau=2.0, beta=0.5)
        assert isinstance(dtau, float) and isinstance(dbeta, float) and dx.dtype == np.float64
