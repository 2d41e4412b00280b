"""elastic_np.torch.varlen_attention: packed batches through the operators elastic_np::varlen_attention and its
backward, against elastic_np.varlen_attention's bits; gradcheck, opcheck, torch.compile."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import elastic_np as enp  # noqa: E402
import elastic_np.torch as enpt  # noqa: E402
from elastic_np._api import adapters as common  # noqa: E402
from elastic_np._contract import _spec
from elastic_np.torch import _arrays, _varlen  # noqa: E402

LENGTHS_Q = [5, 0, 12, 1, 7]
LENGTHS_K = [9, 4, 12, 15, 0]
H, HKV, D = 4, 2, 8


def _packed(dtype=torch.float32, seed=0, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K):
    rng = np.random.default_rng(seed)
    cu_q = torch.tensor(np.cumsum([0] + lengths_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lengths_k), dtype=torch.int32)
    q = torch.tensor(rng.standard_normal((int(cu_q[-1]), H, D)), dtype=dtype, requires_grad=True)
    k, v = (torch.tensor(rng.standard_normal((int(cu_k[-1]), HKV, D)), dtype=dtype, requires_grad=True)
            for _ in range(2))
    return q, k, v, cu_q, cu_k


def _options(dtype=torch.float32, seed=1, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K):
    """Option sets, tensors that require grad where learnable: ``{name: options}``."""
    rng = np.random.default_rng(seed)
    S = len(lengths_q)

    def t(a, grad=True):
        return torch.tensor(a, dtype=dtype, requires_grad=grad)

    return {
        "plain": {},
        "causal_tau_beta": {"causal": True, "tau": t(rng.uniform(0.5, 2.0, H)), "beta": t(0.5), "nvm": True},
        "window_softcap_alibi": {"causal": True, "window_size": (4, 0), "softcap": 8.0,
                                 "alibi_slopes": torch.tensor(rng.uniform(0, 0.3, (S, H)))},
        "sigma_per_sequence": {"dynamic_window": enpt.DynamicWindow(t(rng.uniform(0.3, 0.9, (S, H))), 3.0),
                               "beta": t(rng.uniform(0.1, 1.0, H))},
        "sigma_shared": {"dynamic_window": enpt.DynamicWindow(t(0.6), 2.0), "causal": True},
        "bias_and_mask": {"bias": [t(rng.standard_normal((1 if s % 2 else H, n, m))) for s, (n, m)
                                   in enumerate(zip(lengths_q, lengths_k))],
                          "mask": [torch.from_numpy(rng.random((n, m)) > 0.2) for n, m in zip(lengths_q, lengths_k)],
                          "scale": 0.4},
    }


CASES = sorted(_options())


def _numpy(options):
    """The options as `elastic_np.varlen_attention` takes them: NumPy arrays."""
    def host(x):
        return x.detach().numpy() if isinstance(x, torch.Tensor) else x

    plain = {n: [host(y) for y in x] if isinstance(x, list) else host(x) for n, x in options.items()}
    if "dynamic_window" in plain:
        window = plain["dynamic_window"]
        plain["dynamic_window"] = enp.DynamicWindow(host(window.sigma), window.sharpness, window.threshold)
    return plain


def _learnable(options):
    """``(name, tensor)`` of every option tensor that requires grad."""
    found = []
    for name, x in options.items():
        if name == "dynamic_window":
            x = x.sigma
        for i, y in enumerate(x if isinstance(x, list) else [x]):
            if isinstance(y, torch.Tensor) and y.requires_grad:
                found.append((f"{name}[{i}]" if isinstance(x, list) else name, y))
    return found


@pytest.mark.parametrize("name", CASES)
def test_the_bits_of_the_numpy_function_forward_and_every_gradient(name):
    q, k, v, cu_q, cu_k = _packed()
    options = _options()[name]
    out, lse = enpt.varlen_attention(q, k, v, cu_q, cu_k, max_q=12, max_k=15, return_lse=True, **options)
    rng = np.random.default_rng(2)
    dout, dlse = (torch.tensor(rng.standard_normal(x.shape), dtype=x.dtype) for x in (out, lse))
    ((out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0) * dlse).sum()).backward()

    arrays = [x.detach().numpy() for x in (q, k, v)]
    plain = _numpy(options)
    want, want_lse = enp.varlen_attention(*arrays, cu_q.numpy(), cu_k.numpy(), return_lse=True, backend="cpu",
                                          **plain)
    assert np.array_equal(out.detach().numpy(), want) and np.array_equal(lse.detach().numpy(), want_lse)
    dlse_np = np.where(np.isfinite(want_lse), dlse.numpy(), 0)
    grads = enp.varlen_attention_backward(dout.numpy(), *arrays, want, want_lse, cu_q.numpy(), cu_k.numpy(),
                                          dlse=dlse_np, backend="cpu", **plain)
    for x, g in zip((q, k, v), (grads.dq, grads.dk, grads.dv)):
        assert np.array_equal(x.grad.numpy(), g)
    for label, x in _learnable(options):
        option = label.split("[")[0]
        want_grad = grads.dbias[int(label[5:-1])] if option == "bias" else \
            common.grad_of(grads, "sigma" if option == "dynamic_window" else option)
        assert np.array_equal(x.grad.numpy(), np.asarray(want_grad, dtype=np.float32).reshape(x.shape)), label


@pytest.mark.parametrize("name", ["causal_tau_beta", "sigma_per_sequence", "bias_and_mask"])
def test_gradcheck_in_float64(name):
    lengths_q, lengths_k = [3, 0, 4], [4, 2, 4]
    q, k, v, cu_q, cu_k = _packed(torch.float64, lengths_q=lengths_q, lengths_k=lengths_k)
    options = _options(torch.float64, lengths_q=lengths_q, lengths_k=lengths_k)[name]
    learnable = [(label, x) for label, x in _learnable(options) if x.numel()]  # gradcheck takes no empty input

    def fn(q, k, v, *values):
        given = dict(options)
        for (label, _), x in zip(learnable, values):
            option = label.split("[")[0]
            if option == "bias":
                given["bias"] = list(given["bias"])
                given["bias"][int(label[5:-1])] = x
            elif option == "dynamic_window":
                given[option] = given[option]._replace(sigma=x)
            else:
                given[option] = x
        out, lse = enpt.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, backend="cpu", **given)
        return out, torch.where(torch.isfinite(lse), lse, 0)

    assert torch.autograd.gradcheck(fn, (q, k, v, *(x for _, x in learnable)))


def _op_arguments(name, dtype=torch.float64):
    q, k, v, cu_q, cu_k = _packed(dtype)
    fixed, learnable = common.split(_spec.complete(_options(dtype)[name], "test"))
    batch = (cu_q, cu_k, 12, 15, None, None)
    return q, k, v, batch, _varlen.op_arguments(fixed, learnable)


@pytest.mark.parametrize("name", CASES)
def test_opcheck_forward_and_backward(name):
    q, k, v, batch, args = _op_arguments(name)
    torch.library.opcheck(torch.ops.elastic_np.varlen_attention.default, (q, k, v, *batch, *args, "cpu"))
    out, lse = torch.ops.elastic_np.varlen_attention(q, k, v, *batch, *args, "cpu")
    def detached(a):
        return a.detach() if isinstance(a, torch.Tensor) else [detached(y) for y in a] if isinstance(a, list) else a

    dlse = torch.where(torch.isfinite(lse), torch.randn_like(lse), 0)
    backward_args = (torch.randn_like(out), dlse, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                     *batch, *map(detached, args), "cpu")
    torch.library.opcheck(torch.ops.elastic_np.varlen_attention_backward.default, backward_args)


class _PackedLayer(torch.nn.Module):
    """A projection and packed causal attention with a learnable sink and temperature."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)
        self.beta = torch.nn.Parameter(torch.full((4,), 0.5))
        self.tau = torch.nn.Parameter(torch.full((4,), 1.2))

    def forward(self, x, cu):
        q, k, v = self.proj(x).view(x.shape[0], 3, 4, 4).unbind(1)  # (total, H, D) each
        return enpt.varlen_attention(q, k, v, cu, cu, max_q=11, max_k=11, causal=True, beta=self.beta, tau=self.tau)


def test_a_packed_layer_compiles_whole_and_gives_the_eager_bits():
    torch.manual_seed(0)
    layer = _PackedLayer()
    x, cu = torch.randn(24, 16), torch.tensor([0, 5, 16, 24], dtype=torch.int32)
    assert torch._dynamo.explain(layer)(x, cu).graph_break_count == 0
    out = torch.compile(layer, fullgraph=True)(x, cu)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    want = layer(x, cu)
    want.square().sum().backward()
    assert torch.equal(out, want)
    for n, p in layer.named_parameters():
        if n in ("beta", "tau"):  # the operator's own gradients: the same bits
            assert torch.equal(grads[n], p.grad), n
        else:  # inductor sums the projection's gradient in another order than eager torch
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7)


def test_a_bias_and_a_mask_per_sequence_compile_whole():
    q, k, v, cu_q, cu_k = _packed()
    options = _options()["bias_and_mask"]

    def loss(q, k, v, bias, mask):
        return enpt.varlen_attention(q, k, v, cu_q, cu_k, bias=bias, mask=mask, causal=True).square().sum()

    assert torch._dynamo.explain(loss)(q, k, v, options["bias"], options["mask"]).graph_break_count == 0
    torch.compile(loss, fullgraph=True)(q, k, v, options["bias"], options["mask"]).backward()
    compiled = [b.grad.clone() for b in options["bias"]]
    for b in options["bias"]:
        b.grad = None
    loss(q, k, v, options["bias"], options["mask"]).backward()
    assert all(torch.equal(a, b.grad) for a, b in zip(compiled, options["bias"]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_halves_give_the_numpy_functions_bits_lse_in_float32(dtype):
    q, k, v, cu_q, cu_k = (x.detach().to(dtype).requires_grad_() if x.is_floating_point() else x for x in _packed())
    beta = torch.full((H,), 0.5, dtype=dtype, requires_grad=True)
    out, lse = enpt.varlen_attention(q, k, v, cu_q, cu_k, causal=True, beta=beta, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    out.float().square().sum().backward()
    arrays = [_arrays.to_numpy(x.detach()) for x in (q, k, v)]
    options = {"causal": True, "beta": _arrays.to_numpy(beta.detach()), "backend": "cpu"}
    want, want_lse = enp.varlen_attention(*arrays, cu_q.numpy(), cu_k.numpy(), return_lse=True, **options)
    assert np.array_equal(_arrays.to_numpy(out.detach()), want) and np.array_equal(lse.detach().numpy(), want_lse)
    dout = _arrays.to_numpy(2 * out.detach().float().to(dtype))
    grads = enp.varlen_attention_backward(dout, *arrays, want, want_lse, cu_q.numpy(), cu_k.numpy(), **options)
    assert q.grad.dtype == dtype and np.array_equal(_arrays.to_numpy(q.grad), grads.dq)
    assert beta.grad.dtype == dtype and bool(torch.isfinite(beta.grad).all())


def test_seqused_k_forward_and_backward():
    q, k, v, cu_q, cu_k = _packed()
    used = torch.tensor([3, 0, 12, 6, 0])
    out = enpt.varlen_attention(q, k, v, cu_q, cu_k, seqused_k=used, causal=True)
    out.sum().backward()
    arrays = [x.detach().numpy() for x in (q, k, v)]
    want, lse = enp.varlen_attention(*arrays, cu_q, cu_k, seqused_k=used.numpy(), causal=True, return_lse=True)
    grads = enp.varlen_attention_backward(np.ones_like(want), *arrays, want, lse, cu_q, cu_k, seqused_k=used.numpy(),
                                          causal=True)
    assert np.array_equal(out.detach().numpy(), want) and np.array_equal(k.grad.numpy(), grads.dk)
    assert float(k.grad[cu_k[0] + 3:cu_k[1]].abs().max()) == 0.0  # the unused keys get nothing


def test_a_paged_cache_forward_and_no_backward():
    rng = np.random.default_rng(3)
    pages_k, pages_v = (torch.tensor(rng.standard_normal((5, 4, HKV, D)), dtype=torch.float32) for _ in range(2))
    table, used = torch.tensor([[3, 1], [0, 4]], dtype=torch.int32), torch.tensor([6, 3], dtype=torch.int32)
    q = torch.randn(2, H, D, requires_grad=True)
    out = enpt.varlen_attention(q, pages_k, pages_v, [0, 1, 2], None, block_table=table, seqused_k=used,
                                causal=True)
    want = enp.varlen_attention(q.detach().numpy(), pages_k.numpy(), pages_v.numpy(), [0, 1, 2], None,
                                block_table=table.numpy(), seqused_k=used.numpy(), causal=True)
    assert np.array_equal(out.detach().numpy(), want)
    with pytest.raises(RuntimeError, match="no backward over a paged cache \\(`block_table`\\)"):
        out.sum().backward()


def test_a_second_derivative_is_refused_naming_the_operator():
    """The packed backward has no derivative of its own (`elastic_np.torch.attention`'s has)."""
    q, k, v, cu_q, cu_k = _packed(torch.float64)
    out = enpt.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="elastic_np.varlen_attention_backward.*no autograd formula"):
        torch.autograd.grad(dq.sum(), q)


def test_bad_input_names_the_argument_and_mutates_nothing():
    q, k, v, cu_q, cu_k = _packed()
    before = [x.detach().clone() for x in (q, k, v, cu_q, cu_k)]
    with pytest.raises(ValueError, match="`cu_seqlens_q` must rise from 0 to the packed length 25"):
        enpt.varlen_attention(q, k, v, cu_q.flip(0), cu_k)
    with pytest.raises(ValueError, match="`max_k`=10 is below the longest sequence, 15"):
        enpt.varlen_attention(q, k, v, cu_q, cu_k, max_k=10)
    with pytest.raises(ValueError, match="does not take `kv_lengths`.*`seqused_k`"):
        enpt.varlen_attention(q, k, v, cu_q, cu_k, kv_lengths=torch.tensor([1] * 5))
    with pytest.raises(ValueError, match="does not take `layout`"):
        enpt.varlen_attention(q, k, v, cu_q, cu_k, layout="bnhd")
    with pytest.raises(ValueError, match="`bias` as a list of one array per sequence"):
        enpt.varlen_attention(q, k, v, cu_q, cu_k, bias=torch.zeros(H, 25, 40))
    with pytest.raises(ValueError, match="`bias\\[2\\]` of shape \\(12, 11\\)"):
        enpt.varlen_attention(q, k, v, cu_q, cu_k, bias=[torch.zeros(n, m) for n, m in zip(LENGTHS_Q, [9, 4, 11,
                                                                                                    15, 0])])
    with pytest.raises(ValueError, match="`seqused_k`"):
        enpt.varlen_attention(q, k, v, cu_q, cu_k, seqused_k=torch.tensor([10, 0, 0, 0, 0]))
    with pytest.raises(TypeError, match="`k` and `v` must both be quantized"):
        enpt.varlen_attention(q, k.to(torch.float8_e4m3fn), v, cu_q, cu_k)
    with pytest.raises(TypeError, match="`q` has dtype torch.float8_e4m3fn"):
        enpt.varlen_attention(q.to(torch.float8_e4m3fn), k, v, cu_q, cu_k)
    with pytest.raises(TypeError, match="`q` is on device meta.*CPU tensors"):
        enpt.varlen_attention(q.to("meta"), k, v, cu_q, cu_k)
    with pytest.raises(TypeError, match="`mask\\[0\\]` is on device meta"):
        enpt.varlen_attention(q, k, v, cu_q, cu_k, mask=[torch.ones(5, 9, dtype=torch.bool, device="meta")] * 5)
    with pytest.raises(TypeError, match="causal="):
        enpt.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)
    for x, b in zip((q, k, v, cu_q, cu_k), before):
        assert torch.equal(x.detach(), b)


# ---------------------------------------------------------------------------
# torch.nn.attention.varlen.varlen_attn's signature, taken as it is
# ---------------------------------------------------------------------------

torch_varlen = pytest.importorskip("torch.nn.attention.varlen")


def test_the_signature_holds_torchs_varlen_attn_and_only_what_it_takes():
    import inspect

    ours = inspect.signature(enpt.varlen_attention).parameters
    for name, theirs in inspect.signature(torch_varlen.varlen_attn).parameters.items():
        assert name in ours and ours[name].kind is theirs.kind, name
        if theirs.default is not theirs.empty:
            assert ours[name].default == theirs.default, name
    assert list(ours)[:7] == list(inspect.signature(torch_varlen.varlen_attn).parameters)[:7]
    assert not {"layout", "kv_lengths", "align"} & set(ours)


def _torch_form(seed=4):
    """A packed batch in torch's names: ``(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)``."""
    q, k, v, cu_q, cu_k = _packed(seed=seed)
    return q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3, 0)])
def test_torchs_positional_and_keyword_forms_and_ours_give_the_same_bits(window):
    """torch's window_size reads as ours: (-1, 0) is causal, (W, 0) a causal window of W keys before."""
    q, k, v, cu_q, cu_k, max_q, max_k = args = _torch_form()
    positional = enpt.varlen_attention(*args, window_size=window)
    keywords = enpt.varlen_attention(query=q, key=k, value=v, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=max_q,
                                     max_k=max_k, window_size=window, scale=0.3, enable_gqa=True, num_splits=1)
    ours = enpt.varlen_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, window_size=window, scale=0.3)
    want = enp.varlen_attention(*(x.detach().numpy() for x in (q, k, v)), cu_q.numpy(), cu_k.numpy(),
                                window_size=window, backend="cpu")
    reference = enp.varlen_attention(*(x.detach().numpy() for x in (q, k, v)), cu_q.numpy(), cu_k.numpy(),
                                     causal=window == (-1, 0), window_size=(3, 0) if window == (3, 0) else (-1, -1),
                                     backend="reference")
    assert np.array_equal(positional.detach().numpy(), want) and torch.equal(keywords, ours)
    np.testing.assert_allclose(want, reference, rtol=2e-5, atol=2e-6)


def test_return_aux_gives_torchs_lse_as_torch_gives_it():
    """torch's CPU build cannot run varlen_attn (no CPU flash kernel); on "meta" tensors it gives the shapes."""
    q, k, v, cu_q, cu_k, max_q, max_k = args = _torch_form()
    aux = torch_varlen.AuxRequest(lse=True)
    out, lse = enpt.varlen_attention(*args, return_aux=aux, window_size=(-1, 0))
    meta = torch_varlen.varlen_attn(*(x.detach().to("meta") for x in (q, k, v, cu_q, cu_k)), max_q, max_k,
                                    return_aux=aux, window_size=(-1, 0), enable_gqa=True)
    assert [(x.shape, x.dtype) for x in (out, lse)] == [(x.shape, x.dtype) for x in meta]
    mine_out, mine_lse = enpt.varlen_attention(*args, return_lse=True, causal=True)
    assert torch.equal(out, mine_out) and torch.equal(lse, mine_lse.T)
    lse.sum().backward()  # differentiable, as ``return_lse``'s
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())
    assert isinstance(enpt.varlen_attention(*args, return_aux=torch_varlen.AuxRequest()), torch.Tensor)


def test_what_torch_takes_and_elastic_np_cannot_honour_is_an_error_naming_it():
    args = _torch_form()
    with pytest.raises(ValueError, match="`num_splits`=2 sets the split-KV count.*None or 1"):
        enpt.varlen_attention(*args, num_splits=2)
    with pytest.raises(ValueError, match="`return_aux=AuxRequest\\(lse=True\\)`.*or `return_lse=True`.*not both"):
        enpt.varlen_attention(*args, return_aux=torch_varlen.AuxRequest(lse=True), return_lse=True)
    with pytest.raises(TypeError, match="`return_aux` must be None or torch.nn.attention.varlen.AuxRequest"):
        enpt.varlen_attention(*args, return_aux=True)
    with pytest.raises(TypeError, match="got both `cu_seq_q` and `cu_seqlens_q`"):
        enpt.varlen_attention(*args[:3], cu_seq_q=args[3], cu_seqlens_q=args[3], cu_seq_k=args[4])
    with pytest.raises(ValueError, match="`dropout_p`=0.1: attention dropout is not supported"):
        enpt.varlen_attention(*args, dropout_p=0.1)
    assert torch.equal(enpt.varlen_attention(*args, dropout_p=0.0), enpt.varlen_attention(*args, dropout_p=0))


def test_torchs_paged_form():
    rng = np.random.default_rng(3)
    pages_k, pages_v = (torch.tensor(rng.standard_normal((5, 4, HKV, D)), dtype=torch.float32) for _ in range(2))
    table, used = torch.tensor([[3, 1], [0, 4]], dtype=torch.int32), torch.tensor([6, 3], dtype=torch.int32)
    q, cu_q = torch.randn(2, H, D), torch.tensor([0, 1, 2], dtype=torch.int32)
    out = enpt.varlen_attention(q, pages_k, pages_v, cu_q, None, 1, 6, window_size=(-1, 0), seqused_k=used,
                                block_table=table)
    want = enp.varlen_attention(q.numpy(), pages_k.numpy(), pages_v.numpy(), [0, 1, 2], None, causal=True,
                                block_table=table.numpy(), seqused_k=used.numpy())
    assert np.array_equal(out.numpy(), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch runs varlen_attn on CUDA only")
def test_torchs_own_varlen_attn_on_cuda_agrees():
    q, k, v, cu_q, cu_k, max_q, max_k = _torch_form()
    q, k, v = (x.detach().to(torch.bfloat16) for x in (q, k, v))
    hkv = k.shape[1]
    aux = torch_varlen.AuxRequest(lse=True)
    theirs, their_lse = torch_varlen.varlen_attn(*(x.cuda() for x in (q, k, v, cu_q, cu_k)), max_q, max_k,
                                                 return_aux=aux, window_size=(-1, 0), enable_gqa=hkv != H)
    out, lse = enpt.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, return_aux=aux, window_size=(-1, 0))
    assert lse.shape == their_lse.shape
    torch.testing.assert_close(out.float(), theirs.float().cpu(), rtol=2e-2, atol=2e-2)
    keep = torch.isfinite(lse)
    torch.testing.assert_close(lse[keep], their_lse.cpu()[keep], rtol=1e-3, atol=1e-3)
