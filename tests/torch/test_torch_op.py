"""The torch operators elastic_np::attention, its backward and double backward: opcheck, torch.compile."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import elastic_np as enp  # noqa: E402
import elastic_np.torch as enpt  # noqa: E402
from elastic_np._api import adapters as common  # noqa: E402
from elastic_np._contract import _spec
from elastic_np.torch import _ops  # noqa: E402
from adapter_cases import weighted_loss  # noqa: E402


def _options(H, N, M, rng):
    """One option set per option of the table, and one combining them (tensors where learnable)."""
    def t(a, grad=False):
        return torch.tensor(a, dtype=torch.float64, requires_grad=grad)

    return {
        "plain": {},
        "scale": {"scale": 0.3},
        "causal": {"causal": True},
        "window_size": {"window_size": (3, 1)},
        "kv_lengths": {"kv_lengths": torch.tensor([M - 2, M])},
        "align": {"kv_lengths": torch.tensor([M - 3, M]), "align": "kv_lengths", "causal": True},
        "mask": {"mask": torch.from_numpy(rng.random((N, M)) > 0.3)},
        "nvm": {"nvm": True},
        "tau": {"tau": t(rng.uniform(0.5, 2.0, H), True)},
        "beta": {"beta": t(0.7, True)},
        "dynamic_window": {"dynamic_window": enpt.DynamicWindow(t(rng.uniform(0.3, 0.9, H), True), 3.0)},
        "softcap": {"softcap": 5.0},
        "alibi_slopes": {"alibi_slopes": torch.tensor(rng.uniform(0.0, 0.5, H))},
        "bias": {"bias": t(rng.standard_normal((1, H, N, M)), True)},
        "layout": {"layout": "bnhd"},
        "combined": {"causal": True, "nvm": True, "tau": t(rng.uniform(0.5, 2.0, H), True), "beta": t(0.5, True),
                     "softcap": 8.0, "bias": t(rng.standard_normal((N, M)), True),
                     "dynamic_window": enpt.DynamicWindow(t(0.6, True), 2.0)},
    }


CASES = sorted(_options(4, 7, 9, np.random.default_rng(0)))


def _arguments(name, dtype=torch.float64):
    rng = np.random.default_rng(1)
    B, H, Hkv, N, M, D = 2, 4, 2, 7, 9, 8
    options = _options(H, N, M, rng)[name]
    shapes = ((B, H, N, D), (B, Hkv, M, D)) if options.get("layout") != "bnhd" else ((B, N, H, D), (B, M, Hkv, D))
    q = torch.tensor(rng.standard_normal(shapes[0]), dtype=dtype, requires_grad=True)
    k, v = (torch.tensor(rng.standard_normal(shapes[1]), dtype=dtype, requires_grad=True) for _ in range(2))
    fixed, learnable = common.split(_spec.complete(options, "test"))
    return q, k, v, _ops.op_arguments(fixed, learnable), options


def test_every_option_has_a_case():
    # precision: CUDA only; k_scale, v_scale: a quantized cache, which has no gradient (tests/cpu/test_quantized.py)
    assert set(CASES) >= set(_spec.NAMES) - {"precision", "k_scale", "v_scale"}


@pytest.mark.parametrize("name", CASES)
def test_opcheck_forward_and_backward(name):
    q, k, v, args, _ = _arguments(name)
    torch.library.opcheck(torch.ops.elastic_np.attention.default, (q, k, v, *args, "cpu"))
    out, lse = torch.ops.elastic_np.attention(q, k, v, *args, "cpu")
    dout = torch.randn_like(out)
    backward_args = (dout, torch.randn_like(lse), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                     *(a.detach() if isinstance(a, torch.Tensor) else a for a in args), "cpu")
    torch.library.opcheck(torch.ops.elastic_np.attention_backward.default, backward_args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["combined", "layout"])
def test_opcheck_in_the_halves(name, dtype):
    """out and the gradients in the input dtype, lse in float32: what the fake implementations say."""
    q, k, v, args, _ = _arguments(name, dtype)
    torch.library.opcheck(torch.ops.elastic_np.attention.default, (q, k, v, *args, "cpu"))
    out, lse = torch.ops.elastic_np.attention(q, k, v, *args, "cpu")
    assert out.dtype == dtype and lse.dtype == torch.float32
    backward_args = (torch.randn_like(out), torch.randn_like(lse), q.detach(), k.detach(), v.detach(), out.detach(),
                     lse.detach(), *(a.detach() if isinstance(a, torch.Tensor) else a for a in args), "cpu")
    torch.library.opcheck(torch.ops.elastic_np.attention_backward.default, backward_args)
    torch.library.opcheck(torch.ops.elastic_np.attention_double_backward.default,
                          _double_backward_arguments(name, "reference", dtype))


@pytest.mark.parametrize("name", ["combined", "layout", "kv_lengths"])
def test_the_operator_gives_the_entry_points_bits(name):
    q, k, v, _, options = _arguments(name, torch.float32)
    out, lse = enpt.attention(q, k, v, return_lse=True, backend="cpu", **options)
    plain = {n: (x.detach().numpy() if isinstance(x, torch.Tensor) else x) for n, x in options.items()}
    if "dynamic_window" in plain:
        window = plain["dynamic_window"]
        plain["dynamic_window"] = enp.DynamicWindow(window.sigma.detach().numpy(), window.sharpness)
    want, want_lse = enp.attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), return_lse=True,
                                   backend="cpu", **plain)
    assert np.array_equal(out.detach().numpy(), want) and np.array_equal(lse.detach().numpy(), want_lse)


@pytest.mark.parametrize("name", CASES)
def test_inference_without_the_operator_gives_its_bits(name):
    q, k, v, args, options = _arguments(name, torch.float32)
    want, want_lse = torch.ops.elastic_np.attention(q, k, v, *args, "cpu")
    with torch.no_grad():
        assert _ops._plain_inference(q, k, v, *common.split(_spec.complete(options, "test")))
        out, lse = enpt.attention(q, k, v, return_lse=True, backend="cpu", **options)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert out.dtype == want.dtype and lse.dtype == want_lse.dtype and out.is_contiguous()


def test_what_goes_through_the_operator():
    q, k, v, _, options = _arguments("combined", torch.float32)
    fixed, learnable = common.split(_spec.complete(options, "test"))
    assert not _ops._plain_inference(q, k, v, fixed, learnable)  # a gradient to record
    with torch.no_grad():
        assert _ops._plain_inference(q, k, v, fixed, learnable)
        assert not _ops._plain_inference(torch.nn.Parameter(q.detach()), k, v, fixed, learnable)  # a subclass
        assert not _ops._plain_inference(q, k, v, fixed, {**learnable, "tau": torch.nn.Parameter(
            torch.ones(4))})
        assert not _ops._plain_inference(q, k, v, {**fixed, "backend": "cuda"}, learnable)
    detached = [x.detach() for x in (q, k, v)]
    plain = {n: (x.detach() if isinstance(x, torch.Tensor) else x) for n, x in options.items()
             if n != "dynamic_window"}
    assert _ops._plain_inference(*detached, *common.split(_spec.complete(plain, "test")))

    def layer(q, k, v):  # traced by torch.compile in inference too: a call on .numpy() would break the graph
        return enpt.attention(q, k, v, causal=True, backend="cpu")

    with torch.no_grad():
        assert torch._dynamo.explain(layer)(*detached).graph_break_count == 0
        assert torch.equal(torch.compile(layer, fullgraph=True)(*detached), layer(*detached))


def test_the_operator_checks_bools_and_the_window_as_the_entry_points_do():
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="`window_size` must be a pair of integers"):
        enpt.attention(q, q, q, window_size=(1.5, 2))
    with pytest.raises(TypeError, match="`causal`"):
        enpt.attention(q, q, q, causal=1)


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)
        self.attn = enpt.ElasticAttention(4, causal=True, learn_tau=True, beta=1.0, learn_beta=True, softcap=20.0)

    def forward(self, x):
        B, N, _ = x.shape
        q, k, v = self.proj(x).view(B, N, 3, 4, 4).unbind(2)
        return self.attn(q, k, v, layout="bnhd")


def test_a_layer_compiles_whole_and_gives_the_eager_bits():
    """The operator's output and gradients in a compiled layer: the eager bits. (The loss is taken outside the
    compiled graph: inductor's own reduction of a mean may round otherwise than eager's, 1 ulp on an AVX2 EPYC.)"""
    torch.manual_seed(0)
    layer = _Layer()
    x = torch.randn(2, 24, 16)
    assert torch._dynamo.explain(layer)(x).graph_break_count == 0
    compiled = torch.compile(layer, fullgraph=True)
    out = compiled(x)
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    want = layer(x)
    want.square().mean().backward()
    assert torch.equal(out, want)
    for n, p in layer.named_parameters():
        if n.startswith("attn."):  # the operator's own gradients: the same bits
            assert torch.equal(grads[n], p.grad), n
        else:  # inductor sums the projection's gradient in another order than eager torch
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7)


def _double_backward_arguments(name, backend, dtype=torch.float64):
    """The double backward's arguments: random cotangents (None for an absent option), then the backward's."""
    q, k, v, args, _ = _arguments(name, dtype)
    out, lse = (x.detach() for x in torch.ops.elastic_np.attention(q, k, v, *args, "cpu"))
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    values = dict(zip(_ops._NAMES, args))
    likes = (q, k, v) + tuple(values[n] for n in common.LEARNABLE)
    cotangents = [None if like is None else torch.randn_like(like) for like in likes]
    return (*cotangents, torch.randn_like(out), torch.randn_like(lse), q.detach(), k.detach(), v.detach(), out, lse,
            *args, backend)


@pytest.mark.parametrize("name", CASES)
def test_opcheck_double_backward(name):
    torch.library.opcheck(torch.ops.elastic_np.attention_double_backward.default,
                          _double_backward_arguments(name, "reference"))


@pytest.mark.parametrize("name", ["combined", "layout", "dynamic_window"])
def test_opcheck_the_backward_with_its_gradients(name):
    """Inputs that require grad: aot_autograd traces the backward's own autograd, the double backward."""
    q, k, v, args, _ = _arguments(name)
    out, lse = torch.ops.elastic_np.attention(q, k, v, *args, "reference")
    backward_args = (torch.randn_like(out, requires_grad=True), torch.randn_like(lse, requires_grad=True), q, k, v,
                     out.detach(), lse.detach(), *args, "reference")
    torch.library.opcheck(torch.ops.elastic_np.attention_backward.default, backward_args)


def test_a_third_derivative_is_refused_naming_the_operator():
    q, k, v, _, options = _arguments("plain")
    out = enpt.attention(q, k, v, backend="reference")
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    (ddq,) = torch.autograd.grad(dq.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="elastic_np.attention_double_backward"):
        torch.autograd.grad(ddq.sum(), q)


def _losses(out, lse, which):
    """A loss of ``out``, of ``lse`` or of both, with weights of their own."""
    return weighted_loss(out, lse, which, seed=5)


@pytest.mark.parametrize("which", [("out",), ("lse",), ("out", "lse")])
@pytest.mark.parametrize("name", CASES)
def test_training_without_the_operator_gives_its_bits(name, which):
    """An eager call that records a gradient skips the operator, with its forward and gradients."""
    q, k, v, args, options = _arguments(name, torch.float32)
    leaves = [q, k, v] + [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    want, want_lse = torch.ops.elastic_np.attention(q, k, v, *args, "cpu")
    wants = torch.autograd.grad(_losses(want, want_lse, which), leaves)
    out, lse = enpt.attention(q, k, v, return_lse=True, backend="cpu", **options)
    # scalar options: elastic_np.torch._fast's, else _EagerAttention
    assert type(out.grad_fn).__name__ in ("_EagerAttentionBackward", "_TrainedBackward")
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and out.is_contiguous()
    for got, wanted in zip(torch.autograd.grad(_losses(out, lse, which), leaves), wants):
        assert got.dtype == wanted.dtype and got.shape == wanted.shape and torch.equal(got, wanted)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_training_without_the_operator_in_every_dtype(dtype):
    q, k, v, args, options = _arguments("combined", dtype)
    leaves = [q, k, v] + [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    wants = torch.autograd.grad(_losses(*torch.ops.elastic_np.attention(q, k, v, *args, "cpu"), ("out", "lse")), leaves)
    got = torch.autograd.grad(_losses(*enpt.attention(q, k, v, return_lse=True, backend="cpu", **options),
                                      ("out", "lse")), leaves)
    assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, wants))


@pytest.mark.parametrize("name", ["combined", "dynamic_window", "plain"])
def test_a_second_derivative_without_the_operator_gives_its_bits(name):
    """``create_graph=True``: `_EagerAttention`'s backward calls the backward operator, differentiable."""
    def second(attend):
        q, k, v, args, options = _arguments(name)
        leaves = [q, k, v] + [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        grads = torch.autograd.grad(_losses(*attend(q, k, v, args, options), ("out", "lse")), leaves,
                                    create_graph=True)
        return torch.autograd.grad(sum((g * g).sum() for g in grads), leaves)

    wants = second(lambda q, k, v, args, options: torch.ops.elastic_np.attention(q, k, v, *args, "cpu"))
    got = second(lambda q, k, v, args, options: enpt.attention(q, k, v, return_lse=True, backend="cpu", **options))
    assert all(torch.equal(g, w) for g, w in zip(got, wants))


def test_what_trains_through_the_operator():
    q, k, v, _, options = _arguments("combined", torch.float32)
    fixed, learnable = common.split(_spec.complete(options, "test"))
    assert _ops._on_host(q, k, v, fixed, learnable, _ops._TRAINED) is not None
    parameter = torch.nn.Parameter(q.detach())  # a model's weights: past the operator
    assert type(enpt.attention(parameter, k, v, **options).grad_fn).__name__ == "_EagerAttentionBackward"

    class Other(torch.Tensor):
        pass

    assert _ops._on_host(q.detach().as_subclass(Other), k, v, fixed, learnable, _ops._TRAINED) is None
    assert _ops._on_host(q, k, v, {**fixed, "backend": "cuda"}, learnable, _ops._TRAINED) is None
    seen = []

    def loss(q):
        seen.append(_ops._on_host(q, k, v, fixed, learnable, _ops._TRAINED))
        return q.sum()

    torch.func.grad(loss)(q.detach())  # torch.func's wrapped tensors: through the operator
    assert seen == [None]
