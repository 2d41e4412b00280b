"""The short way of elastic_np.torch.attention (``_fast``): the full path's bits and errors, its keys and plans."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import elastic_np as enp  # noqa: E402
import elastic_np.torch as enpt  # noqa: E402
from elastic_np._api import adapters as common  # noqa: E402
from elastic_np._api import dispatch, plans  # noqa: E402
from elastic_np._contract import _spec  # noqa: E402
from elastic_np.torch import _arrays, _fast, _ops  # noqa: E402
from adapter_cases import weighted_loss  # noqa: E402

#: Option sets the short way takes (every value a Python scalar), each with a layout of its own.
OPTION_SETS = [
    {},
    {"causal": True},
    {"causal": True, "window_size": (3, 0), "scale": 0.3},
    {"tau": 0.7, "beta": 0.5, "nvm": True, "softcap": 5.0},
    {"tau": 2, "beta": 1},
    {"layout": "bnhd", "causal": True},
]
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _tensors(dtype, layout="bhnd", N=3, M=17, contiguous=True):
    rng = np.random.default_rng(3)
    shapes = ((1, 4, N, 8), (1, 2, M, 8)) if layout == "bhnd" else ((1, N, 4, 8), (1, M, 2, 8))
    q, k, v = (torch.tensor(rng.standard_normal(s), dtype=torch.float32).to(dtype)
               for s in (shapes[0], shapes[1], shapes[1]))
    if not contiguous:  # the same values, other strides
        q, k, v = (x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v))
    return q, k, v


def _full(monkeypatch, *args, **kwargs):
    """``enpt.attention(*args, **kwargs)`` through the full path."""
    with monkeypatch.context() as m:
        m.setattr(_fast, "attention", lambda *a: None)
        return enpt.attention(*args, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", OPTION_SETS, ids=repr)
@pytest.mark.parametrize("contiguous", (True, False))
def test_the_short_way_gives_the_full_paths_bits_and_the_numpy_calls(options, dtype, contiguous, monkeypatch):
    q, k, v = _tensors(dtype, options.get("layout", "bhnd"), contiguous=contiguous)
    with torch.no_grad():
        full = _full(monkeypatch, q, k, v, return_lse=True, backend="cpu", **options)
        for _ in range(3):  # made, then from the kept _Call and plan
            assert _fast.attention(q, k, v, 0.0, "cpu", options) is not None
            out, lse = enpt.attention(q, k, v, return_lse=True, backend="cpu", **options)
            assert out.dtype == full[0].dtype and lse.dtype == full[1].dtype
            assert out.stride() == full[0].stride() and out.is_contiguous()
            assert torch.equal(out, full[0]) and torch.equal(lse, full[1])
    if dtype is not torch.bfloat16:
        expected = enp.attention(q.numpy(), k.numpy(), v.numpy(), return_lse=True, backend="cpu", **options)
        assert np.array_equal(out.numpy(), expected[0]) and np.array_equal(lse.numpy(), expected[1])


def test_a_repeated_call_runs_the_numpy_plan_without_validating_again(monkeypatch):
    q, k, v = _tensors(torch.float32, N=1, M=40)
    enpt.attention(q, k, v, causal=True, backend="cpu")
    validated, called = [], []
    monkeypatch.setattr(dispatch, "validated", lambda *a, run=dispatch.validated: validated.append(1) or run(*a))
    monkeypatch.setattr(dispatch, "attention", lambda *a, run=dispatch.attention, **o: called.append(1) or run(*a, **o))
    first = enpt.attention(q, k, v, causal=True, backend="cpu")
    assert torch.equal(enpt.attention(q, k, v, causal=True, backend="cpu"), first)
    assert validated == [] and called == []
    enpt.attention(q, k, v, causal=True, backend="cpu", tau=0.5)  # another option set: validated once
    assert validated == [1] and called == [1]


def test_the_kept_calls_tell_1_and_1_0_and_true_apart():
    keys = {_fast._key("cpu", {"tau": value}) for value in (1, 1.0, True)}
    assert len(keys) == 3 and None not in keys
    assert _fast._key("cpu", {"window_size": (1, 2)}) != _fast._key("cpu", {"window_size": (True, 2)})
    assert _fast._key("cpu", {"beta": -0.0}) is None and _fast._key("cpu", {"beta": 0.0}) is not None
    assert _fast._key("cpu", {"tau": np.float64(1.0)}) is None and _fast._key("cpu", {"mask": None}) is not None
    assert _fast._key("cuda", {}) is None and _fast._key(None, {}) is None
    q = torch.ones(1, 1, 2, 4)
    with torch.no_grad():
        enpt.attention(q, q, q, causal=True)
        with pytest.raises(TypeError, match="`causal`"):  # not the call kept for causal=True
            enpt.attention(q, q, q, causal=1)
        enpt.attention(q, q, q, causal=True)


def test_the_plan_key_parts_follow_the_numpy_entry_points_order():
    import inspect

    variant = ("score_mod", "mask_mod", "block_mask", "captures")  # a call with them is never planned
    names = [n for n in inspect.signature(dispatch.attention).parameters
             if n not in ("q", "k", "v", "window_size", *variant)]
    assert tuple(names) == plans.KEYED and set(plans.FLOATS) <= set(names)


@pytest.mark.parametrize("options, error", [
    ({"causal": 1}, TypeError), ({"window_size": (1.5, 2)}, ValueError), ({"tau": -1.0}, ValueError),
    ({"is_causal": True}, TypeError), ({"dynamic_window": 0.5}, TypeError), ({"dropout_p": 0.1}, ValueError),
    ({"backend": "nope"}, ValueError), ({"precision": "tf32"}, ValueError), ({"layout": "hbnd"}, ValueError),
])
def test_a_call_the_short_way_takes_up_raises_the_full_paths_error(options, error, monkeypatch):
    q, k, v = _tensors(torch.float32)
    with torch.no_grad():
        with pytest.raises(error) as full:
            _full(monkeypatch, q, k, v, **options)
        for _ in range(2):
            with pytest.raises(error) as short:
                enpt.attention(q, k, v, **options)
            assert str(short.value) == str(full.value)


def test_what_the_short_way_leaves_to_the_full_path(monkeypatch):
    q, k, v = _tensors(torch.float32)
    assert type(_fast.attention(q.requires_grad_(), k, v, 0.0, "cpu", {})[0].grad_fn).__name__ == "_TrainedBackward"
    seen = []

    def loss(q):
        seen.append(_fast.attention(q, k, v, 0.0, "cpu", {}))
        return q.sum()

    torch.func.grad(loss)(q.detach())  # torch.func's wrapped tensors
    assert seen == [None]
    with torch.no_grad():
        assert _fast.attention(q, k, v, 0.0, "cpu", {}) is not None  # detached
        q = q.detach()
        assert _fast.attention(torch.nn.Parameter(q), k, v, 0.0, "cpu", {}) is not None  # a model's weights

        class Other(torch.Tensor):
            pass

        assert _fast.attention(q.as_subclass(Other), k, v, 0.0, "cpu", {}) is None  # another subclass
        assert _fast.attention(q, k.double(), v, 0.0, "cpu", {}) is None  # mixed dtypes: the full path's error
        assert _fast.attention(q, k, v, 0.0, "cpu", {"tau": torch.tensor(1.0)}) is None
        assert _fast.attention(q, k, v, 0.0, "cuda", {}) is None
        assert _fast.attention(q, k, v, 0.0, "cpu", {"window_size": [-1, -1]}) is None
        negative = torch._neg_view(-q)
        assert _fast.attention(negative, k, v, 0.0, "cpu", {}) is None
        assert torch.equal(enpt.attention(negative, k, v), enpt.attention(q, k, v))
        with monkeypatch.context() as m:  # CPU tensors that a bridge takes for the device's
            m.setattr(_arrays._CudaBridge, "device_type", "cpu")
            assert _fast.attention(q, k, v, 0.0, "cpu", {}) is None


def _through_the_operator(q, k, v, options):
    fixed, learnable = common.split(_spec.complete(options, "test"))
    return torch.ops.elastic_np.attention(q, k, v, *_ops.op_arguments(fixed, learnable), "cpu")


def _loss(out, lse, which):
    return weighted_loss(out, lse, which, seed=2)


@pytest.mark.parametrize("which", [("out",), ("lse",), ("out", "lse")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", OPTION_SETS, ids=repr)
def test_a_call_that_records_a_gradient_gives_the_operators_bits(options, dtype, which):
    q, k, v = (x.requires_grad_() for x in _tensors(dtype, options.get("layout", "bhnd"), contiguous=False))
    want = _through_the_operator(q, k, v, options)
    wants = torch.autograd.grad(_loss(*want, which), (q, k, v))
    for _ in range(2):
        out, lse = enpt.attention(q, k, v, return_lse=True, backend="cpu", **options)
        assert type(out.grad_fn).__name__ == "_TrainedBackward"
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        got = torch.autograd.grad(_loss(out, lse, which), (q, k, v))
        assert all(g.dtype == w.dtype and g.is_contiguous() and torch.equal(g, w) for g, w in zip(got, wants))


def test_a_repeated_backward_runs_its_numpy_plan_without_the_entry_point(monkeypatch):
    """The backward of a layout met before finds its `BackwardPlan` by the key part its `_Call` made once; the
    gradients are the first call's bits, handed over without a copy where they are the inputs' dtype."""
    q, k, v = (x.requires_grad_() for x in _tensors(torch.float32))
    enpt.attention(q, k, v, causal=True, tau=0.7).sum().backward()  # in full: its plan kept
    want = [x.grad.clone() for x in (q, k, v)]
    monkeypatch.setattr(dispatch, "attention_backward", lambda *args, **options: pytest.fail("not looked up"))
    for x in (q, k, v):
        x.grad = None
    enpt.attention(q, k, v, causal=True, tau=0.7).sum().backward()
    assert all(torch.equal(x.grad, w) and x.grad.dtype == torch.float32 for x, w in zip((q, k, v), want))


def test_only_the_tensors_that_require_grad_get_one_and_parameters_train():
    q, k, v = _tensors(torch.float32)
    weights = torch.nn.Parameter(k.clone())
    enpt.attention(q, weights, v, causal=True).sum().backward()
    assert weights.grad is not None and q.grad is None and v.grad is None
    want = torch.autograd.grad(_through_the_operator(q, k.requires_grad_(), v, {"causal": True})[0].sum(), k)[0]
    assert torch.equal(weights.grad, want)


@pytest.mark.parametrize("options", [{"causal": True, "tau": 0.7, "beta": 0.5}, {"layout": "bnhd"}], ids=repr)
def test_a_second_derivative_through_the_short_way_gives_the_operators_bits(options):
    def second(attend):
        q, k, v = (x.double().requires_grad_() for x in _tensors(torch.float32, options.get("layout", "bhnd")))
        grads = torch.autograd.grad(_loss(*attend(q, k, v), ("out", "lse")), (q, k, v), create_graph=True)
        return torch.autograd.grad(sum((g * g).sum() for g in grads), (q, k, v))

    wants = second(lambda q, k, v: _through_the_operator(q, k, v, options))
    got = second(lambda q, k, v: enpt.attention(q, k, v, return_lse=True, backend="cpu", **options))
    assert all(torch.equal(g, w) for g, w in zip(got, wants))
