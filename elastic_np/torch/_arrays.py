"""How torch tensors reach the elastic_np backends and come back (`elastic_np.torch`'s plumbing).

CPU tensors reach the kernels through ``Tensor.numpy()``, without a copy when
they are C-contiguous, and the results come back through
``torch.from_numpy`` (bfloat16 through ``ml_dtypes.bfloat16``, and the float8
of a quantized ``k`` and ``v`` through ``ml_dtypes.float8_e4m3fn`` and
``ml_dtypes.float8_e5m2``, each as a view of its bits: `to_numpy`,
`from_numpy`). CUDA tensors (``q``, ``k``, ``v`` and a tensor ``bias``
on one device) go through the CUDA backend in place (`_CudaBridge`), and the
results come back as tensors on that device over the memory the kernels
wrote.
"""

import contextlib
import dataclasses

import numpy as np
import torch

from elastic_np._api import adapters as common
from elastic_np._api import dispatch
from elastic_np._contract import _quantized, _validation

#: The dtypes of tensors on the CPU (the CPU kernels compute in float32 for the halves) and on a GPU.
_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.float32, torch.float64)
#: The float8 dtypes of a quantized cache, by the name of their ``ml_dtypes`` dtype (viewed through uint8).
_FLOAT8 = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
#: The quantized dtypes of ``k`` and ``v`` by their names (`elastic_np.quantize_kv`'s ``dtype``).
QUANTIZED = {torch.int8: "int8", **_FLOAT8}
#: The dtypes of ``k`` and ``v`` on the CPU: those of `_CPU_DTYPES` and float8 (int8 is no float: never refused).
_CACHE_DTYPES = _CPU_DTYPES + tuple(_FLOAT8)
#: The tensors that may be a quantized cache (with their scales ``k_scale`` and ``v_scale``).
CACHES = ("k", "v")


def _check_dtype(value, name, taken=_CPU_DTYPES):
    if value.is_floating_point() and value.dtype not in taken:
        names = ", ".join(str(d) for d in taken)
        raise TypeError(f"`{name}` has dtype {value.dtype}; elastic_np takes {names} on its device "
                        "(the CUDA kernels: no bfloat16 or float16 yet): convert it with .float()")


def lse_dtype(dtype):
    """The dtype of ``lse`` for inputs of ``dtype``: float32 for bfloat16 and float16."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def to_numpy(tensor):
    """A CPU tensor as a NumPy array over its memory (bfloat16 and float8 as their ``ml_dtypes`` dtypes)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_validation.numpy_dtype("bfloat16"))
    if tensor.dtype in _FLOAT8:
        return tensor.view(torch.uint8).numpy().view(_quantized.storage_dtype(_FLOAT8[tensor.dtype]))
    return tensor.numpy()


def from_numpy(array):
    """A NumPy array as a CPU tensor over its memory (``ml_dtypes.bfloat16`` and float8 as torch's dtypes)."""
    name = _validation.dtype_name(array.dtype)
    if name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    if name in _FLOAT8.values():
        return torch.from_numpy(array.view(np.uint8)).view(getattr(torch, name))
    return torch.from_numpy(array)


def check_on_cpu(value, name, taken=_CPU_DTYPES):
    """``value`` if it is no tensor or a CPU tensor of a dtype of ``taken``, else a `TypeError` naming it."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError(
                f"`{name}` is on device {value.device}; elastic_np.torch takes CPU tensors, or CUDA "
                "tensors with q, k, v (and bias) on one device: move it with .cpu()"
            )
        _check_dtype(value, name, taken)
    return value


def check_devices(device, named, caches=()):
    """Raise a `TypeError` naming a tensor of ``named`` (``(name, value)`` pairs) that the backend cannot read.

    ``device`` is None for the CPU backends (every tensor on the CPU), else
    the CUDA device of ``q``: ``bias`` must be on it, the other options on it
    or the CPU. The tensors named in ``caches`` (`CACHES` where the call
    takes a quantized cache) may also be float8 on the CPU.
    """
    for name, value in named:
        if device is not None and name == "bias":
            _device_tensor(value, name, device)
        elif device is None or (isinstance(value, torch.Tensor) and value.device != device):
            check_on_cpu(value, name, _CACHE_DTYPES if name in caches else _CPU_DTYPES)


def _host(value, name):
    """A CPU tensor as a NumPy view (no copy), anything else as it is (``k`` and ``v`` may be float8)."""
    if not isinstance(value, torch.Tensor):
        return value
    check_on_cpu(value, name, _CACHE_DTYPES if name in CACHES else _CPU_DTYPES)
    return to_numpy(value.detach().resolve_neg())


def _as_grad(grad, like):
    """A NumPy gradient (or Python float) as a tensor of ``like``'s dtype and shape."""
    return from_numpy(np.asarray(grad)).to(like.dtype).reshape(like.shape)


# ---------------------------------------------------------------------------
# CUDA tensors: the CUDA backend on their memory
# ---------------------------------------------------------------------------


class _CudaBridge:
    """How CUDA tensors reach the CUDA backend and how its device arrays come back as tensors.

    The only code that touches device memory and streams. A test swaps it for
    one that copies CPU tensors to the CUDA simulator
    (``tests/cuda/test_sim_torch.py``), so that everything else runs without a GPU.
    """

    #: Tensors of this device type go through the CUDA backend.
    device_type = "cuda"

    @staticmethod
    def to_device(tensor):
        """A detached, C-contiguous CUDA tensor as a numba device array over its memory."""
        from elastic_np.cuda._runtime import gpu as cuda_host

        # torch exports version 2 of the interface, without a stream: numba does not synchronise
        return cuda_host.cuda_module().as_cuda_array(tensor)

    @staticmethod
    def to_tensor(array, device):
        """A numba device array as a tensor on ``device`` over the same memory (no copy)."""
        return torch.as_tensor(array, device=device)

    @staticmethod
    @contextlib.contextmanager
    def launches(device):
        """Around the backend's calls: numba on ``device``, its kernels ordered with torch's stream."""
        from elastic_np.cuda._runtime import gpu as cuda_host

        cuda = cuda_host.cuda_module()
        stream = torch.cuda.current_stream(device)
        # numba launches on the legacy default stream, which torch's default stream is: there
        # the kernels queue after the work that wrote the inputs and before the work that reads
        # the outputs. torch's other streams are non-blocking and do not wait for it, so on one
        # we synchronise: torch's stream before (the inputs are written) and the device after
        # (the outputs are written, and the inputs are read before torch may reuse their memory).
        # Simple and correct; it costs the overlap of the host with the device on those streams.
        side_stream = stream.cuda_stream != 0
        with cuda.gpus[device.index]:
            if side_stream:
                stream.synchronize()
            try:
                yield
            finally:
                if side_stream:
                    cuda.synchronize()


_cuda_bridge = _CudaBridge


def _cuda_device(q, k, v, backend):
    """The device of CUDA tensors ``q, k, v`` (checked to be one), None for other tensors."""
    device = q.device
    if device.type != _cuda_bridge.device_type:
        return None
    for name, x in (("k", k), ("v", v)):
        if x.device != device:
            raise TypeError(
                f"`{name}` is on device {x.device} and `q` on {device}: q, k and v must be on one device"
            )
    if backend not in ("auto", "cuda"):
        raise TypeError(
            f"`q` is on device {device}, and backend={backend!r} takes CPU tensors: use "
            "backend='cuda' (or 'auto') for CUDA tensors, or move them with .cpu()"
        )
    dispatch.get_backend("cuda")  # BackendUnavailableError, saying what is missing
    return device


def _option(value, name, device):
    """An option tensor on the CPU or ``device`` as a NumPy array (the CUDA backend reads it on the host)."""
    if not isinstance(value, torch.Tensor) or value.device != device:
        return _host(value, name)
    _check_dtype(value, name, _CUDA_DTYPES)
    return to_numpy(value.detach().resolve_neg().cpu())


def _device_tensor(value, name, device):
    """A tensor on ``device``, detached and C-contiguous; anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.device != device:
        raise TypeError(
            f"`{name}` is on device {value.device} and `q` on {device}: q, k, v and bias must be on one device"
        )
    _check_dtype(value, name, _CUDA_DTYPES)
    return value.detach().resolve_neg().contiguous()


def _device_array(value):
    return _cuda_bridge.to_device(value) if isinstance(value, torch.Tensor) else value


def _cuda_options(learnable, device):
    """The learnable options for the CUDA backend: tau, beta, sigma on the host, bias on the device."""
    options = {name: _option(learnable[name], name, device) for name in ("tau", "beta", "sigma")}
    options["bias"] = _device_tensor(learnable["bias"], "bias", device)
    return options


def _bhnd(tensors):
    """4-D tensors of ``layout="bnhd"`` as ``(B, H, N, D)`` views (their own inverse); others as they are."""
    return [x.transpose(1, 2) if isinstance(x, torch.Tensor) and x.dim() == 4 else x for x in tensors]


def _cuda_forward(fixed, device, qkv, learnable):
    """``(out, lse)`` of the CUDA backend on the memory of ``q, k, v``, as tensors on ``device``.

    The CUDA kernels read ``(B, H, N, D)``: with ``layout="bnhd"`` the tensors
    are transposed on the device (`_device_tensor` makes them contiguous, one
    copy each) and ``out`` comes back transposed.
    """
    if fixed["layout"] == "bnhd":
        out, lse = _cuda_forward(dict(fixed, layout="bhnd"), device, _bhnd(qkv), learnable)
        return out.transpose(1, 2), lse
    options = _cuda_options(learnable, device)
    qkv = [_device_tensor(x, name, device) for x, name in zip(qkv, ("q", "k", "v"))]
    with _cuda_bridge.launches(device):
        options["bias"] = _device_array(options["bias"])
        out, lse = dispatch.attention(
            *map(_device_array, qkv), return_lse=True, **common.numpy_options(fixed, options)
        )
        return _cuda_bridge.to_tensor(out, device), _cuda_bridge.to_tensor(lse, device)


def _cuda_backward(fixed, device, arrays, dlse, learnable):
    """`elastic_np.AttentionGrads` of the CUDA backend, ``dq, dk, dv, dbias`` as tensors on ``device``.

    ``arrays`` are ``dout, q, k, v, out, lse``; ``layout="bnhd"`` as in `_cuda_forward`.
    """
    if fixed["layout"] == "bnhd":
        grads = _cuda_backward(dict(fixed, layout="bhnd"), device, _bhnd(arrays), dlse, learnable)
        dq, dk, dv = _bhnd((grads.dq, grads.dk, grads.dv))
        return dataclasses.replace(grads, dq=dq, dk=dk, dv=dv)
    options = _cuda_options(learnable, device)
    names = ("dout", "q", "k", "v", "out", "lse", "dlse")
    tensors = [_device_tensor(x, name, device) for x, name in zip((*arrays, dlse), names)]
    with _cuda_bridge.launches(device):
        options["bias"] = _device_array(options["bias"])
        *arrays, dlse = map(_device_array, tensors)
        grads = dispatch.attention_backward(*arrays, dlse=dlse, **common.numpy_options(fixed, options))
        on_device = {name: getattr(grads, name) for name in ("dq", "dk", "dv", "dbias")}
        return dataclasses.replace(grads, **{
            name: None if a is None else _cuda_bridge.to_tensor(a, device) for name, a in on_device.items()
        })


def _cuda_grad(grad, like):
    """A gradient of the CUDA path (a device tensor, or a host float or array) as a tensor like ``like``."""
    if isinstance(grad, torch.Tensor):
        return grad.to(like.dtype).reshape(like.shape)
    return _as_grad(grad, like).to(like.device)
