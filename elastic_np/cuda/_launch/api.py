"""The CUDA backend's entry points, `forward` and `backward`, and what every launch shares.

FlashAttention's ``flash_api`` for this backend: `forward` and `backward`
move the arrays to the device, build the option arrays every kernel takes
(`_launch_options`: the window and gate bands, the bias operand), allocate
the outputs, pick the kernel family and bring the results back. Each family
keeps its kernels and its host code side by side:

- the flash forward: `elastic_np.cuda._forward` (kernel),
  `elastic_np.cuda._forward_launch` (tiles, shared memory, launch);
- decoding shapes: `elastic_np.cuda._decode` (kernels),
  `elastic_np.cuda._decode_launch` (`takes`, geometry, splits, launch);
- the backward: `elastic_np.cuda._backward` (kernels),
  `elastic_np.cuda._backward_launch` (tiles, shared memory, launches).

Imports no ``numba.cuda``, and neither do the ``_*_launch`` modules: the
kernel modules are imported on first use
(`elastic_np.cuda._host._kernel_module`).
"""

import collections
import dataclasses
import math
import threading

import numpy as np

from elastic_np._contract._compact import compact_bias, compact_mask, element_strides
from elastic_np._contract._ranges import offset_band
from elastic_np.cuda._launch import backward as _backward_launch
from elastic_np.cuda._launch import decode as _decode_launch
from elastic_np.cuda._launch import forward as _forward_launch
from elastic_np.cuda._runtime import config
from elastic_np.cuda._runtime.gpu import _cuda, _current_device_id, _is_device, _kernel_module, _to_device

# ---------------------------------------------------------------------------
# What every launch shares: the option arrays, the bias operand
# ---------------------------------------------------------------------------


def _window_band(p):
    """Per-(b, h) half-width, in keys, of the band where the window's bell exceeds the threshold.

    ``f > threshold`` holds exactly where ``|x| < sigma sqrt(-2 log c)`` with
    ``c = threshold sigma sqrt(2 pi)`` (nowhere when ``c >= 1``); ``x`` moves
    by ``2 / (E_b - 1)`` per key (``E_b``: ``M``, or ``kv_lengths[b]`` with
    ``align="kv_lengths"``; ``x = 0`` for ``E_b <= 1``). One key of margin
    keeps the band conservative; the kernels still test the gate entry by
    entry. -1 means unbounded.
    """
    B, H, Hkv, N, M, D, Dv = p.shape
    band = np.full((B, H), -1, dtype=np.int64)
    if p.sigma is None or p.threshold <= 0:
        return band
    c = p.threshold * p.sigma * math.sqrt(2 * math.pi)
    ends = p.kv_ends[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        half_width_x = p.sigma * np.sqrt(np.maximum(-2.0 * np.log(np.minimum(c, 1.0)), 0.0))
    half_width = np.minimum(np.floor(half_width_x * np.maximum(ends - 1, 0) / 2.0) + 1, M + N)
    band[...] = np.where(c >= 1.0, 0, np.where(ends > 1, half_width, -1)).astype(np.int64)
    return band


def _gate_band(p):
    """`_window_band` as offsets ``[-w, w]`` per ``(b, h)`` (None without a bounded band)."""
    half = _window_band(p)
    if (half < 0).all():
        return None
    B, H, Hkv, N, M, D, Dv = p.shape
    bounded = half >= 0
    band = np.empty(half.shape + (2,), dtype=np.int64)
    band[..., 0] = np.where(bounded, -half, -(M + 1))
    band[..., 1] = np.where(bounded, half, N + 1)
    return band


def _launch_options(p):
    """``(opts, bias_compact)``: the option arrays every kernel takes, on the device, and the bias's compact shape.

    ``opts`` is one tuple, indexed by the ``O_*`` constants of
    `elastic_np.cuda._device` (`elastic_np.cuda._kernels` describes each
    array); ``bias_compact`` is `_bias_operand`'s (None without a bias).
    Without a bias the arrays come from `_device_plan`: copied to the device
    once per distinct set of values, so that repeated calls (decoding steps)
    copy nothing but their inputs.
    """
    dev = _kernel_module("_device.score")
    dtype = p.dtype
    bias, bias_strides, bias_compact = _bias_operand(p)
    if p.mask is None:
        mask = np.ones((1, 1, 1, 1), dtype=np.uint8)
    else:
        mask = compact_mask(p.mask)[0].view(np.uint8)  # 1 on broadcast axes, read by its shape
    host = [None] * dev.O_COUNT
    host[dev.O_MASK] = mask
    host[dev.O_KV_LENGTHS] = np.ascontiguousarray(p.kv_lengths, dtype=np.int64)
    host[dev.O_BAND] = offset_band(p, _gate_band(p))
    host[dev.O_IOPTS] = _int_options(p, dev, bias_strides, bias_compact)
    host[dev.O_FOPTS] = _float_options(p, dev)
    host[dev.O_TAU] = p.tau.astype(dtype)
    host[dev.O_BETA] = p.beta.astype(dtype)
    host[dev.O_BH_CONSTS] = _bh_consts(p, dev)
    if p.bias is None:
        host[dev.O_BIAS] = bias
        return _device_plan(host), None
    opts = list(_device_plan(host[: dev.O_BIAS] + host[dev.O_BIAS + 1 :], keep=False))
    opts.insert(dev.O_BIAS, bias if _is_device(bias) else _cuda().to_device(bias))
    return tuple(opts), bias_compact


_plans = collections.OrderedDict()  # key of the host arrays -> the same arrays on the device
_plans_lock = threading.Lock()


def _device_plan(host, keep=True):
    """The NumPy arrays ``host`` on the current device, as a tuple; copied once per distinct values.

    With ``keep`` and at most ``config.PLAN_MAX_BYTES`` in all, the copies
    are kept, keyed by the device and each array's dtype, shape and bytes,
    for the last ``config.PLAN_CACHE_SIZE`` distinct sets: the kernels only
    read them, so one copy serves every call with the same values.
    """
    cuda = _cuda()
    host = [np.ascontiguousarray(a) for a in host]
    if not keep or sum(a.nbytes for a in host) > config.PLAN_MAX_BYTES or config.PLAN_CACHE_SIZE < 1:
        return tuple(cuda.to_device(a) for a in host)
    key = (_current_device_id(),) + tuple((a.dtype.str, a.shape, a.tobytes()) for a in host)
    with _plans_lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
            return plan
    plan = tuple(cuda.to_device(a) for a in host)
    with _plans_lock:
        _plans[key] = plan
        while len(_plans) > config.PLAN_CACHE_SIZE:
            _plans.popitem(last=False)
    return plan


def _int_options(p, dev, bias_strides, bias_compact):
    """``iopts``: the integer options, indexed by the ``I_*`` constants of ``dev`` (`elastic_np.cuda._device`)."""
    B, H, Hkv, N, M, D, Dv = p.shape
    iopts = np.zeros(dev.I_COUNT, dtype=np.int64)
    iopts[dev.I_CAUSAL] = p.causal
    iopts[dev.I_LEFT], iopts[dev.I_RIGHT] = p.window
    iopts[dev.I_HAS_MASK] = p.mask is not None
    iopts[dev.I_NVM] = p.nvm
    iopts[dev.I_HAS_GATE] = p.sigma is not None
    iopts[dev.I_HAS_ALIBI] = p.alibi is not None
    iopts[dev.I_HAS_BIAS] = p.bias is not None
    iopts[dev.I_BIAS_SB : dev.I_BIAS_SJ + 1] = bias_strides
    iopts[dev.I_DBIAS_FULL] = p.bias is not None and bias_compact == (B, H, N, M)
    if bias_compact is not None:
        iopts[dev.I_DBIAS_B : dev.I_DBIAS_J + 1] = bias_compact
    iopts[dev.I_ALIGN_KV] = p.align == "kv_lengths"
    iopts[dev.I_MMA_TERMS] = 3 if p.dtype == np.float32 and p.precision is None else 1
    return iopts


def _float_options(p, dev):
    """``fopts``: the floating options in the kernel dtype, indexed by the ``F_*`` constants."""
    fopts = np.zeros(dev.F_COUNT, dtype=p.dtype)
    fopts[dev.F_SCALE] = p.scale
    fopts[dev.F_SHARPNESS] = p.sharpness
    fopts[dev.F_THRESHOLD] = p.threshold
    fopts[dev.F_NEG_INF] = -np.inf
    fopts[dev.F_ONE] = 1.0
    fopts[dev.F_SOFTCAP] = 0.0 if p.softcap is None else p.softcap
    return fopts


def _bh_consts(p, dev):
    """The per-(b, h) constants, indexed by the ``C_*`` constants: the window's and the ALiBi slope.

    ``(B, H, C_COUNT)``, or ``(1, 1, C_COUNT)`` zeros when neither is given.
    """
    B, H, Hkv, N, M, D, Dv = p.shape
    if p.sigma is None and p.alibi is None:
        return np.zeros((1, 1, dev.C_COUNT), dtype=p.dtype)
    bh_consts = np.zeros((B, H, dev.C_COUNT), dtype=p.dtype)
    if p.sigma is not None:
        # finite in the dtype for sigma >= its smallest normal (`_problem.check_dtype_range`)
        sigma = p.sigma
        bh_consts[..., dev.C_NORM] = 1.0 / (sigma * math.sqrt(2 * math.pi))
        bh_consts[..., dev.C_INV_SIGMA] = 1.0 / sigma
        ends = p.kv_ends[:, None].astype(np.float64)
        with np.errstate(divide="ignore"):
            bh_consts[..., dev.C_U_SCALE] = np.where(ends > 1, 2.0 / (ends - 1), 0.0) / sigma
    if p.alibi is not None:
        bh_consts[..., dev.C_ALIBI] = p.alibi
    return bh_consts


def _bias_operand(p):
    """The bias as the kernels read it: ``(flat array, element strides, compact shape)``.

    The compact shape is the bias's own shape padded to four dims (``dbias``
    is computed in it, C order); the flat array holds its entries, read
    through the element strides, 0 on the axes it does not vary along. A
    NumPy bias goes through `elastic_np._contract._compact.compact_bias` (the plan of
    every backend) and is returned as a NumPy array, which `_launch_options`
    copies to the device; a device bias of the kernel dtype is used in place.
    Without a bias: a one-element NumPy dummy, strides 0, compact shape None.
    """
    cuda = _cuda()
    dtype = p.dtype
    if p.bias is None:
        return np.zeros(1, dtype=dtype), (0, 0, 0, 0), None
    compact = _dbias_shape(p)
    if _is_device(p.bias):
        pad = 4 - p.bias.ndim
        strides = element_strides(compact, (0,) * pad + tuple(p.bias.strides), p.bias.dtype.itemsize)
        flat = p.bias.reshape(max(1, p.bias.size)) if p.bias.ndim != 1 else p.bias
        if flat.dtype != dtype:
            flat = cuda.to_device(flat.copy_to_host().astype(dtype))
    else:
        flat, strides = compact_bias(p.bias, dtype, check=p.bias_unchecked)
        flat = np.ascontiguousarray(flat)
    return flat, tuple(int(s) for s in strides), tuple(int(n) for n in compact)


# ---------------------------------------------------------------------------
# Backend interface
# ---------------------------------------------------------------------------


def forward(p):
    """Run the forward kernels on a validated problem; return ``(out, lse)``.

    Decoding shapes (`elastic_np.cuda._decode_launch.takes`) go to the decode
    kernels, the others to the flash forward. NumPy arrays for a NumPy
    problem, device arrays for a device problem.
    """
    cuda = _cuda()
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.dtype
    on_device = any(_is_device(a) for a in (p.q, p.bias))
    q, k, v = (_to_device(a) for a in (p.q, p.k, p.v))
    out = cuda.device_array((B, H, N, Dv), dtype=dtype)
    lse = cuda.device_array((B, H, N), dtype=dtype)
    if B * H * N > 0:
        family = _decode_launch if _decode_launch.takes(p) else _forward_launch
        family.launch(p, _launch_options(p)[0], q, k, v, out, lse)
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
    on_device = any(_is_device(a) for a in (p.q, dout, out, lse, dlse, p.bias))
    # zeros for no dlse: delta - 0 is delta, bit for bit
    dlse = np.zeros((B, H, N), dtype=p.dtype) if dlse is None else dlse
    arrays = tuple(_to_device(a) for a in (p.q, p.k, p.v, dout, out, lse, dlse))
    grads = _backward_launch.outputs(p)
    if B * H * max(N, M) > 0:
        opts, bias_compact = _launch_options(p)
        _backward_launch.launch(p, opts, bias_compact, arrays, grads)
    if p.bias is not None and grads["dbias"] is None:  # nothing to sum: an empty problem
        grads["dbias"] = _cuda().to_device(np.zeros(_dbias_shape(p), dtype=p.dtype))
    return _backward_result(p, grads, arrays[5], on_device)


def _backward_result(p, grads, lse, on_device):
    """`~elastic_np.AttentionGrads` from the backward's outputs (`_backward_launch.outputs`).

    ``dtau`` and ``dsigma`` are summed from the dq blocks' partials, ``dbeta``
    formed from ``delta`` and ``lse``, all on the host in float64; the arrays
    are copied to the host unless ``on_device``.
    """
    dev = _kernel_module("_device.score")
    dq, dk, dv, dbias = grads["dq"], grads["dk"], grads["dv"], grads["dbias"]
    partials = grads["partials"].astype(np.float64)
    dtau_h = -(partials[..., dev.P_DTAU].sum(axis=(0, 2)) / p.tau) / p.tau  # tau**2 may underflow
    # dbeta on the host in float64: exp(-lse) overflows float32 once lse < -88.7
    dbeta_h = p.sink_gradient(grads["delta"].copy_to_host(), lse.copy_to_host())
    dsigma_bh = partials[..., dev.P_DSIGMA].sum(axis=2) if p.sigma is not None else None
    if not on_device:
        dq, dk, dv = dq.copy_to_host(), dk.copy_to_host(), dv.copy_to_host()
        if dbias is not None:
            dbias = dbias.copy_to_host().reshape(_dbias_shape(p))
        return p.reduce_grads(dq, dk, dv, dtau_h, dbeta_h, dsigma_bh, dbias=dbias)
    result = dataclasses.replace(p, bias=None).reduce_grads(dq, dk, dv, dtau_h, dbeta_h, dsigma_bh)
    if dbias is not None:
        dbias = dbias.reshape(p.bias_shape)
    return dataclasses.replace(result, dbias=dbias)


def _dbias_shape(p):
    """The bias's shape padded to four dims (the shape ``dbias`` is computed in)."""
    return (1,) * (4 - len(p.bias_shape)) + tuple(p.bias_shape)
