"""The cotangent of ``lse`` (``dlse``) in every host backend, held to the float64 oracle.

The oracle's ``dlse`` gradients are checked against finite differences in
``test_reference_attention.py``; here the CPU kernels (prefill and
decode-shaped problems), the Dask graphs and the dispatch are held to the
oracle with a random ``dlse``, and ``dlse=None`` to zeros, bit for bit.
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import reference as ref
from oracle_checks import CASES, DTYPES, check_case, check_results, decode_cases, make_dlse, make_inputs

GRAD_FIELDS = ("dq", "dk", "dv", "dtau", "dbeta", "dsigma", "dbias")

#: The option mix of the kernels' cases, and rows a batch's kv_lengths of 0
#: empties (lse = -inf where beta = 0, log(beta) elsewhere).
CPU_CASES = {
    name: CASES[name] for name in (
        "plain", "causal", "window", "kv-lengths", "mask-b1nm", "nvm", "tau-beta-scalar",
        "tau-beta-per-head", "elastic", "window-gate", "window-gate-zero-threshold", "everything",
        "softcap-tau-beta", "alibi-bh", "bias-full", "bias-1h1m-keypad", "bias-b1n1", "bias-scalar",
        "modifiers-everything",
    )
}
CPU_CASES["empty-rows"] = dict(kv_lengths=[0, 31], causal=True, beta=[0.0, 0.3, 0.0, 1.5])
CPU_CASES["empty-rows-beta-0"] = dict(kv_lengths=[0, 25], nvm=True, tau=0.7)


def _run(backend, q, k, v, dout, opts, dlse):
    out, lse = enp.attention(q, k, v, return_lse=True, backend=backend, **opts)
    return enp.attention_backward(dout, q, k, v, out, lse, dlse=dlse, backend=backend, **opts)


def _assert_same_bits(a, b):
    for field in GRAD_FIELDS:
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), field
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=field)
            assert np.asarray(x).dtype == np.asarray(y).dtype, field


class TestCpu:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("case", list(CPU_CASES))
    def test_matches_the_oracle(self, small_tiles, dtype, case):
        check_case(dtype, CPU_CASES[case], with_lse=True)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_multi_query(self, small_tiles, dtype):
        check_case(dtype, dict(window_size=(3, 7), beta=1.0, nvm=True), H=4, Hkv=1, with_lse=True)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("N", [1, 7])
    @pytest.mark.parametrize("case", ["plain", "kv-lengths", "nvm-tau-beta", "bias", "everything"])
    def test_decode_shapes(self, decode_tiles, dtype, N, case):
        check_case(dtype, decode_cases(2, 8, N, 23)[case], B=2, H=8, Hkv=2, N=N, M=23, D=8, Dv=6,
                   with_lse=True)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_decode_aligned_to_kv_lengths(self, decode_tiles, dtype):
        opts = dict(kv_lengths=[23, 9], align="kv_lengths", causal=True, beta=[0.0, 0.5, 1.0, 0.2])
        check_case(dtype, opts, B=2, H=4, Hkv=2, N=3, M=23, with_lse=True)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("case", ["everything", "modifiers-everything", "empty-rows"])
    def test_no_dlse_is_zero_dlse_bit_for_bit(self, small_tiles, dtype, case):
        q, k, v, dout = make_inputs(dtype)
        zeros = np.zeros(q.shape[:3], dtype=dtype)
        _assert_same_bits(_run("cpu", q, k, v, dout, CPU_CASES[case], None),
                          _run("cpu", q, k, v, dout, CPU_CASES[case], zeros))

    def test_inputs_are_left_alone(self, small_tiles):
        q, k, v, dout = make_inputs(np.float32)
        dlse = make_dlse(np.float32, q)
        opts = CPU_CASES["everything"]
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
        arrays = (q, k, v, dout, out, lse, dlse)
        copies = [a.copy() for a in arrays]
        enp.attention_backward(dout, q, k, v, out, lse, dlse=dlse, backend="cpu", **opts)
        for a, c in zip(arrays, copies):
            np.testing.assert_array_equal(a, c)

    def test_lse_alone_is_the_lse_gradient(self, small_tiles):
        # dout = 0: only lse carries the loss. dv = 0, and the rest matches the oracle.
        q, k, v, _ = make_inputs(np.float64)
        dout = np.zeros((2, 4, 23, 6))
        dlse = make_dlse(np.float64, q)
        opts = CPU_CASES["everything"]
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
        grads = enp.attention_backward(dout, q, k, v, out, lse, dlse=dlse, backend="cpu", **opts)
        np.testing.assert_array_equal(grads.dv, 0.0)
        assert np.abs(grads.dq).max() > 0 and grads.dbeta.any()
        check_results(np.float64, q, k, v, dout, opts, out, lse, grads, dlse=dlse)


class TestValidation:
    @pytest.mark.parametrize("backend", ["reference", "cpu"])
    @pytest.mark.parametrize("bad, error, match", [
        (lambda lse: lse[..., :2], ValueError, "`dlse` must have shape"),
        (lambda lse: lse[..., None], ValueError, "`dlse` must have shape"),
        (lambda lse: np.where(lse > lse.mean(), np.nan, lse), ValueError, "`dlse` contains NaN or inf"),
        (lambda lse: np.full_like(lse, np.inf), ValueError, "`dlse` contains NaN or inf"),
        (lambda lse: np.full_like(lse, -np.inf), ValueError, "`dlse` contains NaN or inf"),
        (lambda lse: np.ones(lse.shape, dtype=int), TypeError, "`dlse` must be a real floating-point"),
        (lambda lse: lse.astype(complex), TypeError, "`dlse` must be a real floating-point"),
        ("list", ValueError, "`dlse` must have shape"),
    ])
    def test_bad_dlse(self, backend, bad, error, match):
        q, k, v, dout = make_inputs(np.float64, N=5, M=7)
        out, lse = enp.attention(q, k, v, return_lse=True, backend=backend)
        dlse = [0.0, 1.0] if bad == "list" else bad(lse)
        with pytest.raises(error, match=match):
            enp.attention_backward(dout, q, k, v, out, lse, dlse=dlse, backend=backend)

    def test_kernels_take_dlse_in_the_dtype_of_q(self):
        q, k, v, dout = make_inputs(np.float32, N=5, M=7)
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu")
        with pytest.raises(TypeError, match="`dlse` has dtype float64, expected float32"):
            enp.attention_backward(dout, q, k, v, out, lse, dlse=lse.astype(np.float64), backend="cpu")

    def test_reference_casts_dlse_and_leaves_it_alone(self):
        q, k, v, dout = make_inputs(np.float64, N=5, M=7)
        out, lse = ref.attention(q, k, v, beta=0.5)
        dlse = make_dlse(np.float32, q)
        copy = dlse.copy()
        g32 = ref.attention_backward(dout, q, k, v, out, lse, dlse=dlse, beta=0.5)
        g64 = ref.attention_backward(dout, q, k, v, out, lse, dlse=dlse.astype(np.float64), beta=0.5)
        np.testing.assert_array_equal(dlse, copy)
        _assert_same_bits(g32, g64)
        assert g32.dq.dtype == np.float64

    def test_dispatch_to_the_reference_is_the_oracle(self):
        q, k, v, dout = make_inputs(np.float64, N=5, M=7)
        dlse = make_dlse(np.float64, q)
        opts = dict(causal=True, beta=0.4, tau=0.8)
        out, lse = ref.attention(q, k, v, **opts)
        _assert_same_bits(enp.attention_backward(dout, q, k, v, out, lse, dlse=dlse, backend="reference", **opts),
                          ref.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **opts))
