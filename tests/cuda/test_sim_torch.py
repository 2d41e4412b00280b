"""elastic_np.torch's CUDA path on the CUDA simulator.

CPU tensors stand in for CUDA tensors: `SimBridge` replaces the adapter's
``_cuda_bridge`` (the only code that touches device memory and streams) with
one that copies a tensor to a simulator device array and back. The routing,
validation, autograd and the handling of every gradient are the adapter's own
code, and the kernels are the CUDA backend's. The bridge itself (the
interface, torch's streams) is not exercised: that needs a GPU
(``tests/test_torch_cuda.py``).
"""

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_torch_adapter import CASES, LEARNED, make_case, numpy_options, tensors, torch_call

import elastic_np as enp
import elastic_np.torch as enpt
from elastic_np._api import dispatch
from elastic_np.torch import _arrays
from elastic_np.cuda._launch import arrays as cuda_arrays
from elastic_np.cuda._runtime import gpu as cuda_host

pytestmark = pytest.mark.usefixtures("small_tiles")


class SimBridge:
    """`elastic_np.torch._CudaBridge` for CPU tensors: copies to the simulator's device arrays and back."""

    device_type = "cpu"

    def __init__(self):
        self.sent = []  # the tensors handed to the backend
        self.launches_on = []

    def to_device(self, tensor):
        self.sent.append(tensor)
        return cuda_host.cuda_module().to_device(tensor.numpy())  # refuses a non-contiguous array

    def to_tensor(self, array, device):
        assert cuda_arrays.is_device(array)
        return torch.from_numpy(array.copy_to_host()).to(device)

    def launches(self, device):
        self.launches_on.append(device)
        return contextlib.nullcontext()


def simulate(monkeypatch):
    bridge = SimBridge()
    monkeypatch.setattr(_arrays, "_cuda_bridge", bridge)
    return bridge


def run(arrays, fixed, requires_grad=LEARNED, seed=5, **extra):
    """``out``, ``lse`` and the gradient of every input of a loss on both, through the adapter."""
    inputs = tensors(arrays, requires_grad)
    out, lse = torch_call(inputs, fixed, return_lse=True, **extra)
    rng = np.random.default_rng(seed)
    dout = torch.from_numpy(rng.standard_normal(out.shape).astype(arrays["q"].dtype))
    dlse = torch.from_numpy(rng.standard_normal(lse.shape).astype(arrays["q"].dtype))
    torch.autograd.backward([out, lse], [dout, dlse])
    return out.detach(), lse.detach(), {n: inputs[n].grad for n in LEARNED}, dout, dlse


class TestAgainstTheOtherPaths:
    @pytest.mark.parametrize("case", CASES)
    def test_float64_forward_and_every_gradient_match_the_reference(self, monkeypatch, case):
        arrays, fixed = make_case(case, seed=2)
        want_out, want_lse, want_grads, _, _ = run(arrays, fixed, backend="reference")  # CPU tensors
        bridge = simulate(monkeypatch)
        out, lse, grads, _, _ = run(arrays, fixed)
        assert bridge.launches_on == [torch.device("cpu")] * 2  # one forward, one backward
        torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
        for name in LEARNED:
            assert grads[name].dtype == torch.float64 and grads[name].shape == arrays[name].shape, name
            torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-12, atol=1e-12, msg=name)

    @pytest.mark.parametrize("case", CASES)
    def test_float32_gives_the_numpy_cuda_entry_points_bits(self, monkeypatch, case):
        arrays, fixed = make_case(case, dtype=np.float32)
        simulate(monkeypatch)
        out, lse, grads, dout, dlse = run(arrays, fixed)

        options = numpy_options(arrays, fixed)
        qkv = arrays["q"], arrays["k"], arrays["v"]
        want_out, want_lse = enp.attention(*qkv, return_lse=True, backend="cuda", **options)
        want = enp.attention_backward(dout.numpy(), *qkv, want_out, want_lse, dlse=dlse.numpy(),
                                      backend="cuda", **options)
        np.testing.assert_array_equal(out.numpy(), want_out)
        np.testing.assert_array_equal(lse.numpy(), want_lse)
        for name in LEARNED:
            assert grads[name].dtype == torch.float32, name
            expected = np.asarray(getattr(want, "d" + name), dtype=np.float32).reshape(arrays[name].shape)
            np.testing.assert_array_equal(grads[name].numpy(), expected, err_msg=name)

    def test_a_loss_of_lse_alone(self, monkeypatch):
        # out takes no part: its cotangent is None, and zeros go to the backend
        arrays, fixed = make_case(CASES[1], seed=4)

        def grads_of_lse():
            inputs = tensors(arrays)
            torch_call(inputs, fixed, return_lse=True)[1].sum().backward()
            return {n: inputs[n].grad for n in LEARNED}

        want = grads_of_lse()
        simulate(monkeypatch)
        got = grads_of_lse()
        for name in LEARNED:
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)

    def test_strided_tensors_and_only_the_requested_gradients(self, monkeypatch):
        arrays, fixed = make_case(CASES[0], dtype=np.float32)
        simulate(monkeypatch)
        plain = tensors(arrays, requires_grad=("q", "v", "beta"))
        torch_call(plain, fixed).sum().backward()  # the cotangent is an expanded, zero-stride tensor
        strided = tensors(arrays, requires_grad=("q", "v", "beta"))
        leaves = {}
        for name in ("q", "k", "v", "bias"):
            leaves[name] = strided[name].detach().mT.contiguous().requires_grad_(name in ("q", "v"))
            strided[name] = leaves[name].mT
        assert not strided["q"].is_contiguous()
        torch_call(strided, fixed).sum().backward()
        for name in ("q", "v"):
            assert torch.equal(leaves[name].grad.mT, plain[name].grad), name
        assert torch.equal(strided["beta"].grad, plain["beta"].grad)
        for inputs in (plain, strided):
            assert all(inputs[n].grad is None for n in ("k", "tau", "sigma", "bias"))


class TestRouting:
    def test_auto_hands_the_tensors_memory_to_the_cuda_backend(self, monkeypatch):
        seen = {}
        for entry in ("attention", "attention_backward"):
            real = getattr(dispatch, entry)

            def spy(*arrays, _real=real, _entry=entry, **options):
                seen[_entry] = (arrays, options)
                return _real(*arrays, **options)

            monkeypatch.setattr(dispatch, entry, spy)
        bridge = simulate(monkeypatch)
        arrays, fixed = make_case(CASES[0], dtype=np.float32)
        inputs = tensors(arrays)
        out, lse = torch_call(inputs, fixed, return_lse=True)
        (out.sum() + lse.sum()).backward()

        forward, options = seen["attention"]
        assert options["backend"] == "cuda" and cuda_arrays.is_device(options["bias"])
        assert all(cuda_arrays.is_device(a) for a in forward)
        assert all(isinstance(options[n], np.ndarray) for n in ("tau", "beta"))  # read on the host
        backward, options = seen["attention_backward"]
        assert options["backend"] == "cuda" and cuda_arrays.is_device(options["dlse"])
        assert len(backward) == 6 and all(cuda_arrays.is_device(a) for a in backward)
        # contiguous tensors are handed over as they are, not copied
        pointers = {t.data_ptr() for t in bridge.sent}
        for name in ("q", "k", "v", "bias"):
            assert inputs[name].data_ptr() in pointers, name
        assert out.data_ptr() in pointers and lse.data_ptr() in pointers

    @pytest.mark.parametrize("backend", ["cpu", "reference"])
    def test_a_host_backend_is_refused(self, monkeypatch, backend):
        simulate(monkeypatch)
        q = torch.randn(1, 1, 3, 4)
        with pytest.raises(TypeError, match=rf"`q` is on device cpu, and backend='{backend}' takes CPU tensors"):
            enpt.attention(q, q, q, backend=backend)

    def test_tensors_on_another_device_are_refused_by_name(self, monkeypatch):
        simulate(monkeypatch)
        q = torch.randn(1, 1, 3, 4)
        meta = torch.empty(1, 1, 3, 4, device="meta")
        with pytest.raises(TypeError, match="`v` is on device meta and `q` on cpu"):
            enpt.attention(q, q, meta)
        with pytest.raises(TypeError, match="`bias` is on device meta and `q` on cpu"):
            enpt.attention(q, q, q, bias=torch.empty(3, 3, device="meta"))
        with pytest.raises(TypeError, match="`beta` is on device meta"):
            enpt.attention(q, q, q, beta=torch.ones((), device="meta"))
        with pytest.raises(TypeError, match="`mask` is on device meta"):
            enpt.attention(q, q, q, mask=torch.ones(3, 3, dtype=torch.bool, device="meta"))

    def test_a_second_derivative_is_refused(self, monkeypatch):
        simulate(monkeypatch)
        q = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
        (dq,) = torch.autograd.grad(enpt.attention(q, q, q).square().sum(), q, create_graph=True)
        with pytest.raises(enp.BackendUnavailableError, match="the CUDA backend has no double backward"):
            torch.autograd.grad(dq.sum(), q)

    def test_half_dtypes_are_refused_with_a_hint(self, monkeypatch):
        simulate(monkeypatch)
        q = torch.randn(1, 1, 3, 4)
        with pytest.raises(TypeError, match=r"`k` has dtype torch.float16.*\.float\(\)"):
            enpt.attention(q, q.half(), q)
        with pytest.raises(TypeError, match=r"`tau` has dtype torch.bfloat16.*\.float\(\)"):
            enpt.attention(q, q, q, tau=torch.ones((), dtype=torch.bfloat16))
        with pytest.raises(TypeError, match=r"`bias` has dtype torch.float16"):
            enpt.attention(q, q, q, bias=torch.zeros(3, 3, dtype=torch.float16))


def test_bnhd_tensors_are_transposed_on_the_device_and_back(monkeypatch):
    bridge = simulate(monkeypatch)
    rng = np.random.default_rng(8)
    arrays = [rng.standard_normal(shape) for shape in ((1, 19, 4, 8), (1, 23, 2, 8), (1, 23, 2, 8))]
    given = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = enpt.attention(*given, layout="bnhd", causal=True, beta=0.5)
    out.square().sum().backward()
    swapped = [torch.tensor(np.ascontiguousarray(a.transpose(0, 2, 1, 3)), requires_grad=True) for a in arrays]
    want = enpt.attention(*swapped, causal=True, beta=0.5)
    want.square().sum().backward()
    assert torch.equal(out, want.transpose(1, 2)) and out.shape == given[0].shape
    for got, expected in zip(given, swapped):
        assert torch.equal(got.grad, expected.grad.transpose(1, 2))
    assert all(t.is_contiguous() for t in bridge.sent)  # what reached the kernels: (B, H, N, D), contiguous
