"""elastic_np.jax: a custom VJP over the kernels, against check_grads and the NumPy entry points.

Second derivatives (reverse over reverse) run on the reference backend, and
on the CPU backend where it has a double backward.

float64 needs ``jax_enable_x64``; the `x64` fixture sets it for one test and
restores it, so that no other test module sees it changed.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import double_backward_cases as second  # noqa: E402
from adapter_cases import CASES, LEARNED, make_case, numpy_options  # noqa: E402
import elastic_np as enp  # noqa: E402
import elastic_np.jax as enpj  # noqa: E402
from elastic_np._api import dispatch  # noqa: E402



@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def jax_call(arrays, fixed, **extra):
    fixed = dict(fixed)
    window = enpj.DynamicWindow(arrays["sigma"], fixed.pop("sharpness"), fixed.pop("threshold"))
    return enpj.attention(arrays["q"], arrays["k"], arrays["v"], tau=arrays["tau"],
                          beta=arrays["beta"], bias=arrays["bias"], dynamic_window=window,
                          **fixed, **extra)


class TestCheckGrads:
    @pytest.mark.parametrize("case", CASES)
    def test_every_input_together(self, x64, case):
        arrays, fixed = make_case(case)

        def f(*values):
            return jax_call(dict(zip(LEARNED, values)), fixed)

        check_grads(f, tuple(jnp.asarray(arrays[n]) for n in LEARNED), order=1, modes=["rev"])

    @pytest.mark.parametrize("case", CASES)
    @pytest.mark.parametrize("name", LEARNED)
    def test_each_input_alone(self, x64, case, name):
        arrays, fixed = make_case(case, seed=1)
        # the others are NumPy constants: no gradient is asked of them
        check_grads(lambda x: jax_call({**arrays, name: x}, fixed), (jnp.asarray(arrays[name]),),
                    order=1, modes=["rev"])

    @pytest.mark.parametrize("case", CASES)
    def test_out_and_lse_together(self, x64, case):
        arrays, fixed = make_case(case, seed=3)

        def f(*values):
            return jax_call(dict(zip(LEARNED, values)), fixed, return_lse=True)

        check_grads(f, tuple(jnp.asarray(arrays[n]) for n in LEARNED), order=1, modes=["rev"])

    @pytest.mark.parametrize("case", CASES)
    def test_lse_alone(self, x64, case):
        arrays, fixed = make_case(case, seed=4)

        def f(*values):
            return jax_call(dict(zip(LEARNED, values)), fixed, return_lse=True)[1]

        check_grads(f, tuple(jnp.asarray(arrays[n]) for n in LEARNED), order=1, modes=["rev"])

    def test_under_jit_the_gradients_are_the_same(self, x64):
        arrays, fixed = make_case(CASES[1], seed=2)
        args = tuple(jnp.asarray(arrays[n]) for n in LEARNED)

        def loss(*values):
            return jnp.sum(jax_call(dict(zip(LEARNED, values)), fixed) ** 2)

        grad = jax.grad(loss, argnums=tuple(range(len(LEARNED))))
        for eager, jitted in zip(grad(*args), jax.jit(grad)(*args)):
            np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))

    def test_against_the_reference_backend(self, x64):
        arrays, fixed = make_case(CASES[0], seed=3)
        args = tuple(jnp.asarray(arrays[n]) for n in LEARNED)

        def grads(backend):
            def loss(*values):
                return jnp.sum(jax_call(dict(zip(LEARNED, values)), fixed, backend=backend) ** 2)
            return jax.grad(loss, argnums=tuple(range(len(LEARNED))))(*args)

        for name, got, want in zip(LEARNED, grads("cpu"), grads("reference")):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=name)


#: Every backend with a double backward.
DOUBLE_BACKENDS = ["reference", "cpu"]


class TestSecondDerivatives:
    @pytest.mark.parametrize("backend", DOUBLE_BACKENDS)
    @pytest.mark.parametrize("case", second.CASES)
    def test_every_input_together(self, x64, case, backend):
        arrays, fixed = second.make_case(case)

        def f(*values):
            return jax_call(dict(zip(LEARNED, values)), fixed, return_lse=True, backend=backend)

        check_grads(f, tuple(jnp.asarray(arrays[n]) for n in LEARNED), order=2, modes=["rev"])

    @pytest.mark.parametrize("name", LEARNED[3:])
    def test_each_parameter_alone(self, x64, name):
        arrays, fixed = second.make_case(second.CASES[0], seed=1)
        check_grads(lambda x: jax_call({**arrays, name: x}, fixed, backend="reference"),
                    (jnp.asarray(arrays[name]),), order=2, modes=["rev"])

    def test_a_wrong_second_derivative_fails(self, x64, monkeypatch):
        """The check sees the double backward: one 1% off in dq fails it."""
        double_backward = dispatch.attention_double_backward
        monkeypatch.setattr(dispatch, "attention_double_backward",
                            lambda *a, **kw: (lambda g: g._replace(dq=g.dq * 1.01))(double_backward(*a, **kw)))
        arrays, fixed = second.make_case(second.CASES[0], seed=2)
        with pytest.raises(AssertionError, match="VJP of VJP"):
            check_grads(lambda q: jax_call({**arrays, "q": q}, fixed, backend="reference"),
                        (jnp.asarray(arrays["q"]),), order=2, modes=["rev"])

    @pytest.mark.parametrize("case", second.CASES)
    def test_hessian_vector_product_is_the_double_backward(self, x64, case):
        """The VJP of the gradient, under jit, gives `elastic_np.attention_double_backward` for every input."""
        arrays, fixed = second.make_case(case, seed=3)
        rng = np.random.default_rng(4)
        options = second.numpy_options(arrays, fixed)
        out, lse = enp.attention(arrays["q"], arrays["k"], arrays["v"], return_lse=True, backend="reference",
                                 **options)
        dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
        u = {name: rng.standard_normal(np.shape(a)) for name, a in arrays.items()}
        want = enp.attention_double_backward(
            u["q"], u["k"], u["v"], dout, arrays["q"], arrays["k"], arrays["v"], out, lse, dlse=dlse,
            backend="reference", **{"dd" + n: u[n] for n in LEARNED[3:]}, **options)

        def loss(values, dout, dlse):
            out, lse = jax_call(values, fixed, return_lse=True, backend="reference")
            return jnp.sum(dout * out) + jnp.sum(dlse * lse)

        def gradient(values, dout, dlse):
            return jax.grad(loss)(values, dout, dlse)

        args = ({n: jnp.asarray(a) for n, a in arrays.items()}, jnp.asarray(dout), jnp.asarray(dlse))
        _, vjp = jax.vjp(jax.jit(gradient), *args)
        got, ddout, ddlse = vjp({n: jnp.asarray(a) for n, a in u.items()})
        np.testing.assert_allclose(ddout, want.ddout, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(ddlse, want.ddlse, rtol=1e-12, atol=1e-12)
        for name in LEARNED:
            np.testing.assert_allclose(got[name], getattr(want, "d" + name), rtol=1e-12, atol=1e-12, err_msg=name)


class TestFloat32:
    @pytest.mark.parametrize("case", CASES)
    def test_forward_and_gradients_are_the_numpy_entry_points_bits(self, case):
        arrays, fixed = make_case(case, dtype=np.float32)
        args = {n: jnp.asarray(a) for n, a in arrays.items()}
        (out, lse), vjp = jax.vjp(lambda a: jax_call(a, fixed, return_lse=True), args)
        dout = np.random.default_rng(5).standard_normal(out.shape).astype(np.float32)
        (got,) = vjp((jnp.asarray(dout), jnp.zeros_like(lse)))

        options = numpy_options(arrays, fixed)
        want_out, want_lse = enp.attention(arrays["q"], arrays["k"], arrays["v"], return_lse=True,
                                           backend="cpu", **options)
        grads = enp.attention_backward(dout, arrays["q"], arrays["k"], arrays["v"], want_out,
                                       want_lse, backend="cpu", **options)
        np.testing.assert_array_equal(np.asarray(out), want_out)
        np.testing.assert_array_equal(np.asarray(lse), want_lse)
        for name in LEARNED:
            assert got[name].dtype == jnp.float32 and got[name].shape == arrays[name].shape, name
            want = np.asarray(getattr(grads, "d" + name), dtype=np.float32).reshape(arrays[name].shape)
            np.testing.assert_array_equal(np.asarray(got[name]), want, err_msg=name)

    def test_lse_gradients_are_the_numpy_entry_points_bits(self):
        arrays, fixed = make_case(CASES[1], dtype=np.float32)
        args = {n: jnp.asarray(a) for n, a in arrays.items()}
        (out, lse), vjp = jax.vjp(lambda a: jax_call(a, fixed, return_lse=True), args)
        rng = np.random.default_rng(6)
        dout = rng.standard_normal(out.shape).astype(np.float32)
        dlse = rng.standard_normal(lse.shape).astype(np.float32)
        (got,) = vjp((jnp.asarray(dout), jnp.asarray(dlse)))

        options = numpy_options(arrays, fixed)
        grads = enp.attention_backward(dout, arrays["q"], arrays["k"], arrays["v"], np.asarray(out),
                                       np.asarray(lse), dlse=dlse, backend="cpu", **options)
        for name in LEARNED:
            want = np.asarray(getattr(grads, "d" + name), dtype=np.float32).reshape(arrays[name].shape)
            np.testing.assert_array_equal(np.asarray(got[name]), want, err_msg=name)

    def test_training_step_gives_finite_gradients(self):
        arrays, fixed = make_case(CASES[0], dtype=np.float32)
        params = {"raw_tau": jnp.zeros(4), "log_beta": jnp.zeros(4), "log_sigma": jnp.zeros(4)}

        @jax.jit
        def loss(params):
            learned = dict(arrays, tau=jax.nn.softplus(params["raw_tau"]),
                           beta=jnp.exp(params["log_beta"]), sigma=jnp.exp(params["log_sigma"]))
            return jnp.mean(jax_call(learned, fixed) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        assert np.isfinite(value)
        for name, g in grads.items():
            assert np.isfinite(g).all() and np.abs(g).sum() > 0, name
        stepped = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
        assert loss(stepped) < value

    def test_lse_gradient_and_the_forward_runs_once(self, monkeypatch):
        calls = []
        real = dispatch.attention
        monkeypatch.setattr(dispatch, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 2, 6, 4))
        (out, lse), vjp = jax.vjp(lambda q: enpj.attention(q, k, v, return_lse=True), q)
        (dq,) = vjp((jnp.zeros_like(out), jnp.ones_like(lse)))
        assert len(calls) == 1
        qn, kn, vn = (np.asarray(x) for x in (q, k, v))
        want = enp.attention_backward(np.zeros(out.shape, np.float32), qn, kn, vn, np.asarray(out),
                                      np.asarray(lse), dlse=np.ones(lse.shape, np.float32), backend="cpu")
        np.testing.assert_array_equal(np.asarray(dq), want.dq)
        assert np.abs(want.dq).max() > 0

    def test_vmap_maps_over_a_leading_axis(self):
        arrays, fixed = make_case(CASES[0], dtype=np.float32)
        qs = jnp.stack([arrays["q"], 2 * arrays["q"]])
        mapped = jax.vmap(lambda q: jax_call({**arrays, "q": q}, fixed))(qs)
        for i in range(2):
            np.testing.assert_array_equal(mapped[i], jax_call({**arrays, "q": qs[i]}, fixed))


class TestArguments:
    def test_numpy_inputs_are_not_modified(self):
        arrays, fixed = make_case(CASES[1], dtype=np.float32)
        copies = {n: a.copy() for n, a in arrays.items()}
        jax.grad(lambda q: jax_call({**arrays, "q": q}, fixed).sum())(jnp.asarray(arrays["q"]))
        for name, a in arrays.items():
            np.testing.assert_array_equal(a, copies[name], err_msg=name)

    def test_other_float_dtypes_are_refused_with_a_hint(self):
        q = jnp.ones((1, 1, 3, 4), dtype=jnp.float8_e4m3fn)
        with pytest.raises(TypeError, match=r"`q` has dtype float8_e4m3fn.*astype\(jnp.float32\)"):
            enpj.attention(q, q, q)
        x = q.astype(jnp.float32)
        with pytest.raises(TypeError, match=r"`bias` has dtype"):
            enpj.attention(x, x, x, bias=jnp.zeros((3, 3), dtype=jnp.float8_e4m3fn))

    @pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
    def test_halves_out_in_their_dtype_lse_in_float32_gradients(self, dtype):
        q, k, v = (jax.random.normal(jax.random.key(i), (1, 2, 9, 8), dtype=dtype) for i in range(3))
        out, lse = enpj.attention(q, k, v, causal=True, return_lse=True)
        assert out.dtype == dtype and lse.dtype == jnp.float32
        want, want_lse = enp.attention(*(np.asarray(x) for x in (q, k, v)), causal=True, return_lse=True,
                                       backend="cpu")
        np.testing.assert_array_equal(np.asarray(out), want)
        np.testing.assert_array_equal(np.asarray(lse), want_lse)
        beta = jnp.array([0.5, 1.0], dtype=dtype)
        dq, dbeta = jax.grad(lambda q, beta: enpj.attention(q, k, v, beta=beta).astype(jnp.float32).sum(),
                             argnums=(0, 1))(q, beta)
        assert dq.dtype == dtype and dbeta.dtype == dtype and bool(jnp.all(jnp.isfinite(dq)))

    def test_bad_options_raise_at_the_call_also_under_jit(self):
        q = jnp.ones((1, 2, 3, 4))
        with pytest.raises(ValueError, match="`tau` must be finite and > 0"):
            enpj.attention(q, q, q, tau=-1.0)
        with pytest.raises(ValueError, match=r"`tau` must be a scalar or have shape \(H,\)"):
            jax.jit(lambda t: enpj.attention(q, q, q, tau=t))(jnp.ones(3))
        with pytest.raises(ValueError, match="`bias` of shape"):
            jax.jit(lambda b: enpj.attention(q, q, q, bias=b))(jnp.ones((2, 3)))
        with pytest.raises(ValueError, match="`kv_lengths` must lie in"):
            enpj.attention(q, q, q, kv_lengths=jnp.array([7]))
        with pytest.raises(ValueError, match="`q` must have 4 dimensions"):
            enpj.attention(q[0], q, q)
        with pytest.raises(ValueError, match="`backend`"):
            enpj.attention(q, q, q, backend="gpu")


class TestFunctionCache:
    def test_equal_options_reuse_one_function_and_different_ones_do_not(self):
        from elastic_np import jax as module

        q = jnp.ones((1, 2, 3, 4))
        bias = np.zeros((3, 3), dtype=np.float32)
        module._FUNCTIONS.clear()
        enpj.attention(q, q, q, causal=True, bias=bias)
        enpj.attention(q, q, q, causal=True, bias=bias.copy())
        assert len(module._FUNCTIONS) == 1
        enpj.attention(q, q, q, causal=True, bias=bias + 1)
        enpj.attention(q, q, q, causal=False, bias=bias)
        enpj.attention(q[:, :, :2], q, q, causal=True, bias=bias[:2])
        assert len(module._FUNCTIONS) == 4

    def test_the_cache_is_bounded(self, monkeypatch):
        from elastic_np import jax as module

        monkeypatch.setattr(module, "_FUNCTIONS_KEPT", 2)
        module._FUNCTIONS.clear()
        q = jnp.ones((1, 1, 3, 4))
        for tau in (0.5, 0.6, 0.7):
            np.testing.assert_allclose(enpj.attention(q, q, q, tau=tau), 1.0)
        assert len(module._FUNCTIONS) == 2
