"""The CUDA backend's entry points, `forward` and `backward`: the arrays to the device, the launches, the results back.

FlashAttention's ``flash_api`` for this backend: they move the arrays to the
device, build the option arrays every kernel takes
(`elastic_np.cuda._launch.options`), allocate the outputs, launch the kernels
the plan picks (`elastic_np.cuda._launch.plan`) and bring the results back.
Imports no ``numba.cuda``: the kernel modules are imported on first use
(`elastic_np.cuda._runtime.gpu.kernel_module`).
"""

import dataclasses

import numpy as np

from elastic_np.cuda._device.indices import P_DSIGMA, P_DTAU
from elastic_np.cuda._launch import backward as backward_launch
from elastic_np.cuda._launch import decode as decode_launch
from elastic_np.cuda._launch import forward as forward_launch
from elastic_np.cuda._launch import plan
from elastic_np.cuda._launch.arrays import is_device, to_device
from elastic_np.cuda._launch.options import dbias_shape, launch_options
from elastic_np.cuda._runtime.gpu import cuda_module


def forward(p):
    """Run the forward kernels on a validated problem; return ``(out, lse)``.

    Decoding shapes (`elastic_np.cuda._launch.plan.takes_decode`) go to the decode
    kernels, the others to the flash forward. NumPy arrays for a NumPy
    problem, device arrays for a device problem.
    """
    cuda = cuda_module()
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.dtype
    on_device = any(is_device(a) for a in (p.q, p.bias))
    q, k, v = (to_device(a) for a in (p.q, p.k, p.v))
    out = cuda.device_array((B, H, N, Dv), dtype=dtype)
    lse = cuda.device_array((B, H, N), dtype=dtype)
    if B * H * N > 0:
        family = decode_launch if plan.takes_decode(p) else forward_launch
        family.launch(p, launch_options(p)[0], q, k, v, out, lse)
    if on_device:
        return out, lse
    return out.copy_to_host(), lse.copy_to_host()


def backward(p, dout, out, lse, dlse=None):
    """Run the backward kernels; return `~elastic_np.AttentionGrads`.

    ``dq``, ``dk``, ``dv`` (and ``dbias``, in the bias's shape) are device
    arrays when any of the arrays is one, NumPy arrays otherwise; ``dtau``,
    ``dbeta``, ``dsigma`` are always on the host, in the shapes of ``tau``,
    ``beta``, ``sigma``.
    """
    B, H, Hkv, N, M, D, Dv = p.shape
    on_device = any(is_device(a) for a in (p.q, dout, out, lse, dlse, p.bias))
    # zeros for no dlse: delta - 0 is delta, bit for bit
    dlse = np.zeros((B, H, N), dtype=p.dtype) if dlse is None else dlse
    arrays = tuple(to_device(a) for a in (p.q, p.k, p.v, dout, out, lse, dlse))
    grads = backward_launch.outputs(p)
    if B * H * max(N, M) > 0:
        opts, bias_compact = launch_options(p)
        backward_launch.launch(p, opts, bias_compact, arrays, grads)
    if p.bias is not None and grads["dbias"] is None:  # nothing to sum: an empty problem
        grads["dbias"] = cuda_module().to_device(np.zeros(dbias_shape(p), dtype=p.dtype))
    return _backward_result(p, grads, arrays[5], on_device)


def _backward_result(p, grads, lse, on_device):
    """`~elastic_np.AttentionGrads` from the backward's outputs (`backward_launch.outputs`).

    ``dtau`` and ``dsigma`` are summed from the dq blocks' partials, ``dbeta``
    formed from ``delta`` and ``lse``, all on the host in float64; the arrays
    are copied to the host unless ``on_device``.
    """
    dq, dk, dv, dbias = grads["dq"], grads["dk"], grads["dv"], grads["dbias"]
    partials = grads["partials"].astype(np.float64)
    dtau_h = -(partials[..., P_DTAU].sum(axis=(0, 2)) / p.tau) / p.tau  # tau**2 may underflow
    # dbeta on the host in float64: exp(-lse) overflows float32 once lse < -88.7
    dbeta_h = p.sink_gradient(grads["delta"].copy_to_host(), lse.copy_to_host())
    dsigma_bh = partials[..., P_DSIGMA].sum(axis=2) if p.sigma is not None else None
    if not on_device:
        dq, dk, dv = dq.copy_to_host(), dk.copy_to_host(), dv.copy_to_host()
        if dbias is not None:
            dbias = dbias.copy_to_host().reshape(dbias_shape(p))
        return p.reduce_grads(dq, dk, dv, dtau_h, dbeta_h, dsigma_bh, dbias=dbias)
    result = dataclasses.replace(p, bias=None).reduce_grads(dq, dk, dv, dtau_h, dbeta_h, dsigma_bh)
    if dbias is not None:
        dbias = dbias.reshape(p.bias_shape)
    return dataclasses.replace(result, dbias=dbias)
