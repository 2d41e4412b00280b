"""The CUDA backend's launches: tile sizes, the option arrays, `forward` and `backward`.

`forward` allocates the outputs and launches the flash forward
(`elastic_np.cuda._forward`) or, for decoding shapes, the decode kernels
(`elastic_np.cuda._decode`); `backward` launches the backward's kernels
(`elastic_np.cuda._backward`). The kernel modules are imported on first use
(`elastic_np.cuda._host._kernel_module`).
"""

import dataclasses
import math

import numpy as np

from elastic_np._compact import compact_bias, compact_mask, element_strides
from elastic_np._ranges import offset_band
from elastic_np.cuda import _config as config
from elastic_np.cuda._host import (
    _cuda,
    _is_device,
    _kernel_module,
    _to_device,
    configured,
    pow2_at_least,
    shared_limit,
)

# ---------------------------------------------------------------------------
# Launch helpers
# ---------------------------------------------------------------------------


def _forward_geometry(threads, tile):
    """``(block_q, tpr)`` of a forward block of ``threads`` threads and key tile ``tile``."""
    tpr = tile // config.REG_N
    return threads // tpr * config.REG_M, tpr


def _shared_elements(kind, threads, tile, D, Dv):
    """Elements of dynamic shared memory one forward block uses (``kind="forward"``; see its layout)."""
    block_q, tpr = _forward_geometry(threads, tile)
    width = min(max(Dv, 1), tpr * config.ACC_COLS)
    return block_q * (D + 1) + tile * max(D + 1, width) + block_q * (tile + 1) + 3 * block_q * tpr


def _forward_tiles(itemsize, D, Dv):
    """``(threads, key tile)`` of the forward, from the config, shrunk until the shared memory fits.

    The key tile gives a row the fewest lanes whose accumulators hold the value
    head in one pass, between ``FORWARD_MIN_BLOCK_K`` and ``FORWARD_BLOCK_K`` keys.
    """
    block_q, block_k = config.FORWARD_BLOCK_Q, config.FORWARD_BLOCK_K
    tpr = block_k // config.REG_N
    if block_k % config.REG_N or tpr < 1 or tpr > 32 or tpr & (tpr - 1):
        raise ValueError(
            f"FORWARD_BLOCK_K={block_k} must be REG_N={config.REG_N} times a power of two of at most 32"
        )
    if block_q % config.REG_M or block_q < config.REG_M:
        raise ValueError(f"FORWARD_BLOCK_Q={block_q} must be a multiple of REG_M={config.REG_M}")

    def threads():
        return (block_q // config.REG_M) * (block_k // config.REG_N)

    one_pass = config.REG_N * pow2_at_least(-(-max(Dv, 1) // config.ACC_COLS))
    block_k = min(block_k, max(one_pass, config.FORWARD_MIN_BLOCK_K))
    limit = shared_limit()
    while _shared_elements("forward", threads(), block_k, D, Dv) * itemsize > limit:
        if block_k > config.REG_N and (block_k >= block_q or block_q <= config.REG_M):
            block_k //= 2
        elif block_q > config.REG_M and block_q % (2 * config.REG_M) == 0:
            block_q //= 2
        else:
            raise config.shared_memory_error(D, Dv, limit)
    return threads(), block_k


def _tiles(kind, itemsize, D, Dv):
    """``(threads, key tile)`` of the forward (``kind="forward"``; the backward's: `._backward.tiles`)."""
    if kind != "forward":
        raise ValueError(f"no tiles of kind {kind!r} here")
    return _forward_tiles(itemsize, D, Dv)


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
    """
    cuda = _cuda()
    dev = _kernel_module("_device")
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.dtype
    iopts = np.zeros(dev.I_COUNT, dtype=np.int64)
    iopts[dev.I_CAUSAL] = p.causal
    iopts[dev.I_LEFT], iopts[dev.I_RIGHT] = p.window
    iopts[dev.I_HAS_MASK] = p.mask is not None
    iopts[dev.I_NVM] = p.nvm
    iopts[dev.I_HAS_GATE] = p.sigma is not None
    iopts[dev.I_HAS_ALIBI] = p.alibi is not None
    bias, bias_strides, bias_compact = _bias_operand(p)
    iopts[dev.I_HAS_BIAS] = p.bias is not None
    iopts[dev.I_BIAS_SB : dev.I_BIAS_SJ + 1] = bias_strides
    iopts[dev.I_DBIAS_FULL] = p.bias is not None and bias_compact == (B, H, N, M)
    if bias_compact is not None:
        iopts[dev.I_DBIAS_B : dev.I_DBIAS_J + 1] = bias_compact
    iopts[dev.I_ALIGN_KV] = p.align == "kv_lengths"
    fopts = np.zeros(dev.F_COUNT, dtype=dtype)
    fopts[dev.F_SCALE] = p.scale
    fopts[dev.F_SHARPNESS] = p.sharpness
    fopts[dev.F_THRESHOLD] = p.threshold
    fopts[dev.F_NEG_INF] = -np.inf
    fopts[dev.F_ONE] = 1.0
    fopts[dev.F_SOFTCAP] = 0.0 if p.softcap is None else p.softcap
    if p.sigma is None and p.alibi is None:
        bh_consts = np.zeros((1, 1, dev.C_COUNT), dtype=dtype)
    else:
        bh_consts = np.zeros((B, H, dev.C_COUNT), dtype=dtype)
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
    if p.mask is None:
        mask = np.ones((1, 1, 1, 1), dtype=np.uint8)
    else:
        mask = compact_mask(p.mask)[0].view(np.uint8)  # 1 on broadcast axes, read by its shape
    opts = [None] * dev.O_COUNT
    opts[dev.O_MASK] = mask
    opts[dev.O_KV_LENGTHS] = np.ascontiguousarray(p.kv_lengths, dtype=np.int64)
    opts[dev.O_BAND] = offset_band(p, _gate_band(p))
    opts[dev.O_IOPTS] = iopts
    opts[dev.O_FOPTS] = fopts
    opts[dev.O_TAU] = p.tau.astype(dtype)
    opts[dev.O_BETA] = p.beta.astype(dtype)
    opts[dev.O_BH_CONSTS] = bh_consts
    opts = [cuda.to_device(a) for a in opts]
    opts[dev.O_BIAS] = bias
    return tuple(opts), bias_compact


def _bias_operand(p):
    """The bias as the kernels read it: ``(flat device array, element strides, compact shape)``.

    The compact shape is the bias's own shape padded to four dims (``dbias``
    is computed in it, C order); the flat array holds its entries, read
    through the element strides, 0 on the axes it does not vary along. A
    NumPy bias goes through `elastic_np._compact.compact_bias` (the plan of
    every backend) and is copied to the device as it lies; a device bias of
    the kernel dtype is used in place. Without a bias: a one-element dummy,
    strides 0, compact shape None.
    """
    cuda = _cuda()
    dtype = p.dtype
    if p.bias is None:
        return cuda.to_device(np.zeros(1, dtype=dtype)), (0, 0, 0, 0), None
    compact = _dbias_shape(p)
    if _is_device(p.bias):
        pad = 4 - p.bias.ndim
        strides = element_strides(compact, (0,) * pad + tuple(p.bias.strides), p.bias.dtype.itemsize)
        flat = p.bias.reshape(max(1, p.bias.size)) if p.bias.ndim != 1 else p.bias
        if flat.dtype != dtype:
            flat = cuda.to_device(flat.copy_to_host().astype(dtype))
    else:
        flat, strides = compact_bias(p.bias, dtype, check=p.bias_unchecked)
        flat = cuda.to_device(np.ascontiguousarray(flat))
    return flat, tuple(int(s) for s in strides), tuple(int(n) for n in compact)


def _blocks(n, size):
    return (n + size - 1) // size


# ---------------------------------------------------------------------------
# Backend interface
# ---------------------------------------------------------------------------


def forward(p):
    """Run the forward kernel on a validated problem; return ``(out, lse)``.

    NumPy arrays for a NumPy problem, device arrays for a device problem.
    """
    cuda = _cuda()
    decode = _kernel_module("_decode")
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.dtype
    on_device = any(_is_device(a) for a in (p.q, p.bias))
    q, k, v = (_to_device(a) for a in (p.q, p.k, p.v))
    out = cuda.device_array((B, H, N, Dv), dtype=dtype)
    lse = cuda.device_array((B, H, N), dtype=dtype)
    if B * H * N > 0 and decode.takes(p):
        decode.forward(cuda, p, _launch_options(p)[0], q, k, v, out, lse)
    elif B * H * N > 0:
        opts, _ = _launch_options(p)
        threads, tile = _tiles("forward", dtype.itemsize, D, Dv)
        shared = _shared_elements("forward", threads, tile, D, Dv) * dtype.itemsize
        block_q, _ = _forward_geometry(threads, tile)
        kernel = _kernel_module("_forward")._forward_kernel
        configured(kernel, _blocks(N, block_q) * B * H, threads, shared)(q, k, v, opts, tile, out, lse)
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
    cuda = _cuda()
    dev = _kernel_module("_device")
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.dtype
    on_device = any(_is_device(a) for a in (p.q, dout, out, lse, dlse, p.bias))
    q, k, v, dout, out, lse = (_to_device(a) for a in (p.q, p.k, p.v, dout, out, lse))
    # zeros for no dlse: delta - 0 is delta, bit for bit
    dlse = _to_device(np.zeros((B, H, N), dtype=dtype) if dlse is None else dlse)
    dq = cuda.device_array((B, H, N, D), dtype=dtype)
    dk = cuda.device_array((B, Hkv, M, D), dtype=dtype)
    dv = cuda.device_array((B, Hkv, M, Dv), dtype=dtype)
    delta = cuda.device_array((B, H, N), dtype=dtype)
    backward_kernels = _kernel_module("_backward")
    dq_rows = backward_kernels.tiles("dq", dtype.itemsize, D, Dv)[1]
    partials = np.zeros((B, H, _blocks(N, dq_rows), dev.P_COUNT), dtype=dtype)
    dbias = None
    if B * H * max(N, M) > 0:
        opts, compact = _launch_options(p)
        full = compact == (B, H, N, M)
        if compact is not None:
            # full: the dq kernel writes every entry; broadcast: one entry per block below
            dbias = cuda.device_array(compact if full else math.prod(compact), dtype=dtype)
        partials_dev = cuda.device_array(partials.shape, dtype=dtype)
        grads = {"dq": dq, "dk": dk, "dv": dv, "delta": delta, "partials": partials_dev,
                 "dbias": dbias if full else cuda.device_array((1, 1, 1, 1), dtype=dtype)}
        backward_kernels.launch(p, opts, q, k, v, dout, out, lse, dlse, grads)
        if N > 0:
            partials = partials_dev.copy_to_host()
        if compact is not None and not full:
            if N * M > 0:
                # the broadcast entries one compact entry stands for
                spans = (B * H * N * M) // math.prod(compact)
                threads = max(1, min(config.DBIAS_THREADS, spans))
                backward_kernels._backward_dbias_kernel[math.prod(compact), threads, 0, threads * dtype.itemsize](
                    q, k, v, opts, (dout, lse, delta), dbias
                )
            else:
                dbias = None
    if p.bias is not None and dbias is None:  # nothing to sum: an empty problem
        dbias = cuda.to_device(np.zeros(_dbias_shape(p), dtype=dtype))
    partials = partials.astype(np.float64)
    dtau_h = -(partials[..., dev.P_DTAU].sum(axis=(0, 2)) / p.tau) / p.tau  # tau**2 may underflow
    # dbeta on the host in float64: exp(-lse) overflows float32 once lse < -88.7
    dbeta_h = p.sink_gradient(delta.copy_to_host(), lse.copy_to_host())
    dsigma_bh = partials[..., dev.P_DSIGMA].sum(axis=2) if p.sigma is not None else None
    if not on_device:
        dq, dk, dv = dq.copy_to_host(), dk.copy_to_host(), dv.copy_to_host()
        if dbias is not None:
            dbias = dbias.copy_to_host().reshape(_dbias_shape(p))
        return p.reduce_grads(dq, dk, dv, dtau_h, dbeta_h, dsigma_bh, dbias=dbias)
    grads = dataclasses.replace(p, bias=None).reduce_grads(dq, dk, dv, dtau_h, dbeta_h, dsigma_bh)
    if dbias is not None:
        dbias = dbias.reshape(p.bias_shape)
    return dataclasses.replace(grads, dbias=dbias)


def _dbias_shape(p):
    """The bias's shape padded to four dims (the shape ``dbias`` is computed in)."""
    return (1,) * (4 - len(p.bias_shape)) + tuple(p.bias_shape)

