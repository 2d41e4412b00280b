"""elastic_np.torch on CUDA tensors: the errors without a GPU, and gradcheck on one.

The CUDA path's logic runs on the CUDA simulator in
``tests/cuda/test_sim_torch.py``. `TestOnAGpu` needs torch with CUDA and a
usable CUDA backend, and skips elsewhere: it has never run.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from adapter_cases import CASES, LEARNED, make_case, tensors, torch_call

import elastic_np as enp
import elastic_np.torch as enpt
from elastic_np._api import dispatch

GPU = torch.cuda.is_available() and dispatch.cuda_is_available()


def fake_cuda(*shape):
    """A float32 tensor on device cuda:0 without memory or a GPU (torch's FakeTensor)."""
    fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")
    with fake_tensor.FakeTensorMode():
        return torch.empty(*shape, device="cuda")


class TestWithoutAGpu:
    @pytest.mark.skipif(dispatch.cuda_is_available(), reason="the CUDA backend is usable here")
    def test_cuda_tensors_raise_a_clear_error(self):
        q = fake_cuda(1, 2, 3, 4)
        with pytest.raises(enp.BackendUnavailableError, match=r"backend 'cuda'.*elastic_np\[cuda\]"):
            enpt.attention(q, q, q)
        with pytest.raises(enp.BackendUnavailableError, match=r"backend 'cuda'"):
            enpt.ElasticAttention(2)(q, q, q)

    def test_mixed_devices_and_host_backends_are_refused_by_name(self):
        q = fake_cuda(1, 1, 3, 4)
        cpu = torch.randn(1, 1, 3, 4)
        with pytest.raises(TypeError, match="`k` is on device cpu and `q` on cuda:0"):
            enpt.attention(q, cpu, q)
        with pytest.raises(TypeError, match="`v` is on device cuda:0; elastic_np.torch takes CPU tensors, or CUDA"):
            enpt.attention(cpu, cpu, q)
        with pytest.raises(TypeError, match="`q` is on device cuda:0, and backend='cpu' takes CPU tensors"):
            enpt.attention(q, q, q, backend="cpu")


def cuda_tensors(arrays, requires_grad=LEARNED):
    return {n: torch.tensor(a, device="cuda", requires_grad=n in requires_grad) for n, a in arrays.items()}


def loss_of(out, lse):
    return out.square().sum() + (lse * torch.linspace(-1, 1, lse.shape[-1], dtype=lse.dtype,
                                                      device=lse.device)).sum()


@pytest.mark.skipif(not GPU, reason="needs torch with CUDA and a usable CUDA backend")
class TestOnAGpu:
    @pytest.mark.parametrize("case", CASES)
    def test_gradcheck_of_every_input(self, case):
        arrays, fixed = make_case(case)
        inputs = cuda_tensors(arrays)

        def f(*values):
            return torch_call(dict(zip(LEARNED, values)), fixed, return_lse=True)

        assert torch.autograd.gradcheck(f, tuple(inputs[n] for n in LEARNED))

    @pytest.mark.parametrize("case", CASES)
    def test_in_place_and_against_the_reference(self, monkeypatch, case):
        seen = {}
        real = dispatch.attention

        def spy(q, k, v, **options):
            result = real(q, k, v, **options)
            seen.update(q=q, out=result[0])
            return result

        arrays, fixed = make_case(case, seed=2)
        oracle = tensors(arrays)
        loss_of(*torch_call(oracle, fixed, return_lse=True, backend="reference")).backward()
        monkeypatch.setattr(dispatch, "attention", spy)
        inputs = cuda_tensors(arrays)
        out, lse = torch_call(inputs, fixed, return_lse=True)
        assert out.device == lse.device == inputs["q"].device
        assert seen["q"].__cuda_array_interface__["data"][0] == inputs["q"].data_ptr()  # no copy in
        assert seen["out"].__cuda_array_interface__["data"][0] == out.data_ptr()  # no copy out
        loss_of(out, lse).backward()
        for name in LEARNED:
            grad = inputs[name].grad
            assert grad.device == inputs[name].device and grad.shape == inputs[name].shape, name
            torch.testing.assert_close(grad.cpu(), oracle[name].grad, rtol=1e-12, atol=1e-12, msg=name)

    def test_a_side_stream_gives_the_default_streams_bits(self):
        arrays, fixed = make_case(CASES[0], dtype=np.float32)

        def step():
            base = cuda_tensors(arrays, requires_grad=())
            # the inputs are written on the current stream, just before the call
            inputs = {n: (t * 1).requires_grad_() for n, t in base.items()}
            out, lse = torch_call(inputs, fixed, return_lse=True)
            loss_of(out * 1, lse).backward()
            return [out.detach().clone(), *(inputs[n].grad.clone() for n in LEARNED)]

        want = step()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            got = step()
        torch.cuda.synchronize()
        for name, a, b in zip(("out", *LEARNED), got, want):
            assert torch.equal(a, b), name

    def test_module_parameters_on_the_gpu_get_their_gradients_there(self):
        attn = enpt.ElasticAttention(4, tau=0.7, beta=1.0, causal=True, learn_tau=True, learn_beta=True,
                                     dynamic_window=enp.DynamicWindow(0.5, sharpness=4.0), learn_window=True).cuda()
        q, k, v = (torch.randn(2, 4, 33, 16, device="cuda", requires_grad=True) for _ in range(3))
        attn(q, k, v).square().mean().backward()
        for name, p in [*attn.named_parameters(), ("q", q), ("k", k), ("v", v)]:
            assert p.grad.is_cuda and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
