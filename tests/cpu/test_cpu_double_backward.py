"""The CPU kernels' double backward against the float64 oracle, `reference.attention_double_backward`.

Accuracy: float64 within ``1e-12 * max(1, max|oracle|)`` of every output.
float32 within the conformance kit's rule (`_tolerances.kit_allowed`):
twice the worst error of the naive float32 evaluation plus a rounding
allowance, and at least ``1e-5`` of the scale. The naive evaluation is the
oracle's own ``_double_backward`` run on float32 arrays (it is generic in
dtype), in four summation orders (`_tolerances.naive_double_backward`). The
allowance (`_tolerances.double_backward_rounding`) is `rounding_allowance`'s
for the double backward's terms, ``2 eps`` times the sum of the magnitudes of
the terms of each output: what no reordering of a naive evaluation samples,
the logits' rounding and the sums that cancel (the tangents of ``dtau``,
``dbeta``, ``dsigma``, a broadcast ``dbias``, and ``ddout``, which the
kernels take as ``sum p zdot v - lsedot sum p v + sum p vdot``). The first
derivatives' rule (`float32_allowed`) caps the bound at ``1e-5`` of the
scale; here the naive float32 evaluation alone exceeds that on ``dtau`` in
some cases, so the kit's floor takes its place.

The ``small_tiles`` fixture (8 queries x 5 keys) spreads every problem over
several tiles and threads.
"""

import numba
import numpy as np
import pytest

import elastic_np as enp
from elastic_np import cpu
from elastic_np._api import dispatch
from elastic_np._contract._problem import prepare
from elastic_np.testing import _tolerances
from oracle_checks import ALIBI_H, CASES, DTYPES, SIGMA_BH, assert_matches_oracle, make_dlse, make_inputs
from window_edges import faint_gate_inputs

#: The double backward's outputs, as `DoubleBackwardGrads` names them.
FIELDS = ("ddout", "ddlse", "dq", "dk", "dv", "dtau", "dbeta", "dsigma", "dbias")

#: Cases beyond `CASES`: the kv_lengths alignment, with the options that read it.
MORE_CASES = {
    "align-kv-lengths": dict(kv_lengths=[17, 31], align="kv_lengths", causal=True, beta=0.3),
    "align-gate-alibi": dict(
        kv_lengths=[12, 29], align="kv_lengths", alibi_slopes=ALIBI_H, softcap=1.2,
        dynamic_window=enp.DynamicWindow(SIGMA_BH, sharpness=2.0, threshold=0.05),
    ),
}


def cotangents(q, k, v, opts, dtype, seed=0):
    """Seeded standard normal cotangents ``ddq .. ddbias`` in ``dtype``, in the shapes the options give."""
    p = prepare(*(a.astype(np.float64) for a in (q, k, v)), **opts)
    rng = np.random.default_rng(seed + 300)
    shapes = {"ddq": q.shape, "ddk": k.shape, "ddv": v.shape, "ddtau": p.tau_shape, "ddbeta": p.beta_shape,
              "ddsigma": p.sigma_shape, "ddbias": p.bias_shape}
    return {name: None if shape is None else rng.standard_normal(shape).astype(dtype) for name, shape in shapes.items()}


def double_backward(q, k, v, dout, u, opts, dlse=None, backend="cpu"):
    """The forward, then the double backward, both on ``backend``."""
    out, lse = enp.attention(q, k, v, return_lse=True, backend=backend, **opts)
    return enp.attention_double_backward(u["ddq"], u["ddk"], u["ddv"], dout, q, k, v, out, lse, ddtau=u["ddtau"],
                                         ddbeta=u["ddbeta"], ddsigma=u["ddsigma"], ddbias=u["ddbias"], dlse=dlse,
                                         backend=backend, **opts)


def check_case(dtype, opts, with_lse=True, seed=0, **shape):
    """Every output of the CPU double backward against the oracle (`assert_close`); returns the result."""
    q, k, v, dout = make_inputs(dtype, seed=seed, **shape)
    dlse = make_dlse(dtype, q, seed) if with_lse else None
    return check_outputs(q, k, v, dout, cotangents(q, k, v, opts, dtype, seed), opts, dtype, dlse)


def check_outputs(q, k, v, dout, u, opts, dtype, dlse=None):
    """`check_case` on given inputs and cotangents ``u``, all in ``dtype``; returns the result."""
    got = double_backward(q, k, v, dout, u, opts, dlse)
    wide = [a.astype(np.float64) for a in (q, k, v, dout)]
    wide_u = {name: None if a is None else a.astype(np.float64) for name, a in u.items()}
    wide_lse = None if dlse is None else dlse.astype(np.float64)
    want = double_backward(*wide, wide_u, opts, wide_lse, backend="reference")
    naive, rounding = {}, {}
    if dtype == np.float32:
        args = (q, k, v, dout, tuple(wide_u.values()), opts)
        orderings = _tolerances.naive_double_backward(*args, dlse=dlse)
        naive = {name: [n[name] for n in orderings] for name in FIELDS}
        rounding = _tolerances.double_backward_rounding(*args, dlse=wide_lse)
    for name in FIELDS:
        result, oracle = getattr(got, name), getattr(want, name)
        if oracle is None:
            assert result is None, name
            continue
        if np.shape(oracle) == ():
            assert isinstance(result, float), f"{name} should be a Python float"
        assert_close(name, result, oracle, dtype, naive.get(name), rounding.get(name, 0.0))
    return got


def assert_close(name, result, oracle, dtype, naive, rounding):
    """float64: the ``1e-12`` rule of `assert_matches_oracle`; float32: `kit_allowed`'s, printing the worst difference."""
    if dtype == np.float64:
        assert_matches_oracle(name, result, oracle, dtype)
        return
    if name in ("ddout", "ddlse", "dq", "dk", "dv", "dbias"):
        assert result.dtype == dtype, f"{name}: dtype {result.dtype} != {np.dtype(dtype)}"
    result, oracle = np.asarray(result, dtype=np.float64), np.asarray(oracle, dtype=np.float64)
    assert result.shape == oracle.shape, f"{name}: shape {result.shape} != {oracle.shape}"
    np.testing.assert_array_equal(np.isneginf(result), np.isneginf(oracle), err_msg=f"{name}: -inf entries differ")
    finite = ~np.isneginf(oracle)
    assert np.isfinite(result[finite]).all(), f"{name}: NaN or inf"
    err = float(np.abs(result[finite] - oracle[finite]).max(initial=0.0))
    bound, naive_err = _tolerances.kit_allowed(oracle, naive, dtype, rounding)
    print(f"{name}: worst |diff| {err:.3e}, naive float32 {naive_err:.3e} (bound {bound:.1e})")
    assert err <= bound, f"{name}: worst |diff| {err:.3e} > {bound:.3e} (naive {naive_err:.3e})"


class TestAgainstOracle:
    @pytest.mark.parametrize("case", sorted(CASES) + sorted(MORE_CASES))
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_options(self, small_tiles, dtype, case):
        check_case(dtype, {**CASES, **MORE_CASES}[case])

    @pytest.mark.parametrize("case", ["plain", "elastic", "modifiers-everything"])
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_without_dlse(self, small_tiles, dtype, case):
        check_case(dtype, CASES[case], with_lse=False)

    @pytest.mark.parametrize("shape", [
        dict(H=3, Hkv=3, N=19, M=11, D=5, Dv=7),  # no groups, N > M: causal rows with no key
        dict(H=4, Hkv=1, N=1, M=31),  # one query, four heads on one kv head
        dict(N=23, M=1), dict(N=1, M=1), dict(N=9, M=40, D=16, Dv=3),
    ])
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_sizes_and_heads(self, small_tiles, dtype, shape):
        heads = shape.get("H", 4)
        check_case(dtype, dict(causal=True, beta=0.4, tau=0.8), **shape)
        check_case(dtype, dict(softcap=1.1, alibi_slopes=np.linspace(0.1, 0.4, heads), tau=np.linspace(0.6, 1.2, heads),
                               bias=np.random.default_rng(3).standard_normal(shape.get("M", 31))), **shape)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_rows_with_nothing_kept(self, small_tiles, dtype):
        # batch entry 0 keeps no key: lse = -inf where beta = 0 (heads 0 and 2), log beta elsewhere
        for opts in (dict(kv_lengths=[0, 31], beta=[0.0, 0.3, 0.0, 2.0]), dict(kv_lengths=[0, 31], beta=0.0),
                     dict(mask=np.zeros((23, 31), bool), beta=0.5), dict(causal=True, N=40, M=20, beta=0.2)):
            shape = {key: opts.pop(key) for key in ("N", "M") if key in opts}
            got = check_case(dtype, opts, **shape)
            assert np.isfinite(got.ddlse).all() and np.isfinite(got.dbeta).all()

    @pytest.mark.parametrize("B, N, M", [(0, 23, 31), (1, 3, 0), (1, 0, 3)])
    def test_empty_dimensions(self, small_tiles, B, N, M):
        opts = dict(beta=0.5, softcap=2.0, bias=np.ones((N, M)), dynamic_window=enp.DynamicWindow(0.5))
        got = check_case(np.float64, opts, B=B, N=N, M=M)
        assert got.ddout.shape == (B, 4, N, 6) and got.dq.shape == (B, 4, N, 8) and got.dk.shape == (B, 2, M, 8)


class TestKernel:
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_layouts_give_the_same_bits(self, small_tiles, dtype):
        opts = dict(CASES["modifiers-everything"])
        q, k, v, dout = make_inputs(dtype)
        u = cotangents(q, k, v, opts, dtype)
        dlse = make_dlse(dtype, q)
        want = double_backward(q, k, v, dout, u, opts, dlse)
        t = lambda a: None if a is None else np.ascontiguousarray(np.swapaxes(a, 1, 2))
        given = {name: t(a) if name in ("ddq", "ddk", "ddv") else a for name, a in u.items()}
        got = double_backward(t(q), t(k), t(v), t(dout), given, dict(opts, layout="bnhd"), dlse)
        for name, a, b in zip(FIELDS, got, want):
            if name in ("ddout", "dq", "dk", "dv"):
                assert a.flags.c_contiguous, name  # (B, N, H, D), as given
                a = np.swapaxes(a, 1, 2)
            np.testing.assert_array_equal(a, b, err_msg=name)

    @pytest.mark.parametrize("case", ["modifiers-everything", "bias-1h1m-keypad", "bias-bhn1", "bias-scalar"])
    def test_same_bits_for_every_thread_count_and_inputs_left_alone(self, small_tiles, monkeypatch, case):
        opts = CASES[case]
        q, k, v, dout = make_inputs(np.float32)
        u = cotangents(q, k, v, opts, np.float32)
        dlse = make_dlse(np.float32, q)
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
        inputs = [q, k, v, dout, out, lse, dlse, *(a for a in u.values() if a is not None)]
        copies = [a.copy() for a in inputs]

        def run():
            return enp.attention_double_backward(
                u["ddq"], u["ddk"], u["ddv"], dout, q, k, v, out, lse, ddtau=u["ddtau"], ddbeta=u["ddbeta"],
                ddsigma=u["ddsigma"], ddbias=u["ddbias"], dlse=dlse, backend="cpu", **opts)

        first = run()
        monkeypatch.setattr(cpu._runtime.config, "DQ_SHARES_BYTES", 1)  # the key tiles one chunk at a time
        chunked = run()
        threads = numba.get_num_threads()
        try:
            numba.set_num_threads(1)
            single = run()
        finally:
            numba.set_num_threads(threads)
        for a, b in zip(inputs, copies):
            np.testing.assert_array_equal(a, b)
        for name, a, b, c in zip(FIELDS, first, chunked, single):
            np.testing.assert_array_equal(a, b, err_msg=name)
            np.testing.assert_array_equal(a, c, err_msg=name)

    @pytest.mark.parametrize("name", ["float16", "bfloat16"])
    def test_halves_are_the_float32_kernels_rounded(self, small_tiles, name):
        if name == "bfloat16":
            dtype = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
        else:
            dtype = np.dtype(np.float16)
        opts = dict(causal=True, softcap=1.5, bias=np.random.default_rng(4).standard_normal((23, 31)), beta=0.3)
        q, k, v, dout = (a.astype(dtype) for a in make_inputs(np.float32))
        u = cotangents(q, k, v, opts, np.float32)
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
        half = enp.attention_double_backward(u["ddq"], u["ddk"], u["ddv"], dout, q, k, v, out, lse, ddtau=u["ddtau"],
                                             ddbeta=u["ddbeta"], ddbias=u["ddbias"], backend="cpu", **opts)
        wide = [a.astype(np.float32) for a in (q, k, v, dout, out)]
        single = enp.attention_double_backward(u["ddq"], u["ddk"], u["ddv"], wide[3], *wide[:3], wide[4], lse,
                                               ddtau=u["ddtau"], ddbeta=u["ddbeta"], ddbias=u["ddbias"],
                                               backend="cpu", **opts)
        for field, a, b in zip(FIELDS, half, single):
            if field in ("ddout", "dq", "dk", "dv", "dbias"):
                assert a.dtype == dtype, field
                b = b.astype(dtype)
            np.testing.assert_array_equal(a, b, err_msg=field)


def test_auto_is_the_cpu_kernels_without_a_gpu():
    if dispatch.cuda_is_available():
        pytest.skip("auto picks the CUDA backend here")
    q, k, v, dout = make_inputs(np.float64, N=9, M=12)
    u = cotangents(q, k, v, {"tau": 0.8}, np.float64)
    auto = double_backward(q, k, v, dout, u, {"tau": 0.8}, backend="auto")
    kernels = double_backward(q, k, v, dout, u, {"tau": 0.8})
    for name, a, b in zip(FIELDS, auto, kernels):
        np.testing.assert_array_equal(a, b, err_msg=name)


# --- s / tau beside a large log G, as the backward's (tests/cpu/test_hardening_window.py) -------------

#: Along ``tau`` alone every output is a sum of terms in ``s / tau``; along every cotangent the
#: gate's ``sigmadot d log G / d sigma`` dominates all but ``dtau``.
ALONG = {"tau": ("ddtau",), "every": ("ddq", "ddk", "ddv", "ddtau", "ddbeta", "ddsigma")}


def faint_gate_case(scale, along, dtype):
    """`faint_gate_inputs` in ``dtype`` and its `cotangents` of the names ``along`` (None elsewhere).

    ``ddk`` is scaled as ``k`` is (1e-3), so that ``sdot`` is as small as ``s``.
    """
    q, k, v, dout, opts = faint_gate_inputs(scale)
    u = cotangents(q, k, v, opts, np.float32)
    u["ddk"] *= np.float32(1e-3)
    u = {name: a.astype(dtype) if name in along else None for name, a in u.items()}
    return (*(a.astype(dtype) for a in (q, k, v, dout)), u, opts)


@pytest.mark.parametrize("along", sorted(ALONG))
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_scores_under_a_faint_gate_within_the_kits_rule(small_tiles, dtype, along):
    # log G near -8 and s / tau near 1e-3: z - log G holds s / tau only to eps |log G|
    q, k, v, dout, u, opts = faint_gate_case(1.0, ALONG[along], dtype)
    check_outputs(q, k, v, dout, u, opts, dtype)


@pytest.mark.parametrize("backend, dtype", [("reference", np.float64), ("cpu", np.float64), ("cpu", np.float32)])
def test_zero_scores_under_a_gate_give_exact_zeros(small_tiles, backend, dtype):
    # scale = 0: every s and sdot is 0, and so is dtau's tangent; along tau alone zdot = -s taudot / tau^2
    # is 0 too, and with it every output
    got = double_backward(*faint_gate_case(0.0, ALONG["every"], dtype), backend=backend)
    np.testing.assert_array_equal(got.dtau, 0.0)
    assert np.all(got.dsigma != 0.0)
    got = double_backward(*faint_gate_case(0.0, ALONG["tau"], dtype), backend=backend)
    for name in FIELDS[:-1]:
        np.testing.assert_array_equal(getattr(got, name), 0.0, err_msg=name)
