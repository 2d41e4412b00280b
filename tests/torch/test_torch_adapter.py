"""elastic_np.torch: autograd through the kernels, against gradcheck and the NumPy entry points."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import elastic_np as enp  # noqa: E402
import elastic_np.torch as enpt  # noqa: E402
from adapter_cases import CASES, LEARNED, make_case, numpy_options, tensors, torch_call  # noqa: E402
from elastic_np._api import dispatch
from elastic_np.torch import _arrays  # noqa: E402


class TestGradcheck:
    @pytest.mark.parametrize("case", CASES)
    def test_every_input_together(self, case):
        arrays, fixed = make_case(case)
        inputs = tensors(arrays)

        def f(*values):
            return torch_call(dict(zip(LEARNED, values)), fixed)

        assert torch.autograd.gradcheck(f, tuple(inputs[n] for n in LEARNED))

    @pytest.mark.parametrize("case", CASES)
    @pytest.mark.parametrize("name", LEARNED)
    def test_each_input_alone(self, case, name):
        arrays, fixed = make_case(case, seed=1)
        inputs = tensors(arrays, requires_grad=(name,))

        def f(x):
            return torch_call({**inputs, name: x}, fixed)

        assert torch.autograd.gradcheck(f, (inputs[name],))

    @pytest.mark.parametrize("case", CASES)
    def test_out_and_lse_together(self, case):
        arrays, fixed = make_case(case, seed=3)
        inputs = tensors(arrays)

        def f(*values):
            return torch_call(dict(zip(LEARNED, values)), fixed, return_lse=True)

        assert torch.autograd.gradcheck(f, tuple(inputs[n] for n in LEARNED))

    @pytest.mark.parametrize("case", CASES)
    def test_lse_alone(self, case):
        # out takes no part in the loss: its cotangent is None in the backward
        arrays, fixed = make_case(case, seed=4)
        inputs = tensors(arrays)

        def f(*values):
            return torch_call(dict(zip(LEARNED, values)), fixed, return_lse=True)[1]

        assert torch.autograd.gradcheck(f, tuple(inputs[n] for n in LEARNED))

    def test_against_the_reference_backend(self):
        arrays, fixed = make_case(CASES[0], seed=2)
        kernel = tensors(arrays)
        oracle = tensors(arrays)
        torch_call(kernel, fixed).square().sum().backward()
        torch_call(oracle, fixed, backend="reference").square().sum().backward()
        for name in LEARNED:
            torch.testing.assert_close(kernel[name].grad, oracle[name].grad, rtol=1e-12, atol=1e-12)


class TestFloat32:
    @pytest.mark.parametrize("case", CASES)
    def test_forward_and_gradients_are_the_numpy_entry_points_bits(self, case):
        arrays, fixed = make_case(case, dtype=np.float32)
        inputs = tensors(arrays)
        out, lse = torch_call(inputs, fixed, return_lse=True)
        dout = np.random.default_rng(5).standard_normal(out.shape).astype(np.float32)
        out.backward(torch.from_numpy(dout))

        options = numpy_options(arrays, fixed)
        want_out, want_lse = enp.attention(arrays["q"], arrays["k"], arrays["v"], return_lse=True,
                                           backend="cpu", **options)
        grads = enp.attention_backward(dout, arrays["q"], arrays["k"], arrays["v"], want_out,
                                       want_lse, backend="cpu", **options)
        np.testing.assert_array_equal(out.detach().numpy(), want_out)
        np.testing.assert_array_equal(lse.detach().numpy(), want_lse)
        for name in LEARNED:
            got = inputs[name].grad
            assert got.dtype == torch.float32 and got.shape == inputs[name].shape, name
            want = np.asarray(getattr(grads, "d" + name), dtype=np.float32)
            np.testing.assert_array_equal(got.numpy(), want.reshape(got.shape), err_msg=name)

    @pytest.mark.parametrize("used", ["out and lse", "lse"])
    def test_lse_gradients_are_the_numpy_entry_points_bits(self, used):
        arrays, fixed = make_case(CASES[0], dtype=np.float32)
        inputs = tensors(arrays)
        out, lse = torch_call(inputs, fixed, return_lse=True)
        rng = np.random.default_rng(6)
        dout = rng.standard_normal(out.shape).astype(np.float32) * (used == "out and lse")
        dlse = rng.standard_normal(lse.shape).astype(np.float32)
        if used == "lse":
            lse.backward(torch.from_numpy(dlse))
        else:
            torch.autograd.backward([out, lse], [torch.from_numpy(dout), torch.from_numpy(dlse)])

        options = numpy_options(arrays, fixed)
        want_out, want_lse = enp.attention(arrays["q"], arrays["k"], arrays["v"], return_lse=True,
                                           backend="cpu", **options)
        grads = enp.attention_backward(dout, arrays["q"], arrays["k"], arrays["v"], want_out,
                                       want_lse, dlse=dlse, backend="cpu", **options)
        for name in LEARNED:
            want = np.asarray(getattr(grads, "d" + name), dtype=np.float32)
            np.testing.assert_array_equal(inputs[name].grad.numpy(), want.reshape(arrays[name].shape),
                                          err_msg=name)

    def test_training_step_gives_finite_gradients_and_moves_the_parameters(self):
        torch.manual_seed(0)
        attn = enpt.ElasticAttention(4, tau=0.7, beta=1.0, causal=True, learn_tau=True, learn_beta=True,
                                     dynamic_window=enp.DynamicWindow(0.5, sharpness=4.0), learn_window=True)
        proj = torch.nn.Linear(16, 16)
        x = torch.randn(2, 4, 32, 16)
        target = torch.randn(2, 4, 32, 16)
        before = {n: p.detach().clone() for n, p in attn.named_parameters()}
        optimizer = torch.optim.SGD([*attn.parameters(), *proj.parameters()], lr=0.1)
        loss = torch.nn.functional.mse_loss(attn(proj(x), proj(x), x), target)
        loss.backward()
        for name, p in [*attn.named_parameters(), *proj.named_parameters()]:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0, name
        optimizer.step()
        for name, p in attn.named_parameters():
            assert not torch.equal(p, before[name]), name


class TestTensors:
    def test_inputs_are_never_modified(self):
        arrays, fixed = make_case(CASES[0], dtype=np.float32)
        inputs = tensors(arrays)
        copies = {n: t.detach().clone() for n, t in inputs.items()}
        dout = torch.randn(1, 4, 5, 2)
        dout_copy = dout.clone()
        torch_call(inputs, fixed).backward(dout)
        for name, t in inputs.items():
            assert torch.equal(t.detach(), copies[name]), name
        assert torch.equal(dout, dout_copy)

    def test_contiguous_tensors_reach_the_kernels_without_a_copy(self, monkeypatch):
        seen = {}
        real = dispatch.attention

        def spy(q, k, v, **options):
            seen.update(q=q, k=k, v=v, bias=options["bias"])
            return real(q, k, v, **options)

        monkeypatch.setattr(dispatch, "attention", spy)
        arrays, fixed = make_case(CASES[1], dtype=np.float32)
        inputs = tensors(arrays)
        out = torch_call(inputs, fixed)
        for name in ("q", "k", "v", "bias"):
            assert np.shares_memory(seen[name], inputs[name].detach().numpy()), name
        assert out.dtype == torch.float32

    @staticmethod
    def _numpy_grads(arrays, fixed):
        """The NumPy entry points' gradients of ``sum(out)`` for a case."""
        options = numpy_options(arrays, fixed)
        out, lse = enp.attention(arrays["q"], arrays["k"], arrays["v"], return_lse=True, backend="cpu", **options)
        return enp.attention_backward(np.ones_like(out), arrays["q"], arrays["k"], arrays["v"], out, lse,
                                      backend="cpu", **options)

    def test_the_forward_runs_once_and_lse_is_kept(self, monkeypatch):
        calls = []
        real = dispatch.attention
        monkeypatch.setattr(dispatch, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        arrays, fixed = make_case(CASES[0], dtype=np.float32)
        inputs = tensors(arrays)
        torch_call(inputs, fixed).sum().backward()
        assert len(calls) == 1
        # the backward of the kept out and lse: the NumPy backward's bits
        want = self._numpy_grads(arrays, fixed)
        for name in LEARNED:
            np.testing.assert_array_equal(inputs[name].grad.numpy(),
                                          np.asarray(getattr(want, "d" + name), np.float32).reshape(arrays[name].shape),
                                          err_msg=name)

    def test_non_contiguous_inputs_give_the_same_bits(self):
        arrays, fixed = make_case(CASES[0], dtype=np.float32)
        plain = tensors(arrays)
        strided = tensors(arrays)
        leaves = {}
        for name in ("q", "k", "v", "bias"):
            # the same values, stored transposed: a non-contiguous view of a leaf
            leaves[name] = strided[name].detach().mT.contiguous().requires_grad_()
            strided[name] = leaves[name].mT
        assert not strided["q"].is_contiguous()
        out = torch_call(plain, fixed)
        out.sum().backward()
        out_strided = torch_call(strided, fixed)
        out_strided.sum().backward()
        assert torch.equal(out, out_strided)
        for name in LEARNED:
            grad = leaves[name].grad.mT if name in leaves else strided[name].grad
            assert torch.equal(grad, plain[name].grad), name

    def test_only_requested_gradients_are_returned(self):
        arrays, fixed = make_case(CASES[0], dtype=np.float32)
        inputs = tensors(arrays, requires_grad=("v", "beta"))
        torch_call(inputs, fixed).sum().backward()
        assert all(inputs[n].grad is None for n in ("q", "k", "tau", "sigma", "bias"))
        want = self._numpy_grads(arrays, fixed)
        for name in ("v", "beta"):
            np.testing.assert_array_equal(inputs[name].grad.numpy(),
                                          np.asarray(getattr(want, "d" + name), np.float32).reshape(arrays[name].shape),
                                          err_msg=name)

    def test_python_numbers_and_lse(self):
        q, k, v = (torch.randn(1, 2, 6, 4, requires_grad=True) for _ in range(3))
        out, lse = enpt.attention(q, k, v, tau=0.5, beta=1.0, return_lse=True)
        want_out, want_lse = enp.attention(q.detach().numpy(), k.detach().numpy(),
                                           v.detach().numpy(), tau=0.5, beta=1.0,
                                           return_lse=True, backend="cpu")
        assert torch.equal(out.detach(), torch.from_numpy(want_out))
        assert torch.equal(lse.detach(), torch.from_numpy(want_lse)) and lse.requires_grad

    def test_empty_rows_give_finite_lse_gradients(self):
        # Batch 0 keeps nothing: lse = log(beta), -inf for head 0 with beta = 0, which
        # takes no gradient; head 1 takes dbeta = sum exp(-lse) from every row.
        q, k, v = (torch.randn(2, 2, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
        beta = torch.tensor([0.0, 0.5], dtype=torch.float64, requires_grad=True)
        out, lse = enpt.attention(q, k, v, beta=beta, kv_lengths=torch.tensor([0, 3]), return_lse=True)
        assert torch.isneginf(lse[0, 0]).all()
        lse.backward(torch.ones_like(lse))
        for x in (q, k, v, beta):
            assert torch.isfinite(x.grad).all()
        assert not q.grad[0].any() and q.grad[1].any()
        want = torch.exp(-lse[1, 0]).sum(), torch.exp(-lse[:, 1]).sum()
        torch.testing.assert_close(beta.grad, torch.stack(want).detach(), rtol=1e-13, atol=0)

    @pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
    def test_no_grad_and_inference_mode(self, mode):
        arrays, fixed = make_case(CASES[1], dtype=np.float32)
        want = torch_call(tensors(arrays, requires_grad=()), fixed)
        with mode():
            got = torch_call(tensors(arrays), fixed)
            module = enpt.ElasticAttention(2)(*(torch.randn(1, 2, 3, 4) for _ in range(3)))
        assert torch.equal(got, want) and not got.requires_grad and not module.requires_grad

    def test_other_float_dtypes_are_refused_with_a_hint(self):
        q = torch.randn(1, 1, 3, 4).to(torch.float8_e4m3fn)
        with pytest.raises(TypeError, match=r"`q` has dtype torch.float8_e4m3fn.*\.float\(\)"):
            enpt.attention(q, q, q)
        x = torch.randn(1, 1, 3, 4)
        with pytest.raises(TypeError, match=r"`tau` has dtype .*\.float\(\)"):
            enpt.attention(x, x, x, tau=torch.ones((), dtype=torch.float8_e4m3fn))

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_halves_out_in_their_dtype_lse_in_float32_gradients(self, dtype):
        q, k, v = (torch.randn(1, 2, 9, 8, dtype=dtype, requires_grad=True) for _ in range(3))
        beta = torch.tensor([0.5, 1.0], dtype=dtype, requires_grad=True)
        out, lse = enpt.attention(q, k, v, causal=True, beta=beta, return_lse=True)
        assert out.dtype == dtype and lse.dtype == torch.float32
        arrays = [_arrays.to_numpy(x.detach()) for x in (q, k, v)]
        want, want_lse = enp.attention(*arrays, causal=True, beta=beta.detach().float().numpy(),
                                       return_lse=True, backend="cpu")
        np.testing.assert_array_equal(_arrays.to_numpy(out.detach()), want)
        np.testing.assert_array_equal(lse.detach().numpy(), want_lse)
        (out.float().sum() + lse.sum()).backward()
        assert q.grad.dtype == dtype and beta.grad.dtype == dtype and bool(torch.isfinite(q.grad).all())
        module = enpt.ElasticAttention(2, learn_tau=True)
        module(q.detach(), k.detach(), v.detach()).float().sum().backward()
        assert module.raw_tau.grad is not None

    def test_other_devices_and_bad_arguments_are_refused(self):
        meta = torch.empty(1, 1, 3, 4, device="meta")
        cpu = torch.randn(1, 1, 3, 4)
        with pytest.raises(TypeError, match="`k` is on device meta.*CPU tensors"):
            enpt.attention(cpu, meta, cpu)
        with pytest.raises(TypeError, match="`q` must be a torch.Tensor"):
            enpt.attention(cpu.numpy(), cpu, cpu)
        with pytest.raises(ValueError, match="`tau` must be finite and > 0"):
            enpt.attention(cpu, cpu, cpu, tau=torch.tensor(-1.0))
        with pytest.raises(TypeError, match="`dynamic_window`"):
            enpt.attention(cpu, cpu, cpu, dynamic_window=0.5)


class TestElasticAttention:
    def test_parametrisation_gives_the_initial_values(self):
        attn = enpt.ElasticAttention(3, tau=0.3, beta=2.0,
                                     dynamic_window=enp.DynamicWindow([0.2, 0.4, 0.6]),
                                     dtype=torch.float64)
        torch.testing.assert_close(attn.tau, torch.full((3,), 0.3, dtype=torch.float64))
        torch.testing.assert_close(attn.beta, torch.full((3,), 2.0, dtype=torch.float64))
        torch.testing.assert_close(attn.sigma, torch.tensor([0.2, 0.4, 0.6], dtype=torch.float64))

    def test_is_the_functional_call_with_its_parameters(self):
        torch.manual_seed(1)
        attn = enpt.ElasticAttention(2, tau=0.6, beta=0.4, causal=True, nvm=True,
                                     dynamic_window=enp.DynamicWindow(0.5, sharpness=3.0))
        q, k, v = (torch.randn(1, 2, 7, 4) for _ in range(3))
        want = enp.attention(q.numpy(), k.numpy(), v.numpy(), causal=True, nvm=True,
                             tau=attn.tau.detach().numpy(), beta=attn.beta.detach().numpy(),
                             dynamic_window=enp.DynamicWindow(attn.sigma.detach().numpy(), 3.0),
                             backend="cpu")
        assert torch.equal(attn(q, k, v), torch.from_numpy(want))

    def test_fixed_parameters_and_a_fixed_zero_sink(self):
        attn = enpt.ElasticAttention(2, beta=0.0, learn_beta=False, learn_tau=False)
        assert [n for n, p in attn.named_parameters() if p.requires_grad] == []
        assert torch.equal(attn.beta, torch.zeros(2))
        q = torch.randn(1, 2, 3, 4, requires_grad=True)
        attn(q, q, q).sum().backward()
        assert attn.raw_tau.grad is None and q.grad is not None

    def test_bad_initial_values(self):
        with pytest.raises(ValueError, match="`learn_beta=True` needs an initial `beta` > 0.*beta=1.0"):
            enpt.ElasticAttention(2, learn_beta=True)
        with pytest.raises(ValueError, match="`beta` must be finite and >= 0, got -1.0"):
            enpt.ElasticAttention(2, beta=-1.0)
        with pytest.raises(ValueError, match="`tau`"):
            enpt.ElasticAttention(2, tau=0.0)
        with pytest.raises(ValueError, match="`num_heads`"):
            enpt.ElasticAttention(0)

    @pytest.mark.parametrize("causal", [False, True])
    def test_defaults_are_plain_attention_with_nothing_learned(self, causal):
        torch.manual_seed(2)
        attn = enpt.ElasticAttention(4, causal=causal, backend="cpu")
        assert [n for n, p in attn.named_parameters() if p.requires_grad] == []
        assert attn.log_sigma is None
        q, k, v = (torch.randn(2, 4, 9, 8, dtype=torch.float64) for _ in range(3))
        got = attn(q, k, v)
        assert torch.equal(got, enpt.attention(q, k, v, causal=causal, backend="cpu"))
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(got, sdpa, rtol=1e-12, atol=1e-12)

    def test_each_learnable_parameter_is_opt_in(self):
        window = enp.DynamicWindow(0.5)
        for flag, name in (("learn_tau", "raw_tau"), ("learn_beta", "log_beta"), ("learn_window", "log_sigma")):
            attn = enpt.ElasticAttention(2, beta=1.0, dynamic_window=window, **{flag: True})
            assert [n for n, p in attn.named_parameters() if p.requires_grad] == [name]

    def test_heads_other_than_num_heads_name_num_heads(self):
        attn = enpt.ElasticAttention(4)
        q = torch.randn(1, 8, 3, 4)
        with pytest.raises(ValueError, match="built with num_heads=4, but `q` of shape \\(1, 8, 3, 4\\) has 8 heads"):
            attn(q, q, q)
        with pytest.raises(ValueError, match="num_heads=4"):
            attn(q[0], q[0], q[0])


def test_dropout_p_zero_is_taken_and_any_other_is_an_error_saying_dropout_is_not_supported():
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    want = enpt.attention(q, k, v, causal=True)
    for p in (0.0, 0, np.float32(0)):
        assert torch.equal(enpt.attention(q, k, v, causal=True, dropout_p=p), want), p
    for p in (0.1, 1, True, "0"):
        with pytest.raises(ValueError, match=f"`dropout_p`={p!r}: attention dropout is not supported"):
            enpt.attention(q, k, v, dropout_p=p)


def test_the_transformers_attention_takes_no_dropout_while_training():
    """transformers passes ``dropout=0.0`` (or the config's while training): 0 runs, else an error naming it."""
    from elastic_np import transformers as adapter

    module = torch.nn.Linear(1, 1).train()
    module.is_causal = True
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    want = enpt.attention(q, k, v, causal=True).transpose(1, 2)
    for dropout in (0.0, 0):
        out, weights = adapter.attention_forward(module, q, k, v, None, dropout=dropout)
        assert torch.equal(out, want) and weights is None
    with pytest.raises(ValueError, match="does not apply attention dropout \\(dropout=0.1 while training\\)"):
        adapter.attention_forward(module, q, k, v, None, dropout=0.1)
    assert torch.equal(adapter.attention_forward(module.eval(), q, k, v, None, dropout=0.1)[0], want)
