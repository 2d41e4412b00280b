"""elastic_np.torch's second derivatives: gradgradcheck through the backward operator, and a Hessian-vector
product against `elastic_np.attention_double_backward`.

On the reference backend and the CPU kernels.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import elastic_np as enp  # noqa: E402
import elastic_np.torch as enpt  # noqa: E402
from double_backward_cases import CASES, LEARNED, make_case, numpy_options  # noqa: E402
from elastic_np._api import dispatch  # noqa: E402


#: Every backend with a double backward.
BACKENDS = ["reference", "cpu"]


def tensors(arrays, requires_grad=LEARNED):
    return {n: torch.tensor(a, requires_grad=n in requires_grad) for n, a in arrays.items()}


def torch_call(arrays, fixed, **extra):
    """``elastic_np.torch.attention`` of tensors (or numbers) ``arrays``."""
    fixed = dict(fixed)
    window = enpt.DynamicWindow(arrays["sigma"], fixed.pop("sharpness"), fixed.pop("threshold"))
    return enpt.attention(arrays["q"], arrays["k"], arrays["v"], tau=arrays["tau"], beta=arrays["beta"],
                          bias=arrays["bias"], dynamic_window=window, **fixed, **extra)


#: What the function under gradgradcheck returns: its random cotangents are the backward's dout and dlse.
OUTPUTS = {"out": lambda out, lse: out, "lse": lambda out, lse: lse, "out-lse": lambda out, lse: (out, lse)}


class TestGradgradcheck:
    @pytest.mark.parametrize("backend", BACKENDS)
    @pytest.mark.parametrize("case", CASES)
    def test_every_input_together(self, case, backend):
        arrays, fixed = make_case(case)
        inputs = tensors(arrays)

        def f(*values):
            return torch_call(dict(zip(LEARNED, values)), fixed, return_lse=True, backend=backend)

        assert torch.autograd.gradgradcheck(f, tuple(inputs[n] for n in LEARNED))

    @pytest.mark.parametrize("outputs", ["out", "lse"])
    def test_out_or_lse_alone(self, outputs):
        # the backward's dlse is None, or its dout zeros
        arrays, fixed = make_case(CASES[0], seed=1)
        inputs = tensors(arrays)

        def f(*values):
            out, lse = torch_call(dict(zip(LEARNED, values)), fixed, return_lse=True, backend="reference")
            return OUTPUTS[outputs](out, lse)

        assert torch.autograd.gradgradcheck(f, tuple(inputs[n] for n in LEARNED))

    @pytest.mark.parametrize("name", LEARNED[3:])
    def test_each_parameter_alone(self, name):
        arrays, fixed = make_case(CASES[1], seed=2)
        inputs = tensors(arrays, requires_grad=(name,))

        def f(x):
            return torch_call({**inputs, name: x}, fixed, backend="reference")

        assert torch.autograd.gradgradcheck(f, (inputs[name],))

    def test_a_wrong_second_derivative_fails(self, monkeypatch):
        """The check sees the double backward: one 1% off in dtau fails it."""
        arrays, fixed = make_case(CASES[0], seed=3)
        inputs = tensors(arrays, requires_grad=("q", "tau"))
        double_backward = dispatch.attention_double_backward

        def off(*args, **kwargs):
            grads = double_backward(*args, **kwargs)
            return grads._replace(dtau=grads.dtau * 1.01)

        monkeypatch.setattr(dispatch, "attention_double_backward", off)

        def f(q, tau):
            return torch_call({**inputs, "q": q, "tau": tau}, fixed, backend="reference")

        assert not torch.autograd.gradgradcheck(f, (inputs["q"], inputs["tau"]), raise_exception=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_hessian_vector_product_is_the_double_backward(case, backend):
    """``torch.autograd.grad`` twice gives `elastic_np.attention_double_backward` for every input."""
    arrays, fixed = make_case(case, seed=4)
    rng = np.random.default_rng(5)
    options = numpy_options(arrays, fixed)
    out, lse = enp.attention(arrays["q"], arrays["k"], arrays["v"], return_lse=True, backend=backend, **options)
    first = {"dout": rng.standard_normal(out.shape), "dlse": rng.standard_normal(lse.shape)}
    u = {name: rng.standard_normal(np.shape(a)) for name, a in arrays.items()}
    want = enp.attention_double_backward(
        u["q"], u["k"], u["v"], first["dout"], arrays["q"], arrays["k"], arrays["v"], out, lse,
        dlse=first["dlse"], backend=backend, **{"dd" + n: u[n] for n in LEARNED[3:]}, **options)

    inputs = tensors({**arrays, **first}, requires_grad=(*LEARNED, "dout", "dlse"))
    t_out, t_lse = torch_call(inputs, fixed, return_lse=True, backend=backend)
    loss = (inputs["dout"] * t_out).sum() + (inputs["dlse"] * t_lse).sum()
    grads = torch.autograd.grad(loss, [inputs[n] for n in LEARNED], create_graph=True)
    inner = sum((g * torch.from_numpy(u[n])).sum() for g, n in zip(grads, LEARNED))
    names = ("dout", "dlse", *LEARNED)
    second = torch.autograd.grad(inner, [inputs[n] for n in names])
    for name, got in zip(names, second):
        expected = getattr(want, {"dout": "ddout", "dlse": "ddlse"}.get(name, "d" + name))
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12, err_msg=name)


def test_a_backend_without_a_double_backward_says_so(monkeypatch):
    monkeypatch.delattr(enp.cpu, "double_backward")
    arrays, fixed = make_case(CASES[0])
    inputs = tensors(arrays, requires_grad=("q",))
    out = torch_call(inputs, fixed, backend="cpu")
    (dq,) = torch.autograd.grad(out.square().sum(), inputs["q"], create_graph=True)
    with pytest.raises(enp.BackendUnavailableError, match="'cpu' has no double backward"):
        torch.autograd.grad(dq.sum(), inputs["q"])


def test_a_gradient_penalty_trains():
    """A loss on the norm of a gradient: one step of SGD through the second derivative lowers it."""
    arrays, fixed = make_case(CASES[1], seed=6)
    inputs = tensors(arrays)

    def penalty():
        out = torch_call(inputs, fixed, backend="reference")
        (dq,) = torch.autograd.grad(out.square().sum(), inputs["q"], create_graph=True)
        return dq.square().sum()

    before = penalty()
    before.backward()
    with torch.no_grad():
        for name in LEARNED:
            inputs[name] -= 1e-3 * inputs[name].grad
    assert penalty() < before
