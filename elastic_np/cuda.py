"""The numba.cuda backend: tiled attention kernels, forward and backward.

Selected with ``backend="cuda"`` (or ``"auto"`` when a GPU is usable). The
kernels live in `elastic_np._cuda_kernels` (the flash forward, the broadcast
``dbias``), `elastic_np._cuda_decode` (decoding) and
`elastic_np._cuda_backward` (``dq``, ``dk``, ``dv``), the device functions
they share in `elastic_np._cuda_device`, their tunables in
`elastic_np._cuda_config`; this module holds the host functions that
validate, allocate and launch. Importing `elastic_np` never imports
``numba.cuda``: this module imports it on first use.

Design
------
Forward (``_forward_kernel``): a flash kernel with register micro-tiles. One
block per (batch * head, query tile of ``FORWARD_BLOCK_M`` rows); the block's
threads form row groups of ``tpr = FORWARD_BLOCK_N / REG_N`` consecutive
lanes of one warp, each thread owning ``REG_M`` query rows. Per K/V tile of
``FORWARD_BLOCK_N`` keys (staged in shared memory, K then V in the same
buffer): each thread computes a ``REG_M x REG_N`` micro-tile of dot products
in registers (``REG_M + REG_N`` shared loads per ``REG_M REG_N``
multiply-adds, loops fully unrolled), the score pipeline turns them into
logits (written once, `elastic_np._cuda_device._entry`, shared with the
backward kernels), the row max is combined across the row group with warp
shuffles (``shfl_xor_sync``), the running sums and the ``REG_M x ACC_COLS``
output accumulator are rescaled in registers, and ``p`` goes through shared
memory to the ``p V`` micro-tile product. Each thread's running max and
partial row sum, and the rescale factor, sit in shared memory (one slot per
thread and row) rather than in local arrays: the score pipeline is long, so
its loop over the rows is not unrolled, and a local array indexed by a loop
counter would live in local memory. Only the key tiles that the causal,
window, ``kv_lengths`` and dynamic-window band can reach are visited. A
value head wider than ``tpr * ACC_COLS`` takes several passes over the keys
(each recomputing the same scores, hence the same softmax). The row sums are
combined in a fixed butterfly, so results are bit-identical from run to run.
``out = (acc num) / den`` (`elastic_np._cuda_device._finish_row`): one
rounding, not two through a reciprocal. ``elastic_np.cuda.resources()``
reports each kernel's registers, local memory and spills from the compiled
code (see the performance page).

Decoding (1 to ``DECODE_MAX_QUERIES`` queries per sequence,
`elastic_np._cuda_decode`): the query heads of a GQA group are stacked so
that each K/V tile staged in shared memory serves all of them; the keys are
split across blocks (split-KV) when the (batch, kv head) blocks alone are too
few to fill the GPU, the number of splits depending on the shape and the
config only; a second kernel merges the partial ``(max, sum, acc)`` in split
order and adds ``beta`` once. Same bits on every run.

Backward (`elastic_np._cuda_backward`), FlashAttention-2 partitioning,
recomputing the probabilities from ``lse``:

- ``delta = dout . out - dlse`` per row (``dlse``, the cotangent of ``lse``,
  zeros when none is given): ``_backward_delta_kernel``, first.
- ``dk``, ``dv``: ``_backward_dkdv_kernel``, one block per (batch * kv head,
  key tile), looping over the group's query heads and the query tiles that
  can see the key tile, ``s``, ``dp`` and the ``dk``/``dv`` accumulators in
  register micro-tiles. Each ``dk``/``dv`` entry has a single owner thread,
  so there are no atomics and the summation order is fixed.
- ``dq``: a second kernel, ``_backward_dq_kernel``, one block per (batch *
  head, query tile), laid out like the forward, looping over key tiles. This
  costs a second recomputation of the scores but keeps ``dq`` free of atomics
  too (float atomics would make ``dq`` depend on scheduling) and needs no
  extra ``(B, H, N, D)`` buffer per key tile.
- ``dtau``, ``dsigma``: the ``dq`` kernel keeps compensated sums per (row,
  lane), adds them in a fixed order and writes one partial per (batch, head,
  query tile); the host sums these few numbers in float64 in a fixed order.
  The result is deterministic, the partials are tiny next to ``q``, and the
  scalars must come back to the host anyway (they are returned as floats or
  small NumPy arrays). ``dbeta`` is formed on the host from ``delta`` and
  ``lse``.

Score modifiers: every kernel builds the score in the contract's order
(scaled dot product, soft-cap, ALiBi, bias, then NVM on the final score), the
options being runtime values (``softcap`` in ``fopts``, 0 for none; the ALiBi
slope with the window's per-(b, h) constants; the bias as a flat array of the
caller's own entries (its shape), in the kernel dtype, with four element strides,
0 on the axes it is broadcast along, read entry by entry like the mask; a
one-element dummy without a bias). The backward kernels multiply ``ds`` by the
soft-cap's slope ``1 - tanh^2`` before it enters ``dq`` and ``dk``. ``dbias``
is ``ds`` summed over the bias's broadcast axes, deterministically and without
atomics:

- a full ``(B, H, N, M)`` bias: the ``dq`` kernel, whose threads own query
  rows, writes ``ds`` straight into ``dbias`` (each entry has one writer,
  under GQA too, since query heads are distinct); no extra pass.
- a broadcast bias: ``_backward_dbias_kernel``, launched after the delta
  kernel (it reads ``delta``), one block per entry of the bias's compact
  shape (``dbias`` is allocated in that shape, never ``(B, H, N, M)``); its
  threads recompute ``ds`` for the entries the bias entry stands for, in a
  fixed assignment, and the block adds their sums in thread order. This is a
  third recomputation of the scores and of ``dout . v``, without shared-memory
  tiling: about ``B H N M (D + Dv)`` multiply-adds read from global memory
  (cache), the cost of one more backward pass over the kept entries; a bias
  broadcast over every axis (scalar-like) is summed by a single block.

All kernels take the options as runtime arguments and compute in the input
dtype, so there is one compiled specialisation per dtype (float32, float64).
Tile sizes are runtime values too (`elastic_np._cuda_config`, shrunk until
the dynamic shared memory fits ``MAX_SHARED_BYTES`` for the head dims).

Performance: ``python -m elastic_np.cuda --bench`` times the kernels against
``torch.nn.functional.scaled_dot_product_attention`` in float32 on the same
GPU (B=4, H=16, N=4096, D=64 by default); ``--softcap X``, ``--alibi`` and
``--bias {full,keys,padding,rows,scalar}`` time the score modifiers, next to
plain attention in the same run; ``--json FILE`` also times the decoding
shapes (`DECODE_SHAPES`) and writes everything, with the GPU, driver and
library versions, to ``FILE`` (`elastic_np._cuda_bench`). The speed of the
flash forward, the decode kernel and the backward on a GPU is unmeasured
(they were written on machines without one). ``--resources`` prints each kernel's registers, local memory, spills
and shared memory from the compiled code, no GPU needed.

Arrays: NumPy inputs are copied to the GPU and the results copied back as
NumPy arrays. Device arrays (anything with ``__cuda_array_interface__``:
numba device arrays, CuPy arrays, PyTorch CUDA tensors) must be C-contiguous;
they are used in place and, when any input is a device array, the results are
numba device arrays, with no host round trip (NumPy inputs next to them are
copied to the device). Device inputs are not scanned for NaN or inf.
``mask`` and ``kv_lengths`` are small option arrays and are taken from the
host. ``bias`` may be a NumPy array (its distinct entries are copied to the
device, converted to the kernel dtype when they differ) or a C-contiguous
device array of the kernel dtype, used in place (one of another dtype makes
a round trip through the host to be converted); with a device bias the
results are device arrays, ``dbias`` too.
"""

import dataclasses
import math

import numpy as np

from elastic_np import _cuda_config as config
from elastic_np import _options, reference
from elastic_np._errors import BackendUnavailableError

__all__ = [
    "dtypes",
    "is_available",
    "check_available",
    "prepare",
    "check_backward_arrays",
    "forward",
    "backward",
    "ptx",
    "resources",
    "dynamic_shared_bytes",
    "bench",
]

#: The dtypes the kernels take (``q``, ``k``, ``v`` share one).
dtypes = (np.dtype(np.float32), np.dtype(np.float64))

_INSTALL_HINT = 'install it with `pip install "elastic_np[cuda]"` (numba-cuda with the CUDA 13 toolkit wheels)'


def _cuda():
    """``numba.cuda``, imported on first use.

    The kernels need the numba-cuda package (the CUDA target that Numba itself
    ships is older and lacks what they use), so its absence is reported even
    where ``from numba import cuda`` would still succeed.
    """
    try:
        import numba_cuda  # noqa: F401
        from numba import cuda
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend 'cuda' needs the numba-cuda package, which could not be imported ({exc}); "
            + _INSTALL_HINT
        ) from exc
    return cuda


def _kernels():
    _cuda()
    if _simulator():
        from elastic_np import _cuda_sim

        _cuda_sim.install()  # warp shuffles, which the simulator lacks
    from elastic_np import _cuda_kernels

    return _cuda_kernels


def _decode():
    """`elastic_np._cuda_decode` (the decode kernels), imported on first use."""
    _kernels()
    from elastic_np import _cuda_decode

    return _cuda_decode


def _backward():
    """`elastic_np._cuda_backward` (the backward's dq, dk/dv and delta kernels), imported on first use."""
    _kernels()
    from elastic_np import _cuda_backward

    return _cuda_backward


def _simulator():
    from numba import config as numba_config

    return bool(getattr(numba_config, "ENABLE_CUDASIM", 0))


def is_available():
    """True when a real CUDA GPU and its driver are usable (never under the CUDA simulator).

    Returns
    -------
    bool
    """
    try:
        cuda = _cuda()
    except BackendUnavailableError:
        return False
    if _simulator():
        return False
    try:
        return bool(cuda.is_available())
    except Exception:
        return False


def check_available():
    """Raise `BackendUnavailableError` unless the kernels can run here.

    They run on a usable GPU, or on the CUDA simulator when
    ``NUMBA_ENABLE_CUDASIM=1`` was set before ``numba`` was imported (slow;
    for tests).

    Raises
    ------
    elastic_np.BackendUnavailableError
        Saying what is missing (numba-cuda, the CUDA driver, a GPU) and how to
        install the CUDA extra.
    """
    cuda = _cuda()
    if _simulator():
        return
    try:
        if cuda.is_available():
            return
        cuda.current_context()  # raises with the driver's reason
        reason = "no usable CUDA GPU was found"
    except Exception as exc:
        reason = " ".join(str(exc).split()).rstrip(" :.") or type(exc).__name__
    raise BackendUnavailableError(
        f"backend 'cuda' needs an NVIDIA GPU with its CUDA driver, and here: {reason}. "
        f"On a machine with a GPU, {_INSTALL_HINT}; here, use backend='cpu'."
    )


# ---------------------------------------------------------------------------
# Inputs: NumPy arrays or device arrays
# ---------------------------------------------------------------------------


def _is_device(a):
    if hasattr(a, "__cuda_array_interface__"):
        return True
    if _simulator():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return isinstance(a, FakeCUDAArray)
    return False


def _as_device_array(a, name):
    """A device array as a numba device array, checked C-contiguous (no copy)."""
    cuda = _cuda()
    if not _simulator():
        a = cuda.as_cuda_array(a)
    if not a.is_c_contiguous():
        raise ValueError(f"`{name}` must be a C-contiguous device array")
    return a


def _to_device(a):
    """``a`` on the device: device arrays as they are, NumPy arrays copied."""
    if _is_device(a):
        return a
    return _cuda().to_device(np.ascontiguousarray(a))


def prepare(q, k, v, *, dtypes=dtypes, **options):
    """Validate the inputs like `elastic_np._options.prepare`, keeping device arrays on the device.

    With NumPy inputs this is `~elastic_np._options.prepare`. When any of
    ``q``, ``k``, ``v`` is a device array, shapes and dtypes are validated
    from the array metadata (no copy to the host, no NaN scan), the others
    are copied to the device, and the returned problem holds device arrays.
    A device ``bias`` is validated the same way and kept as it is (in the
    caller's shape, not broadcast) in the problem's ``bias``.
    """
    bias = options.get("bias")
    device_bias = None
    if bias is not None and _is_device(bias):
        device_bias = _as_device_array(bias, "bias")
        # validated from its metadata; the problem carries the device array itself
        options["bias"] = np.broadcast_to(np.zeros((), dtype=device_bias.dtype), device_bias.shape)
    if not any(_is_device(a) for a in (q, k, v)):
        problem = _options.prepare(q, k, v, dtypes=dtypes, **options)
    else:
        arrays = []
        for name, a in (("q", q), ("k", k), ("v", v)):
            arrays.append(_as_device_array(a, name) if _is_device(a) else _to_device(np.asarray(a)))
        placeholders = [np.broadcast_to(np.zeros((), dtype=a.dtype), a.shape) for a in arrays]
        problem = _options.prepare(*placeholders, dtypes=dtypes, check_finite=False, **options)
        problem = dataclasses.replace(problem, q=arrays[0], k=arrays[1], v=arrays[2])
    if device_bias is not None:
        problem = dataclasses.replace(problem, bias=device_bias)
    return problem


def check_backward_arrays(p, dout, out, lse, dtype=None, dlse=None):
    """Validate ``dout``, ``out``, ``lse`` and ``dlse``; device arrays stay on the device.

    NumPy arrays with a NumPy problem go through
    `elastic_np.reference.check_backward_arrays`; otherwise shapes and dtypes
    are checked from the metadata and NumPy arrays are copied to the device.
    Returns ``(dout, out, lse, dlse)``, ``dlse`` None when it was.
    """
    if not any(_is_device(a) for a in (p.q, dout, out, lse, dlse)):
        return reference.check_backward_arrays(p, dout, out, lse, dtype=dtype, dlse=dlse)
    named = list(zip(p.backward_shapes, (dout, out, lse)))
    if dlse is not None:
        named.append((("dlse", p.backward_shapes[2][1]), dlse))
    arrays = []
    for (name, shape), a in named:
        a = _as_device_array(a, name) if _is_device(a) else _to_device(np.asarray(a))
        if tuple(a.shape) != shape:
            raise ValueError(f"`{name}` must have shape {shape}, got {tuple(a.shape)}")
        if a.dtype != p.dtype:
            raise TypeError(f"`{name}` has dtype {a.dtype}, expected {p.dtype} like `q`")
        arrays.append(a)
    return (*arrays, None) if dlse is None else tuple(arrays)


# ---------------------------------------------------------------------------
# Launch helpers
# ---------------------------------------------------------------------------


def _forward_geometry(threads, tile):
    """``(block_m, tpr)`` of a forward block of ``threads`` threads and key tile ``tile``."""
    tpr = tile // config.REG_N
    return threads // tpr * config.REG_M, tpr


def _shared_elements(kind, threads, tile, D, Dv):
    """Elements of dynamic shared memory one forward block uses (``kind="forward"``; see its layout)."""
    block_m, tpr = _forward_geometry(threads, tile)
    width = min(max(Dv, 1), tpr * config.ACC_COLS)
    return block_m * (D + 1) + tile * max(D + 1, width) + block_m * (tile + 1) + 3 * block_m * tpr


def _forward_tiles(itemsize, D, Dv):
    """``(threads, key tile)`` of the forward, from the config, shrunk until the shared memory fits."""
    block_m, block_n = config.FORWARD_BLOCK_M, config.FORWARD_BLOCK_N
    tpr = block_n // config.REG_N
    if block_n % config.REG_N or tpr < 1 or tpr > 32 or tpr & (tpr - 1):
        raise ValueError(
            f"FORWARD_BLOCK_N={block_n} must be REG_N={config.REG_N} times a power of two of at most 32"
        )
    if block_m % config.REG_M or block_m < config.REG_M:
        raise ValueError(f"FORWARD_BLOCK_M={block_m} must be a multiple of REG_M={config.REG_M}")

    def threads():
        return (block_m // config.REG_M) * (block_n // config.REG_N)

    while _shared_elements("forward", threads(), block_n, D, Dv) * itemsize > config.MAX_SHARED_BYTES:
        if block_n > config.REG_N and (block_n >= block_m or block_m <= config.REG_M):
            block_n //= 2
        elif block_m > config.REG_M and block_m % (2 * config.REG_M) == 0:
            block_m //= 2
        else:
            raise ValueError(
                f"head dims D={D}, Dv={Dv} need more shared memory than "
                f"MAX_SHARED_BYTES={config.MAX_SHARED_BYTES} allows"
            )
    return threads(), block_n


def _tiles(kind, itemsize, D, Dv):
    """``(threads, key tile)`` of the forward (``kind="forward"``; the backward's are `elastic_np._cuda_backward.tiles`)."""
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


def _launch_options(p):
    """The runtime option arrays every kernel takes, on the device."""
    cuda = _cuda()
    kern = _kernels()
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.dtype
    iopts = np.zeros(kern.I_COUNT, dtype=np.int64)
    iopts[kern.I_CAUSAL] = p.causal
    iopts[kern.I_LEFT], iopts[kern.I_RIGHT] = p.window
    iopts[kern.I_HAS_MASK] = p.mask is not None
    iopts[kern.I_NVM] = p.nvm
    iopts[kern.I_HAS_GATE] = p.sigma is not None
    iopts[kern.I_HAS_ALIBI] = p.alibi is not None
    bias, bias_strides, bias_compact = _bias_operand(p)
    iopts[kern.I_HAS_BIAS] = p.bias is not None
    iopts[kern.I_BIAS_SB : kern.I_BIAS_SJ + 1] = bias_strides
    iopts[kern.I_DBIAS_FULL] = p.bias is not None and bias_compact == (B, H, N, M)
    iopts[kern.I_ALIGN_KV] = p.align == "kv_lengths"
    fopts = np.zeros(kern.F_COUNT, dtype=dtype)
    fopts[kern.F_SCALE] = p.scale
    fopts[kern.F_SHARPNESS] = p.sharpness
    fopts[kern.F_THRESHOLD] = p.threshold
    fopts[kern.F_NEG_INF] = -np.inf
    fopts[kern.F_ONE] = 1.0
    fopts[kern.F_SOFTCAP] = 0.0 if p.softcap is None else p.softcap
    if p.sigma is None and p.alibi is None:
        bh_consts = np.zeros((1, 1, kern.C_COUNT), dtype=dtype)
    else:
        bh_consts = np.zeros((B, H, kern.C_COUNT), dtype=dtype)
        if p.sigma is not None:
            # finite in the dtype for sigma >= its smallest normal (`_options.check_dtype_range`)
            sigma = p.sigma
            bh_consts[..., kern.C_NORM] = 1.0 / (sigma * math.sqrt(2 * math.pi))
            bh_consts[..., kern.C_INV_SIGMA] = 1.0 / sigma
            ends = p.kv_ends[:, None].astype(np.float64)
            with np.errstate(divide="ignore"):
                bh_consts[..., kern.C_U_SCALE] = np.where(ends > 1, 2.0 / (ends - 1), 0.0) / sigma
        if p.alibi is not None:
            bh_consts[..., kern.C_ALIBI] = p.alibi
    if p.mask is None:
        mask = np.ones((1, 1, 1, 1), dtype=np.uint8)
    else:
        # keep broadcast (zero-stride) dims at size 1 instead of materialising them
        index = tuple(slice(0, 1) if stride == 0 else slice(None) for stride in p.mask.strides)
        mask = np.ascontiguousarray(p.mask[index]).view(np.uint8)
    host = dict(
        mask=mask,
        kv_lengths=np.ascontiguousarray(p.kv_lengths, dtype=np.int64),
        band=_window_band(p),
        iopts=iopts,
        fopts=fopts,
        tau=p.tau.astype(dtype),
        beta=p.beta.astype(dtype),
        bh_consts=bh_consts,
    )
    options = {name: cuda.to_device(a) for name, a in host.items()}
    options["bias"] = bias
    options["bias_compact"] = bias_compact
    return options


def _bias_operand(p):
    """The bias as the kernels read it: ``(flat device array, element strides, compact shape)``.

    The flat array holds the caller's entries in C order over the compact
    shape (the bias's own shape padded to four dims: the full dims, 1 on the
    axes it is broadcast along), in the kernel dtype; the strides are 0 on
    those axes. ``dbias`` is computed in that shape. NumPy biases are copied
    (only their own entries, converted if the dtype differs);
    a device bias of the kernel dtype is used in place. Without a bias: a
    one-element dummy, strides 0, compact shape None.
    """
    cuda = _cuda()
    dtype = p.dtype
    if p.bias is None:
        return cuda.to_device(np.zeros(1, dtype=dtype)), (0, 0, 0, 0), None
    if _is_device(p.bias):
        compact = (1,) * (4 - p.bias.ndim) + tuple(p.bias.shape)
        flat = p.bias.reshape(max(1, p.bias.size)) if p.bias.ndim != 1 else p.bias
        if flat.dtype != dtype:
            flat = cuda.to_device(flat.copy_to_host().astype(dtype))
    else:
        # the caller's own entries (its shape, padded), not the (B, H, N, M) broadcast
        compact = _dbias_shape(p)
        index = tuple(slice(0, 1) if n == 1 else slice(None) for n in compact)
        host = np.ascontiguousarray(p.bias[index], dtype=dtype)
        flat = cuda.to_device(host.reshape(-1))
    strides = []
    step = 1
    for n in reversed(compact):
        strides.append(step if n > 1 else 0)
        step *= n
    return flat, tuple(reversed(strides)), tuple(int(n) for n in compact)


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
    kern = _kernels()
    B, H, Hkv, N, M, D, Dv = p.shape
    dtype = p.dtype
    on_device = any(_is_device(a) for a in (p.q, p.bias))
    q, k, v = (_to_device(a) for a in (p.q, p.k, p.v))
    out = cuda.device_array((B, H, N, Dv), dtype=dtype)
    lse = cuda.device_array((B, H, N), dtype=dtype)
    if B * H * N > 0 and _decode().takes(p):
        _decode().forward(cuda, p, _launch_options(p), q, k, v, out, lse)
    elif B * H * N > 0:
        o = _launch_options(p)
        threads, tile = _tiles("forward", dtype.itemsize, D, Dv)
        shared = _shared_elements("forward", threads, tile, D, Dv) * dtype.itemsize
        block_m, _ = _forward_geometry(threads, tile)
        kern._forward_kernel[_blocks(N, block_m) * B * H, threads, 0, shared](
            q, k, v, o["mask"], o["kv_lengths"], o["band"], o["iopts"], o["fopts"],
            o["tau"], o["beta"], o["bh_consts"], o["bias"], tile, out, lse,
        )
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
    kern = _kernels()
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
    backward_kernels = _backward()
    dq_rows = backward_kernels.tiles("dq", dtype.itemsize, D, Dv)[1]
    partials = np.zeros((B, H, _blocks(N, dq_rows), kern.P_COUNT), dtype=dtype)
    dbias = None
    if B * H * max(N, M) > 0:
        o = _launch_options(p)
        compact = o["bias_compact"]
        full = compact == (B, H, N, M)
        if compact is not None:
            # full: the dq kernel writes every entry; broadcast: one entry per block below
            dbias = cuda.device_array(compact if full else math.prod(compact), dtype=dtype)
        partials_dev = cuda.device_array(partials.shape, dtype=dtype)
        backward_kernels.launch(
            cuda, p, o, q, k, v, dout, out, lse, dlse, dq, dk, dv, delta, partials_dev,
            dbias if full else cuda.device_array((1, 1, 1, 1), dtype=dtype),
        )
        if N > 0:
            partials = partials_dev.copy_to_host()
        if compact is not None and not full:
            if N * M > 0:
                # the broadcast entries one compact entry stands for
                spans = (B * H * N * M) // math.prod(compact)
                threads = max(1, min(config.DBIAS_THREADS, spans))
                kern._backward_dbias_kernel[math.prod(compact), threads, 0, threads * dtype.itemsize](
                    q, k, v, o["mask"], o["kv_lengths"], o["iopts"], o["fopts"], o["tau"],
                    o["bh_consts"], o["bias"], dout, lse, delta, dbias,
                )
            else:
                dbias = None
    if p.bias is not None and dbias is None:  # nothing to sum: an empty problem
        dbias = cuda.to_device(np.zeros(_dbias_shape(p), dtype=dtype))
    partials = partials.astype(np.float64)
    dtau_h = -(partials[..., kern.P_DTAU].sum(axis=(0, 2)) / p.tau) / p.tau  # tau**2 may underflow
    # dbeta on the host in float64: exp(-lse) overflows float32 once lse < -88.7
    dbeta_h = p.sink_gradient(delta.copy_to_host(), lse.copy_to_host())
    dsigma_bh = partials[..., kern.P_DSIGMA].sum(axis=2) if p.sigma is not None else None
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


# ---------------------------------------------------------------------------
# PTX and the compiled code's resources: elastic_np._cuda_compile
# ---------------------------------------------------------------------------

from elastic_np._cuda_compile import _print_resources, dynamic_shared_bytes, ptx, resources  # noqa: E402


# ---------------------------------------------------------------------------
# Benchmark (needs a GPU and PyTorch with CUDA): elastic_np._cuda_bench
# ---------------------------------------------------------------------------

from elastic_np._cuda_bench import BENCH_BIAS_SHAPES, DECODE_SHAPES, bench, bench_decode, bench_record  # noqa: E402


def _main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m elastic_np.cuda", description="CUDA backend: PTX check and GPU benchmark"
    )
    parser.add_argument("--ptx", nargs="*", metavar="CC", help="compile every kernel for these capabilities (e.g. 8.0 9.0)")
    parser.add_argument("--bench", action="store_true", help="time against torch SDPA on the GPU (float32)")
    parser.add_argument("--shape", nargs=4, type=int, default=(4, 16, 4096, 64), metavar=("B", "H", "N", "D"))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--softcap", type=float, default=None, help="time with this soft-cap of the scores")
    parser.add_argument("--alibi", action="store_true", help="time with ALiBi (geometric slopes)")
    parser.add_argument("--bias", choices=sorted(BENCH_BIAS_SHAPES), default=None, help="time with a bias of this shape")
    parser.add_argument("--json", metavar="FILE", help="with --bench: also time the decode shapes, write all to FILE")
    parser.add_argument("--resources", nargs="*", metavar="CC",
                        help="registers, local memory, spills and shared memory of every kernel (no GPU needed)")
    args = parser.parse_args(argv)
    if args.json is not None and not args.bench:
        parser.error("--json needs --bench")
    if args.resources is not None:
        _print_resources(args.resources or ["8.0", "9.0"])
    if args.ptx is not None:
        for cc in args.ptx or ["8.0", "9.0"]:
            major, minor = (int(part) for part in cc.split("."))
            code = ptx(cc=(major, minor))
            for name, text in code.items():
                if ".entry" not in text:
                    raise SystemExit(f"{name}: no kernel entry in the PTX for sm_{major}{minor}")
                print(f"sm_{major}{minor}  {name:32s} {len(text):8d} chars of PTX")
    if args.bench:
        B, H, N, D = args.shape
        options = dict(causal=args.causal, softcap=args.softcap, alibi=args.alibi, bias=args.bias)
        try:
            result = bench(B, H, N, D, **options)
        except BackendUnavailableError as exc:
            raise SystemExit(f"python -m elastic_np.cuda --bench: {exc}") from None
        print(
            f"float32, B={B} H={H} N=M={N} D={D} causal={args.causal} "
            f"softcap={args.softcap} alibi={args.alibi} bias={args.bias}"
        )
        for what in ("forward", "forward+backward"):
            ours, theirs = result["elastic_np"][what], result["torch"][what]
            line = (
                f"{what:17s} elastic_np {ours * 1e3:9.3f} ms ({result['tflops']['elastic_np'][what]:6.2f} TFLOP/s)"
                f"   torch SDPA {theirs * 1e3:9.3f} ms ({result['tflops']['torch'][what]:6.2f} TFLOP/s)"
                f"   speed ratio {theirs / ours:5.2f}"
            )
            if "elastic_np plain" in result:
                plain = result["elastic_np plain"][what]
                line += f"   modifiers cost x{ours / plain:5.2f} over plain ({plain * 1e3:.3f} ms)"
            print(line)


        if args.json is not None:
            from elastic_np import _cuda_bench

            decode = []
            for shape in DECODE_SHAPES:
                timing = bench_decode(*shape)
                decode.append((shape, timing))
                print(f"decode B, H/Hkv, N, M, D = {shape}: elastic_np {timing['elastic_np'] * 1e3:.3f} ms, "
                      f"torch SDPA {timing['torch'] * 1e3:.3f} ms, speed ratio {timing['torch'] / timing['elastic_np']:.2f}")
            record = bench_record((B, H, N, D), options, result, decode, _cuda_bench.machine_info())
            _cuda_bench.write_json(record, args.json)
            print(f"wrote {args.json}")


if __name__ == "__main__":
    _main()
