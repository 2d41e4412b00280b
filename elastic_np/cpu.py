"""Numba CPU kernels: tiled online-softmax attention, forward and backward.

The contract is the one of `elastic_np.reference.attention` (see the
project's contract, section 2): every option (causal, ``window_size``,
``kv_lengths``, boolean ``mask``, NVM, per-head ``tau`` and ``beta``, the
dynamic window, and the score modifiers ``softcap``, ``alibi_slopes`` and an
additive ``bias`` with its gradient) in float32 or float64, output in the
input dtype.

Layout of the work
------------------
Every tile holds scores *transposed*: ``st[c, r]`` is the score of key
``j0 + c`` against query ``i0 + r``. The query tile's scaled ``Q^T`` is built
once per task, so both products of the forward read plain row slices of ``k``
and ``v`` (``S^T = K_j Q^T``, ``O += (P^T)^T V_j``) and key tiles may start
anywhere: each query tile visits exactly the key range ``[j_lo, j_hi)`` that
causal, ``window_size``, ``kv_lengths`` and the dynamic-window band leave.
Per-query running statistics (``row_max``, ``row_sum``) are vectors along the
contiguous axis of the tile.

- forward: one task per (batch, head, query tile), the online-softmax
  recurrence with the ``beta`` term folded in at the end.
- backward: recomputation from ``lse`` (FlashAttention-2), one task per
  (batch, kv head, key tile): each task owns its ``dk``, ``dv`` rows
  (the query heads of a group summed inside the task) and writes its key
  tile's share of ``dq`` into a buffer of its own, together with per-task
  partial sums of ``dtau`` and ``dsigma``; the shares are then added in
  key-tile order (in chunks of key tiles when they would take more than
  `DQ_SHARES_BYTES`). No two tasks write the same memory and every sum runs
  in a fixed order, so results are the same bits on every run and for every
  thread count.
- score modifiers: applied to each tile where its logits are formed
  (`_logits_tile`), before NVM, the temperature's division (already in the
  scaled queries) and the gate: ``tanh`` is the vectorised one of
  `elastic_np._tiles`, the bias is read tile by tile from its distinct
  entries (no copy when its dtype is the kernel's), and its NaN and ``+inf``
  entries are counted as it is read (`prepare`, `_count_bad_bias`), also in
  the tiles a mask skips. ``dbias`` is written by
  the task that owns each of its elements: when the bias is broadcast over
  the batch or the heads, each task walks a fixed range of (batch, kv head)
  pairs (a "lane") and the lanes' float64 partials are summed in order; when
  it is broadcast over the keys, each key tile keeps a partial of its own
  (like the shares of dq), summed in key-tile order. A task takes the query
  tiles of several pairs in turn (`DBIAS_PAIR_BATCH`), so that a bias tile
  its heads share is read once for them all and their ``dbias`` is summed in
  cache (in the kernel dtype), then written out once; when one task takes
  all the terms of each element, that sum is the result (`_DbiasPlan`).

The tasks of a kernel run on a pool of Python threads (`_run_tasks`; the
kernels release the GIL), as many as `numba.get_num_threads` says, so the
number of threads follows `numba.set_num_threads` (`thread_count`).
"""

import collections
import concurrent.futures
import math
import os
import threading

import numba
import numba.np.ufunc.parallel as _numba_parallel
import numpy as np
from numba import njit, types
from numba.extending import overload

from elastic_np import _options as options_module
from elastic_np._tiles import (
    compile_for, exp_inplace, exp_shift_sum, matmul_nn, matmul_nn_max, matmul_tn, prefetch, sech2_any, stream_fence,
    stream_width, tanh_any, transpose_accumulate, transpose_add, transpose_load, transpose_store,
    transpose_stream, transpose_width,
)

__all__ = ["dtypes", "is_available", "check_available", "prepare", "forward", "backward"]

dtypes = (np.dtype(np.float32), np.dtype(np.float64))

#: Queries per tile (the vector axis of every tile) and keys per tile.
BLOCK_Q = 128
BLOCK_K = 128
#: The backward's key tiles are this many times BLOCK_K long: every key tile
#: reads all the query-side tiles (q, dout, both layouts) once, so longer key
#: tiles halve that traffic and the dq shares.
BACKWARD_K_FACTOR = 2
#: Memory for the backward's per-key-tile shares of dq (chunks of key tiles beyond it).
DQ_SHARES_BYTES = 1 << 25
#: Memory for the backward's float64 partials of a broadcast bias's gradient.
DBIAS_PARTIALS_BYTES = 1 << 25
#: Tasks the backward aims at when a broadcast bias folds (batch, kv head) pairs into lanes.
DBIAS_MIN_TASKS = 64
#: (batch, kv head) pairs of a lane whose query tiles a backward task
#: interleaves: each tile of a broadcast bias, and of its dbias sum over
#: heads, is then used by all their heads while it is in cache.
DBIAS_PAIR_BATCH = 8

# Reassociation lets LLVM vectorise the row sums; no flag that assumes
# finite values, since -inf marks every removed entry.
_FASTMATH = {"nsz", "arcp", "contract", "reassoc"}
# The typed tile functions each pass calls: a first call compiles only those (`compile_for`).
_FORWARD_TILES = (matmul_nn, matmul_nn_max, matmul_tn, exp_shift_sum)
_BACKWARD_TILES = (matmul_nn, matmul_nn_max, matmul_tn, exp_inplace)
# Numba compiles a function that sets no `fastmath` with the flags of whatever
# compiles it first (a kernel's, or none from Python), and keeps that version:
# the kernels' bits then depended on the order things were compiled in. Every
# njit function here states its own: _FASTMATH for the forward's tile code
# (which it had when the forward compiled it first), False elsewhere.

# Everything the njit code needs to know about the options, as runtime values:
# one compiled specialisation per dtype whatever the options are.
_Options = collections.namedtuple(
    "_Options",
    [
        "scale",  # float
        "causal",  # bool
        "left",  # int, -1 unbounded
        "right",  # int, -1 unbounded
        "nvm",  # bool
        "has_mask",  # bool
        "has_gate",  # bool
        "tau",  # float64 (H,)
        "beta",  # float64 (H,)
        "kv_lengths",  # int64 (B,)
        "kv_ends",  # int64 (B,): the key length offsets align to, off = j - i - (kv_ends[b] - N)
        "mask",  # bool, 1-D: the mask's distinct entries, C order
        "mask_strides",  # int64 (4,): element strides of (b, h, i, j) into `mask`, 0 when broadcast
        "log_gate",  # float64 (B, H, N + M - 1): log G by offset j - i - (kv_ends[b] - N), + M - 1
        "dlog_gate",  # float64, same shape: d log G / d sigma (0 where G = 0)
        "band",  # int64 (B, H, 2): offsets [lo, hi] where the gate is open
        "has_softcap",  # bool
        "softcap",  # float (1.0 when off)
        "has_alibi",  # bool
        "alibi",  # float64 (B, H) slopes (1 x 1 zeros when off)
        "has_bias",  # bool
        "bias",  # kernel dtype, 1-D read-only: the bias's distinct entries (a 1-element dummy when off)
        "bias_strides",  # int64 (4,): element strides of (b, h, i, j) into `bias`, 0 when broadcast
        "check_bias",  # bool: the kernels count the bias's NaN and +inf entries (`_count_bad_bias`)
    ],
)


def is_available():
    """True: the CPU kernels need only NumPy and Numba."""
    return True


def check_available():
    """Raise nothing: the CPU backend is always usable once imported."""
    return None


# ---------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------


def prepare(q, k, v, **options):
    """`elastic_np._options.prepare`, leaving the bias's values, and the keys' and values', to the kernels.

    The kernels read every bias entry anyway, so they also count its NaN and
    ``+inf`` entries (`_count_bad_bias`), including those of tiles a mask
    skips, and `forward` and `backward` raise the same ValueError as the
    check before the call would: a separate pass over a bias as large as
    the score matrix cost as much as the kernel's own read of it. The decode
    kernel finds a NaN or inf key or value as it reads them
    (`elastic_np._decode`): at decode shapes a separate pass over the cache
    costs as much as the attention; the other paths check them first.
    """
    return options_module.prepare(q, k, v, defer_bias_check=True, defer_kv_check=True, **options)


def _check_cache(problem):
    """The check `prepare` deferred, for the paths that do not make it as they read."""
    if problem.kv_unchecked:
        options_module.check_cache_values(problem.k, problem.v, problem.kv_lengths)


def forward(problem):
    """Attention forward for a validated problem: ``(out, lse)`` in the input dtype.

    Parameters
    ----------
    problem : elastic_np._options.AttentionProblem

    Returns
    -------
    out : ndarray, shape (B, H, N, Dv)
    lse : ndarray, shape (B, H, N)
    """
    from elastic_np import _decode  # it builds on this module

    if _decode.takes(problem):
        compile_for(problem.dtype, _decode.TILES)
        return _decode.forward(problem)
    compile_for(problem.dtype, _FORWARD_TILES)
    _check_cache(problem)
    B, H, Hkv, N, M, D, Dv = problem.shape
    q, k, v = (_kernel_array(a) for a in (problem.q, problem.k, problem.v))
    out = np.empty((B, H, N, Dv), dtype=q.dtype)
    lse = np.empty((B, H, N), dtype=q.dtype)
    opt = _options(problem, with_sigma_grad=False, dtype=q.dtype)
    bad_bias = np.zeros((B, H, -(-N // BLOCK_Q)), dtype=np.int64)
    _run_tasks(_forward_kernel, q, k, v, opt, BLOCK_Q, BLOCK_K, out, lse, bad_bias,
               work=B * H * N * M * (D + Dv))
    _raise_on_bad_bias(bad_bias)
    return out, lse


def backward(problem, dout, out, lse, dlse=None):
    """Gradients of the attention for ``q, k, v, tau, beta, sigma, bias``.

    Parameters
    ----------
    problem : elastic_np._options.AttentionProblem
    dout, out : ndarray, shape (B, H, N, Dv)
    lse : ndarray, shape (B, H, N)
        In the problem's dtype, as `forward` returned them.
    dlse : ndarray, shape (B, H, N), optional
        Cotangent of ``lse`` in the problem's dtype; None for zeros.

    Returns
    -------
    AttentionGrads
    """
    _check_cache(problem)
    compile_for(problem.dtype, _BACKWARD_TILES)
    B, H, Hkv, N, M, D, Dv = problem.shape
    dtype = problem.dtype
    q, k, v, dout, out, lse = (
        _kernel_array(a) for a in (problem.q, problem.k, problem.v, dout, out, lse)
    )
    opt = _options(problem, with_sigma_grad=True, dtype=dtype)
    n_qt = -(-N // BLOCK_Q)

    # Per-head scaled queries q * scale / tau_h, row-major and as Q^T tiles,
    # dout^T tiles, and delta_i = dout_i . out_i - dlse_i.
    q_scaled = np.empty((B, H, N, D), dtype=dtype)
    q_scaled_t = np.zeros((B, H, n_qt, D, BLOCK_Q), dtype=dtype)
    dout_t = np.zeros((B, H, n_qt, Dv, BLOCK_Q), dtype=dtype)
    delta = np.empty((B, H, N), dtype=np.float64)
    _run_tasks(_backward_prepare, q, dout, out, opt, BLOCK_Q, q_scaled, q_scaled_t, dout_t, delta)
    if dlse is not None:
        np.subtract(delta, dlse, out=delta)

    # One pass over key tiles gives dk, dv and each key tile's share of dq;
    # the shares are summed in key-tile order afterwards (no racing writes).
    # Key tiles go in chunks so that the shares take at most DQ_SHARES_BYTES.
    block_k = BLOCK_K * BACKWARD_K_FACTOR
    n_kt = -(-M // block_k)
    share_bytes = max(B * H * N * D * q.itemsize, 1)
    chunk = int(min(max(DQ_SHARES_BYTES // share_bytes, 1), max(n_kt, 1)))
    dq_shares = np.empty((chunk, B, H, N, D), dtype=dtype)
    share_rows = np.zeros((chunk, B, H, 2), dtype=np.int64)
    dq = np.zeros_like(q)
    dk = np.empty_like(k)
    dv = np.empty_like(v)
    dtau_part = np.zeros((B, H, n_kt))
    dsigma_part = np.zeros((B, H, n_kt))
    bad_bias = np.zeros((B, H, n_kt), dtype=np.int64)
    plan = _DbiasPlan(problem, dtype, n_kt, chunk)
    for kt0 in range(0, n_kt, chunk):
        kt1 = min(kt0 + chunk, n_kt)
        _run_tasks(
            _backward_kernel, k, v, q_scaled, q_scaled_t, dout, dout_t, lse, delta, opt, BLOCK_Q, block_k,
            kt0, kt1, dk, dv, dq_shares, share_rows, dtau_part, dsigma_part,
            plan.params, plan.strides, plan.direct, plan.partials, bad_bias,
        )
        _run_tasks(_sum_dq_shares, dq_shares, share_rows, kt1 - kt0, BLOCK_Q, dq)
        plan.after_chunk()
    _raise_on_bad_bias(bad_bias)
    # dq = (scale / tau_h) * sum_j ds_ij k_j, in float64 then rounded, as a kernel would
    factor = (problem.scale / problem.tau)[None, :, None, None]
    np.multiply(dq, factor, out=dq, casting="unsafe")
    return problem.reduce_grads(
        dq, dk, dv,
        dtau_part.sum(axis=2),
        problem.sink_gradient(delta, lse),
        dsigma_part.sum(axis=2) if problem.sigma is not None else None,
        dbias=plan.result(),
    )


class _DbiasPlan:
    """Where the backward writes ``dbias``, and how the pieces are summed.

    ``dbias`` is computed in its compact shape: the full ``(B, H, N, M)`` with
    size 1 on the axes the bias is broadcast along (`reduce_grads` turns it
    into the bias's own shape). Modes (``params[0]``):

    - 0: no bias.
    - 1: nothing to reduce; each element is written once, in the kernel
      dtype, straight into `direct`.
    - 2: a reduction; float64 ``partials[slot]``. Broadcast over the batch
      (heads) folds the batch (kv-head) loop into the tasks, split into
      ``lanes`` fixed ranges of (batch, kv head) pairs, one slot per lane;
      broadcast over the keys adds one slot per key tile of a chunk. The
      slots are summed in order: the same bits for every thread count.
    - 3: as 2 for a bias broadcast over the heads and laid out along the
      keys, when one task sums each element over all its (batch, head)
      pairs (one lane, one batch of pairs, below): that sum, in the kernel
      dtype, is written into `direct`, with no partials.

    A task interleaves the query tiles of ``pair_batch`` pairs of its lane
    at a time (`DBIAS_PAIR_BATCH`).

    ``params = [mode, fold_b, fold_h, lanes, slots_per_lane, pair_batch]``; ``strides``
    are the element strides of ``(b, h, i, j)`` into the compact ``dbias``.
    """

    def __init__(self, p, dtype, n_kt, chunk):
        B, H, Hkv, N, M, D, Dv = p.shape
        self.params = np.array([0, 0, 0, 1, 1, 1], dtype=np.int64)
        self.strides = np.zeros(4, dtype=np.int64)
        self.direct = np.zeros(1, dtype=dtype)
        self.partials = np.zeros((1, 1))
        self.total = None
        if p.bias is None:
            return
        full = (B, H, N, M)
        given = (1,) * (4 - len(p.bias_shape)) + tuple(p.bias_shape)
        reduced = [given[a] == 1 and full[a] > 1 for a in range(4)]
        self.shape = tuple(1 if r else n for r, n in zip(reduced, full))
        size = int(np.prod(self.shape))
        step = 1
        for a in (3, 2, 1, 0):
            self.strides[a] = 0 if self.shape[a] == 1 else step
            step *= self.shape[a]
        if not any(reduced):
            self.params[0] = 1
            self.direct = _zeros_on_lines(size, dtype)
            return
        fold_b, fold_h, per_key_tile = reduced[0], reduced[1], reduced[3]
        pairs = (B if fold_b else 1) * (Hkv if fold_h else 1)
        outer = (1 if fold_b else B) * (1 if fold_h else Hkv)
        slots_per_lane = chunk if per_key_tile else 1
        by_memory = DBIAS_PARTIALS_BYTES // max(8 * size * slots_per_lane, 1)
        # an empty batch or key set leaves pairs, outer or n_kt at 0: one lane of nothing
        lanes = max(min(pairs, -(-DBIAS_MIN_TASKS // max(outer * n_kt, 1)), max(by_memory, 1)), 1)
        pair_batch = max(min(DBIAS_PAIR_BATCH, -(-pairs // lanes)), 1)
        self.per_key_tile = per_key_tile
        by_heads = self.strides[1] == 0 and self.strides[2] > 1 and self.strides[3] == 1
        if by_heads and lanes == 1 and pair_batch == pairs:
            self.params[:] = (3, fold_b, fold_h, 1, 1, pair_batch)
            self.direct = _zeros_on_lines(size, dtype)
            return
        self.params[:] = (2, fold_b, fold_h, lanes, slots_per_lane, pair_batch)
        self.partials = np.zeros((lanes * slots_per_lane, size))
        self.total = np.zeros(size) if per_key_tile else None

    def after_chunk(self):
        """Fold the per-key-tile slots of a chunk into the total, in slot order."""
        if self.params[0] == 2 and self.per_key_tile:
            self.total += self.partials.sum(axis=0)
            self.partials[...] = 0.0

    def result(self):
        """The compact ``dbias`` (None without a bias)."""
        mode = self.params[0]
        if mode == 0:
            return None
        if mode != 2:
            return self.direct.reshape(self.shape)
        if not self.per_key_tile:
            # the slots in order; a single slot is the sum (no 0 + x pass)
            self.total = self.partials[0] if len(self.partials) == 1 else self.partials.sum(axis=0)
        return self.total.reshape(self.shape)


def _zeros_on_lines(size, dtype):
    """``np.zeros(size, dtype)`` starting on a cache line: `_store_transposed` streams whole lines into it."""
    line = stream_width(np.dtype(dtype))
    buffer = np.zeros(size + line, dtype=dtype)
    skip = (-buffer.ctypes.data // buffer.itemsize) % line
    return buffer[skip : skip + size]


def _raise_on_bad_bias(counts):
    """Raise `elastic_np._options.BIAS_VALUES_ERROR` when the kernels counted a NaN or +inf bias entry."""
    if counts.any():
        raise ValueError(options_module.BIAS_VALUES_ERROR)


def _kernel_array(a):
    """``a`` itself when C-contiguous and writable, else a copy that is.

    The kernels never write to their inputs, but a read-only or strided array
    is another Numba type, and every new type compiles every kernel again.
    """
    if a.flags.c_contiguous and a.flags.writeable:
        return a
    return np.array(a, order="C", copy=True)


_pool = None  # (threads, executor)
_pool_lock = threading.Lock()


def _forget_pool():
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()  # a thread of the parent may have held it


os.register_at_fork(after_in_child=_forget_pool)  # a forked child has none of the threads


def thread_count():
    """The threads the kernels run on: `numba.get_num_threads`, without starting Numba's threads.

    ``numba.get_num_threads()`` first launches Numba's threading layer, which
    may load an OpenMP runtime beside another library's (PyTorch's), and that
    slows the other library's parallel code in the same process. The kernels
    never use that layer, so until something else has launched it (as
    ``numba.set_num_threads`` does) the count is its default,
    ``numba.config.NUMBA_NUM_THREADS``, the value it would report.
    """
    if getattr(_numba_parallel, "_is_initialized", True):
        return numba.get_num_threads()
    return numba.config.NUMBA_NUM_THREADS


#: Multiply-adds below which a call runs on the calling thread: handing work to
#: the pool and waiting for it costs about as much as this much arithmetic.
SERIAL_WORK = 1 << 21


def _run_tasks(kernel, *args, work=None):
    """Run ``kernel(*args, part, parts)`` on `thread_count` threads.

    With ``work`` (the multiply-adds of the call, an estimate) below
    `SERIAL_WORK`, on the calling thread alone.

    Thread ``part`` of ``parts`` runs its contiguous share of the kernel's
    tasks (`_task_range`; the kernels release the GIL). Every task writes
    outputs of its own, so the result has the same bits for every thread
    count. Threads instead of ``prange``: a parallel Numba function compiles
    its loop body again as a gufunc and LLVM optimises it once per level it
    is linked into, which doubled the first compile of these kernels.
    """
    global _pool
    threads = thread_count()
    if threads == 1 or (work is not None and work < SERIAL_WORK):
        kernel(*args, 0, 1)
        return
    with _pool_lock:  # another Python thread may replace the pool meanwhile
        if _pool is None or _pool[0] < threads:
            if _pool is not None:
                _pool[1].shutdown(wait=False)  # its idle threads exit; queued tasks still run
            _pool = (threads, concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="elastic_np"))
        futures = [_pool[1].submit(kernel, *args, t, threads) for t in range(threads)]
    for future in futures:
        future.result()


@njit(cache=True, fastmath=False)
def _task_range(n, part, parts):
    """The tasks of thread ``part`` of ``parts``: a contiguous share of ``range(n)``.

    Contiguous, as ``prange`` schedules them: consecutive tasks alternate a
    cheap and a costly tile under a causal mask (`_zigzag`), so any run of
    them is balanced, where every ``parts``-th task would not be (with two
    threads, one would get every cheap tile).
    """
    return range(n * part // parts, n * (part + 1) // parts)


def _options(p, with_sigma_grad, dtype):
    B, H, Hkv, N, M, D, Dv = p.shape
    if p.mask is None:
        mask = np.ones(1, dtype=np.bool_)
        mask_strides = np.zeros(4, dtype=np.int64)
    else:
        mask, mask_strides = _compact_mask(p.mask)
    if p.sigma is None:
        log_gate = dlog_gate = np.zeros((1, 1, 1))
        band = np.zeros((1, 1, 2), dtype=np.int64)
    else:
        width = max(N + M - 1, 1)
        log_gate = np.empty((B, H, width))
        dlog_gate = np.empty((B, H, width) if with_sigma_grad else (1, 1, 1))
        band = np.empty((B, H, 2), dtype=np.int64)
        _window_tables(
            p.sigma, float(p.sharpness), float(p.threshold), N, M,
            np.ascontiguousarray(p.kv_ends, dtype=np.int64), with_sigma_grad, log_gate, dlog_gate, band,
        )
    check_bias = p.bias_unchecked
    if p.bias is None:
        bias = np.zeros(1, dtype=dtype)
        bias.setflags(write=False)
        bias_strides = np.zeros(4, dtype=np.int64)
    else:
        bias, bias_strides = _compact_bias(p.bias, dtype)
        if check_bias and not np.may_share_memory(bias, p.bias):
            # converted: the caller's values are checked, then the converted
            # ones (a float64 entry beyond the float32 range becomes +inf)
            options_module.check_bias_values(p.bias)
            options_module.check_bias_values(
                bias, f"`bias` has finite entries beyond the range of {dtype}, the kernels' dtype"
            )
            check_bias = False
    return _Options(
        scale=float(p.scale),
        causal=bool(p.causal),
        left=int(p.window[0]),
        right=int(p.window[1]),
        nvm=bool(p.nvm),
        has_mask=p.mask is not None,
        has_gate=p.sigma is not None,
        tau=np.ascontiguousarray(p.tau, dtype=np.float64),
        beta=np.ascontiguousarray(p.beta, dtype=np.float64),
        kv_lengths=np.ascontiguousarray(p.kv_lengths, dtype=np.int64),
        kv_ends=np.ascontiguousarray(p.kv_ends, dtype=np.int64),
        mask=mask,
        mask_strides=mask_strides,
        log_gate=log_gate,
        dlog_gate=dlog_gate,
        band=band,
        has_softcap=p.softcap is not None,
        softcap=float(p.softcap) if p.softcap is not None else 1.0,
        has_alibi=p.alibi is not None,
        alibi=np.zeros((1, 1)) if p.alibi is None else np.ascontiguousarray(p.alibi, np.float64),
        has_bias=p.bias is not None,
        bias=bias,
        bias_strides=bias_strides,
        check_bias=check_bias,
    )


def _compact_mask(mask):
    """The distinct entries of a broadcast boolean view, flat, with element strides.

    ``mask[b, h, i, j] == flat[b*s0 + h*s1 + i*s2 + j*s3]``; broadcast axes
    have stride 0, so a ``(N, M)`` mask stays ``N * M`` booleans.
    """
    index = tuple(slice(0, 1) if s == 0 else slice(None) for s in mask.strides)
    compact = _kernel_array(mask[index])
    strides = [
        0 if s == 0 or n == 1 else cs // compact.itemsize
        for s, n, cs in zip(mask.strides, compact.shape, compact.strides)
    ]
    return compact.reshape(-1), np.array(strides, dtype=np.int64)


def _compact_bias(bias, dtype):
    """The distinct entries of a broadcast bias view, flat and read-only, with element strides.

    ``bias[b, h, i, j] == flat[b*s0 + h*s1 + i*s2 + j*s3]``. The caller's
    memory is read as it is, at its strides (no copy), when it has the
    kernel dtype, is aligned and has no negative stride: C or Fortran
    order, the last two axes transposed (``.mT``), a slice of a larger
    array. Otherwise the distinct entries are copied, converted, in C order.
    Always read-only, so that the kernels see one array type.
    """
    index = tuple(slice(0, 1) if s == 0 else slice(None) for s in bias.strides)
    compact = bias[index]
    itemsize = np.dtype(dtype).itemsize
    readable = (
        compact.dtype == dtype
        and compact.flags.aligned
        and all(s >= 0 and s % itemsize == 0 for s, n in zip(compact.strides, compact.shape) if n > 1)
    )
    if not readable:
        with np.errstate(over="ignore"):  # beyond the range: -inf removes, +inf raises (`_options`)
            compact = np.ascontiguousarray(compact, dtype=dtype)
    # the memory from the first entry to the last, read through element strides
    span = 0
    if compact.size:
        span = 1 + sum((n - 1) * s for n, s in zip(compact.shape, compact.strides) if n > 1) // itemsize
    flat = np.lib.stride_tricks.as_strided(compact, (span,), (itemsize,), writeable=False)
    strides = [
        0 if s == 0 or n == 1 else cs // itemsize
        for s, n, cs in zip(bias.strides, compact.shape, compact.strides)
    ]
    return flat, np.array(strides, dtype=np.int64)


# ---------------------------------------------------------------------------
# Shared njit helpers
# ---------------------------------------------------------------------------


@njit(cache=True, fastmath=False)
def _window_tables(sigma, sharpness, threshold, N, M, ends, with_grad, log_gate, dlog_gate, band):
    """Tabulate the dynamic-window gate by offset ``off = j - i - (E_b - N)``, ``E_b = ends[b]``.

    Fills ``log_gate[b, h, off + M - 1] = log G`` (``-inf`` where the gate is
    closed) and, with ``with_grad``, ``dlog_gate`` with ``d log G / d sigma``
    (0 where closed); ``band[b, h] = [lo, hi]``, the offsets between the first
    and the last open entry (``lo > hi`` when none is open).

    The band is first bounded analytically, ``f > threshold`` only where
    ``x^2 < 2 sigma^2 log(1 / (threshold sigma sqrt(2 pi)))`` (where ``f``
    does not underflow to 0 for ``threshold = 0``), widened by a margin; the
    table is evaluated only there, and the band is then trimmed to the entries
    that are exactly open. The position is ``x = 2 off / (E_b - 1)`` (0 for
    ``E_b <= 1``); the offsets run over ``[1 - M, N - 1]`` whatever ``E_b``.
    """
    B, H = sigma.shape
    width = log_gate.shape[2]
    root_2pi = math.sqrt(2 * math.pi)
    for b in range(B):
        E = ends[b]
        for h in range(H):
            s = sigma[b, h]
            for t in range(width):
                log_gate[b, h, t] = -np.inf
                if with_grad:
                    dlog_gate[b, h, t] = 0.0
            # Analytic bound on |x| where f > threshold (or f > 0).
            if threshold > 0.0:
                c = threshold * s * root_2pi
                y_max = -math.log(c) if c < 1.0 else -1.0
            else:
                y_max = 746.0  # exp(-y) underflows to 0 beyond about 745.13
            if y_max < 0.0:
                band[b, h, 0] = 1
                band[b, h, 1] = 0
                continue
            if E > 1:
                x_max = s * math.sqrt(2.0 * y_max) * (1.0 + 1e-6) + 1e-12
                reach = min(x_max * (E - 1) / 2.0 + 2.0, float(N + M + 1))
                off_reach = int(reach)
            else:
                off_reach = N + M + 1
            lo_t = max(-off_reach + M - 1, 0)
            hi_t = min(off_reach + M - 1, width - 1)
            first = width
            last = -1
            for t in range(lo_t, hi_t + 1):
                off = t - (M - 1)
                x = 2.0 * off / (E - 1) if E > 1 else 0.0
                u = x / s  # divided first: s * s and s**3 underflow for a tiny sigma
                f = math.exp(-0.5 * (u * u)) / (s * root_2pi)
                g = math.tanh(sharpness * (f if f > threshold else 0.0))
                if g > 0.0:
                    log_gate[b, h, t] = math.log(g)
                    if with_grad:
                        # d log G / d sigma = sharpness (1 - G^2) / G f (x^2 / s^3 - 1 / s), with
                        # (1 - g^2) / g = 2 / sinh(2y) = 4 e / (1 - e^2), e = exp(-2y), y = sharpness f:
                        # no cancellation as g -> 1, no overflow as y grows
                        y = sharpness * f
                        dlog_dy = 4.0 * math.exp(-2.0 * y) / -math.expm1(-4.0 * y)
                        dlog_gate[b, h, t] = sharpness * dlog_dy * f * ((u * u - 1.0) / s)
                    first = min(first, t)
                    last = max(last, t)
            band[b, h, 0] = first - (M - 1)
            band[b, h, 1] = last - (M - 1)


@njit(cache=True, fastmath=False)
def _zigzag(t, n):
    """Visit tiles 0, n-1, 1, n-2, ...: cheap and costly causal tiles alternate."""
    return t // 2 if t % 2 == 0 else n - 1 - t // 2


@njit(cache=True, fastmath=False)
def _offset_range(opt, b, h, N, M):
    """Offsets ``off = j - i - (kv_ends[b] - N)`` that causal, the window and the gate band allow: ``[lo, hi]``."""
    lo = -(M + 1)
    hi = N + 1
    if opt.causal:
        hi = min(hi, 0)
    if opt.left >= 0:
        lo = max(lo, -opt.left)
    if opt.right >= 0:
        hi = min(hi, opt.right)
    if opt.has_gate:
        lo = max(lo, opt.band[b, h, 0])
        hi = min(hi, opt.band[b, h, 1])
    return lo, hi


@njit(cache=True, fastmath=False)
def _key_range(opt, b, i0, bq, N, M, off_lo, off_hi):
    """Keys ``[j_lo, j_hi)`` that queries ``i0 .. i0 + bq - 1`` may keep."""
    shift = opt.kv_ends[b] - N
    j_lo = max(i0 + shift + off_lo, 0)
    j_hi = min(i0 + bq + shift + off_hi, opt.kv_lengths[b])
    return j_lo, max(j_hi, j_lo)


@njit(cache=True, fastmath=False)
def _query_range(opt, b, j0, bk, N, off_lo, off_hi):
    """Queries ``[i_lo, i_hi)`` that keys ``j0 .. j0 + bk - 1`` may be kept by."""
    shift = opt.kv_ends[b] - N
    i_lo = max(j0 - shift - off_hi, 0)
    i_hi = min(j0 + bk - shift - off_lo, N)
    return i_lo, max(i_hi, i_lo)


@njit(cache=True, fastmath=False)
def _removes_nothing(opt, b, i0, bq, j0, bk, N, off_lo, off_hi, nvm):
    """True when no entry of the tile is removed (inside the offset range, no NVM, mask or gate)."""
    shift = opt.kv_ends[b] - N
    # Whole tile inside [off_lo, off_hi]: the last key with the first query
    # and the first key with the last query are the extreme offsets.
    inside = (j0 + bk - 1 - i0 - shift <= off_hi) and (j0 - (i0 + bq - 1) - shift >= off_lo)
    return inside and not (nvm or opt.has_mask or opt.has_gate)


def _like(x, arr):
    """``x`` as a scalar of the dtype of the array ``arr`` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_like, inline="always")
def _like_overload(x, arr):
    if isinstance(arr, types.Array) and arr.dtype == types.float32:
        return lambda x, arr: np.float32(x)
    if isinstance(arr, types.Array) and arr.dtype == types.float64:
        return lambda x, arr: np.float64(x)
    return None


@njit(cache=True, fastmath=_FASTMATH)
def _logits_tile(
    st, k_j, q_t, D, opt, b, h, i0, bq, j0, bk, N, M, off_lo, off_hi, nvm, slope, tile_max, nonneg,
    bias_t,
):
    """The logits of a tile: ``st[c, r]`` for key ``j0 + c`` and query ``i0 + r``.

    The product ``K_j Q^T`` (``k_j`` the tile's keys, ``q_t`` its queries
    scaled by ``scale / tau_h``, transposed) gives ``s_raw / tau_h``; the
    score modifiers follow in the contract's order (see `_modify_tile`).
    Without a soft-cap (or NVM) they are additive: they are stored first and
    the product accumulates onto them (one pass over the tile less). Removed
    entries then become ``-inf``: outside the offset range, ``s < 0`` under
    NVM on the final ``s`` (when ``nvm``, which the forward leaves to its own
    first pass when it can), a closed gate, a false mask entry (a ``-inf``
    bias is ``-inf`` already); the others get ``log G`` added.

    ``slope`` receives ``1 - tanh^2`` under a soft-cap when it has the
    tile's shape (the backward), not when it is empty. ``bias_t``, when
    not empty, holds the tile's bias key-major (``bias_t[c, r]``), loaded
    once for the heads that share it (see `_modify_tile`).
    ``tile_max`` (length ``bq`` or more; empty when not wanted) is raised to
    the column maxima of the logits (of those ``>= 0`` with ``nonneg``) when
    they come with the product: whenever nothing is removed and no modifier
    is added after the product. Both are told by the arrays, not by flags:
    a literal flag would compile this function once per value.

    Returns ``(kept, maxed, clean)``: ``kept`` is False when the mask leaves
    nothing in the tile (so the caller may skip it); ``maxed`` is True when
    ``tile_max[:bq]`` holds the maxima; ``clean`` is True when the tile's
    bias entries were checked as they were read (see `_modify_tile`).
    """
    want_slope = slope.shape[0] > 0
    want_max = tile_max.shape[0] > 0
    removes_nothing = _removes_nothing(opt, b, i0, bq, j0, bk, N, off_lo, off_hi, nvm)
    additive = opt.has_alibi or opt.has_bias
    # Accumulating the product onto the bias rounds s with partial sums that
    # include it; under NVM its sign decides removal, so it is then formed in
    # the contract's order, the product first (measured: dtau's error in
    # float32 doubles otherwise).
    additive_first = additive and not opt.has_softcap and not opt.nvm
    fuse_max = want_max and removes_nothing and (additive_first or not additive)
    clean = not opt.has_bias
    if additive_first:
        clean = _modify_tile(st, opt, b, h, i0, bq, j0, bk, N, M, slope, want_slope, additive_first, bias_t)
        if fuse_max:
            matmul_nn_max(k_j, q_t, st, bk, bq, D, tile_max, nonneg, True)
        else:
            matmul_nn(k_j, q_t, st, bk, bq, D, True)
    else:
        if fuse_max:
            matmul_nn_max(k_j, q_t, st, bk, bq, D, tile_max, nonneg, False)
        else:
            matmul_nn(k_j, q_t, st, bk, bq, D, False)
        if opt.nvm:
            _scale_logits(st, bk, bq, opt, h, tile_max[:bq] if fuse_max else tile_max[:0])
        if opt.has_softcap or additive:
            clean = _modify_tile(st, opt, b, h, i0, bq, j0, bk, N, M, slope, want_slope, additive_first, bias_t)
            if fuse_max:
                # soft-cap alone: tanh is odd and increasing, so the capped
                # tile's maxima (and its entries >= 0) are the raw ones capped
                # (the same expression as in _modify_tile)
                tau_over_cap = _like(opt.tau[h] / opt.softcap, st)
                cap_over_tau = _like(opt.softcap * (1.0 / opt.tau[h]), st)
                for r in range(bq):
                    x = tile_max[r]
                    if x > -np.inf:
                        tile_max[r] = cap_over_tau * tanh_any(x * tau_over_cap)
    if removes_nothing:
        return True, fuse_max, clean
    shift = opt.kv_ends[b] - N
    neg_inf = -np.inf
    any_kept = False
    for c in range(bk):
        j = j0 + c
        row = st[c]
        # off = j - (i0 + r) - shift in [off_lo, off_hi]
        r_lo = min(max(j - shift - off_hi - i0, 0), bq)
        r_hi = max(min(j - shift - off_lo - i0 + 1, bq), r_lo)
        for r in range(r_lo):
            row[r] = neg_inf
        for r in range(r_hi, bq):
            row[r] = neg_inf
        kept = _remove_in_row(row, opt, b, h, j, i0, r_lo, r_hi, M, shift, nvm, opt.has_mask)
        any_kept = any_kept or kept
    return any_kept, False, clean


@njit(cache=True, fastmath=False)
def _query_factor(opt, h):
    """What the queries of head ``h`` are multiplied by before ``Q K^T``: ``scale / tau_h``.

    Under NVM, 1: the product is scaled afterwards (`_scale_logits`), so that
    a score ``q . k`` that is exactly 0 stays 0 and is kept (``s >= 0``);
    rounding ``q * scale / tau_h`` first could make it ``-eps``.
    """
    return 1.0 if opt.nvm else opt.scale / opt.tau[h]


@njit(cache=True, fastmath=False)
def _scale_logits(st, bk, bq, opt, h, tile_max):
    """``st[:bk, :bq] *= scale / tau_h`` and the ``tile_max`` given (when `_query_factor` is 1).

    A positive factor keeps every sign, and the maxima (rounding is monotone).
    """
    for c in range(bk):
        scale_logits_row(st[c, :bq], opt, h)
    scale_logits_row(tile_max, opt, h)


@njit(cache=True, fastmath=False)
def scale_logits_row(z, opt, h):
    """``z *= scale / tau_h`` in ``z``'s dtype, without fast-math: the same bits wherever inlined."""
    factor = _like(opt.scale / opt.tau[h], z)
    for c in range(z.shape[0]):
        z[c] *= factor


#: Keys per block when a tile adds a bias laid out along the keys.
_BIAS_KEYS = 32


@njit(cache=True, fastmath=False)
def _prefetch_bias(opt, b, h, i0, bq, j0, bk, N, M):
    """Prefetch the bias of the tile ``[i0, i0 + bq) x [j0, j0 + bk)``, one line at a time.

    A bias laid out along the keys is read by a tile as ``bq`` short runs,
    a whole row of the caller's array apart (a bias laid out along the
    queries as ``bk`` runs): too many streams for the hardware prefetcher.
    Kernels call it for the next tile while they compute the current one.
    """
    s_i, s_j = opt.bias_strides[2], opt.bias_strides[3]
    if not opt.has_bias or min(s_i, s_j) != 1 or max(s_i, s_j) <= 1:
        return
    if s_j == 1:  # a run of keys per query
        first, length, lo, hi, apart = j0, min(bk, M - j0), max(i0, 0), min(i0 + bq, N), s_i
    else:  # a run of queries per key
        first, length, lo, hi, apart = i0, min(bq, N - i0), max(j0, 0), min(j0 + bk, M), s_j
    step = max(64 // opt.bias.itemsize, 1)  # elements per cache line
    start = b * opt.bias_strides[0] + h * opt.bias_strides[1] + first
    for x in range(lo, hi):
        at = start + x * apart
        for c in range(0, length, step):
            prefetch(opt.bias, at + c)


@njit(cache=True, fastmath=False)
def _count_bad_bias(opt, b, h, i0, i1, j0, j1):
    """How many bias entries of head ``(b, h)``, queries ``[i0, i1)``, keys ``[j0, j1)`` are NaN or ``+inf``.

    0 unless ``opt.check_bias``. A caller covers a block of the entries;
    along an axis the bias is broadcast over, only the block at index 0
    counts (``b = 0``, ``h = 0``, ``i0 = 0``, ``j0 = 0``), and a single
    entry of it: every distinct entry is counted once over the blocks that
    cover ``(B, H, N, M)``. Not fastmath: the comparison must see NaN.
    Callers pass ``np.intp(0)``, never a literal 0, which would compile a
    specialisation of its own.
    """
    s_b, s_h, s_i, s_j = opt.bias_strides[0], opt.bias_strides[1], opt.bias_strides[2], opt.bias_strides[3]
    if not opt.check_bias or i0 >= i1 or j0 >= j1:
        return 0
    if (s_b == 0 and b > 0) or (s_h == 0 and h > 0) or (s_i == 0 and i0 > 0) or (s_j == 0 and j0 > 0):
        return 0
    if s_i == 0:
        i1 = i0 + 1
    if s_j == 0:
        j1 = j0 + 1
    bad = 0
    if s_i == 1 and s_j != 1:
        # queries contiguous: one run per key
        for j in range(j0, j1):
            at = b * s_b + h * s_h + j * s_j
            bad += _count_bad(opt.bias[at + i0 : at + i1])
        return bad
    for i in range(i0, i1):
        at = b * s_b + h * s_h + i * s_i
        if s_j == 1:
            bad += _count_bad(opt.bias[at + j0 : at + j1])
        else:
            for j in range(j0, j1):
                bad += 0 if opt.bias[at + j * s_j] < np.inf else 1
    return bad


@njit(cache=True, fastmath=False)
def _count_bad(values):
    """How many of ``values`` are NaN or ``+inf`` (not fastmath: the comparison must see NaN)."""
    bad = 0
    for r in range(values.shape[0]):  # indexed: `for x in values` does not vectorise
        bad += 0 if values[r] < np.inf else 1
    return bad


@njit(cache=True, fastmath=_FASTMATH)
def _modify_tile(st, opt, b, h, i0, bq, j0, bk, N, M, slope, want_slope, overwrite, bias_t):
    """The score modifiers on a whole tile ``st[:bk, :bq]`` of ``s_raw / tau_h``.

    ``s = softcap tanh(s_raw / softcap)``, then ``- alibi |off|``, then
    ``+ bias``, each divided by ``tau_h`` like the score; entries the caller
    removes afterwards are computed too (every tile entry is finite here, so
    that nothing is lost and the loops run from 0 and vectorise). With
    ``want_slope`` (and a soft-cap), ``slope[c, r]`` receives ``ds / ds_raw =
    1 - tanh^2``. With ``overwrite`` (no soft-cap), ``st`` is not read: it
    receives ``(- alibi |off| + bias) / tau_h``, for the product to be added.
    A bias contiguous along the keys comes from ``bias_t[:bk, :bq]`` (the
    tile's entries, key-major) when that is not empty, else from ``opt.bias``.

    Returns True when there is no bias, or when the tile's bias entries were
    read from ``opt.bias`` and checked as they were (row by row, or
    `_add_transposed`) and none is NaN or ``+inf``: the caller need not
    count them (`_count_bad_bias`).
    """
    shift = opt.kv_ends[b] - N
    inv_tau = 1.0 / opt.tau[h]
    # in the tile's dtype, so that float32 tiles stay float32
    tau_over_cap = _like(opt.tau[h] / opt.softcap, st)
    cap_over_tau = _like(opt.softcap * inv_tau, st)
    alibi_over_tau = _like(opt.alibi[b, h] * inv_tau if opt.has_alibi else 0.0, st)
    inv_tau_t = _like(inv_tau, st)
    b_b, b_h, b_i, b_j = opt.bias_strides[0], opt.bias_strides[1], opt.bias_strides[2], opt.bias_strides[3]
    # A bias contiguous (or constant) along the queries is added row by row
    # of the tile, checked as it is read; a bias contiguous along the keys
    # (the usual C order) in blocks of keys after the other passes: for each
    # query, one short contiguous run of the caller's row; other layouts
    # entry by entry.
    by_rows = opt.has_bias and b_i <= 1
    bad = 0
    # with `overwrite`, the first term stored into the tile is not added
    bias_fresh = overwrite and not opt.has_alibi
    if opt.has_softcap:
        _softcap_tile(st, bk, bq, tau_over_cap, cap_over_tau, slope, want_slope)
    # Rows are slices of length bq (loops over range(bq) on whole rows did not
    # run vectorised), offsets int32 (int64 to float has no AVX2 instruction).
    for c in range(bk if opt.has_alibi or by_rows else 0):
        row = st[c, :bq]
        if opt.has_alibi:
            base = j0 + c - i0 - shift  # off of (j0 + c, i0 + r) is base - r
            if overwrite:
                for r in range(row.shape[0]):
                    row[r] = -(alibi_over_tau * _like(abs(np.int32(base - r)), st))
            else:
                for r in range(row.shape[0]):
                    row[r] -= alibi_over_tau * _like(abs(np.int32(base - r)), st)
        if by_rows:
            start = b * b_b + h * b_h + (j0 + c) * b_j + i0 * b_i
            if b_i == 0:
                bad += 0 if opt.bias[start] < np.inf else 1
                add = opt.bias[start] * inv_tau_t
                if bias_fresh:
                    for r in range(row.shape[0]):
                        row[r] = add
                else:
                    for r in range(row.shape[0]):
                        row[r] += add
            elif not _add_scaled(row, opt.bias[start : start + bq], inv_tau_t, bias_fresh):
                bad += 1
    if by_rows:
        return bad == 0
    if opt.has_bias:
        # st[c, r] += bias[i0 + r, j0 + c]: the bias is laid out query-major
        start0 = b * b_b + h * b_h + i0 * b_i + j0 * b_j
        if bias_t.shape[0] > 0:
            for c in range(bk):
                _add_scaled(st[c, :bq], bias_t[c, :bq], inv_tau_t, bias_fresh)
        elif b_j == 1:
            return _add_transposed(st, bk, bq, opt.bias, start0, b_i, inv_tau_t, bias_fresh)
        else:
            # any other layout element by element, _BIAS_KEYS keys at a time
            for cb in range(0, bk, _BIAS_KEYS):
                nc = min(_BIAS_KEYS, bk - cb)
                for r in range(bq):
                    at = start0 + r * b_i + cb * b_j
                    for c in range(nc):
                        x = opt.bias[at + c * b_j] * inv_tau_t
                        st[cb + c, r] = x if bias_fresh else st[cb + c, r] + x
    return not opt.has_bias


@njit(cache=True, inline="always")
def _add_scaled(row, src, scale, overwrite):
    """``row += scale * src`` (``=`` with ``overwrite``), ``src`` as long as ``row``.

    Returns True when no entry of ``src`` is NaN or ``+inf`` (a bias
    checked as it is read; callers that need no check ignore it). In the
    dtype of ``row``: a float32 ``src`` added to a float64 ``row`` with a
    float64 ``scale`` is widened first (one product, one sum).
    Inlined into its callers, whose `fastmath` it takes (see `_FASTMATH`):
    compiled on its own first (a call from Python), it kept no flags and
    changed the last bits of kernels compiled after it (measured: 1460 of
    5209 float32 entries of a backward).
    """
    finite = True
    if overwrite:
        for r in range(row.shape[0]):
            x = src[r]
            finite &= x < np.inf
            row[r] = x * scale
    else:
        for r in range(row.shape[0]):
            x = src[r]
            finite &= x < np.inf
            row[r] += x * scale
    return finite


@njit(cache=True, fastmath=_FASTMATH)
def _column_max(st, bk, bq, col_max, nonneg):
    """``col_max[r] = st[c, r]`` wherever that is greater (and ``>= 0`` with ``nonneg``), ``c`` in order.

    Four rows per load and store of ``col_max``: the same comparisons in the
    same order, a quarter of the loads and stores.
    """
    m = col_max[:bq]
    bk4 = bk - bk % 4
    for c in range(0, bk4, 4):
        r0, r1, r2, r3 = st[c, :bq], st[c + 1, :bq], st[c + 2, :bq], st[c + 3, :bq]
        if nonneg:
            for r in range(m.shape[0]):
                x = m[r]
                x = r0[r] if (r0[r] > x and r0[r] >= 0) else x
                x = r1[r] if (r1[r] > x and r1[r] >= 0) else x
                x = r2[r] if (r2[r] > x and r2[r] >= 0) else x
                x = r3[r] if (r3[r] > x and r3[r] >= 0) else x
                m[r] = x
        else:
            for r in range(m.shape[0]):
                x = m[r]
                x = r0[r] if r0[r] > x else x
                x = r1[r] if r1[r] > x else x
                x = r2[r] if r2[r] > x else x
                x = r3[r] if r3[r] > x else x
                m[r] = x
    for c in range(bk4, bk):
        row = st[c, :bq]
        for r in range(m.shape[0]):
            x = row[r]
            m[r] = x if (x > m[r] and (x >= 0 or not nonneg)) else m[r]


@njit(cache=True, fastmath=_FASTMATH)
def _softcap_tile(st, bk, bq, tau_over_cap, cap_over_tau, slope, want_slope):
    """``st[c, r] = cap_over_tau tanh(st[c, r] tau_over_cap)`` on ``st[:bk, :bq]``.

    With ``want_slope``, ``slope[c, r] = 1 - tanh^2`` too, by `sech2_any`
    (``1 - t * t`` cancels once the cap saturates). Rows go four at a
    time: four independent chains of the tangent's arithmetic in flight hide
    its latency; the rows are taken as slices of length ``bq``, without
    which LLVM's vectorised loop was not the one that ran.
    """
    bk4 = bk - bk % 4
    for c in range(0, bk4, 4):
        r0, r1, r2, r3 = st[c, :bq], st[c + 1, :bq], st[c + 2, :bq], st[c + 3, :bq]
        if want_slope:
            s0, s1 = slope[c, :bq], slope[c + 1, :bq]
            s2, s3 = slope[c + 2, :bq], slope[c + 3, :bq]
            for r in range(r0.shape[0]):
                x0 = r0[r] * tau_over_cap
                x1 = r1[r] * tau_over_cap
                x2 = r2[r] * tau_over_cap
                x3 = r3[r] * tau_over_cap
                r0[r] = cap_over_tau * tanh_any(x0)
                r1[r] = cap_over_tau * tanh_any(x1)
                r2[r] = cap_over_tau * tanh_any(x2)
                r3[r] = cap_over_tau * tanh_any(x3)
                s0[r] = sech2_any(x0)
                s1[r] = sech2_any(x1)
                s2[r] = sech2_any(x2)
                s3[r] = sech2_any(x3)
        else:
            for r in range(r0.shape[0]):
                t0 = tanh_any(r0[r] * tau_over_cap)
                t1 = tanh_any(r1[r] * tau_over_cap)
                t2 = tanh_any(r2[r] * tau_over_cap)
                t3 = tanh_any(r3[r] * tau_over_cap)
                r0[r] = cap_over_tau * t0
                r1[r] = cap_over_tau * t1
                r2[r] = cap_over_tau * t2
                r3[r] = cap_over_tau * t3
    for c in range(bk4, bk):
        row = st[c]
        for r in range(bq):
            x = row[r] * tau_over_cap
            row[r] = cap_over_tau * tanh_any(x)
            if want_slope:
                slope[c, r] = sech2_any(x)


@njit(cache=True, fastmath=_FASTMATH)
def _add_transposed(tile, bk, bq, src, start, stride, scale, overwrite):
    """``tile[c, r] += scale * src[start + r * stride + c]`` for ``c < bk``, ``r < bq``.

    (``=`` instead of ``+=`` with ``overwrite``.) The inverse direction of
    `_store_transposed`: square blocks of ``W`` go through SIMD registers
    (`transpose_add`, `transpose_load`), the edges element by element.
    Returns True when no entry read is NaN or ``+inf``.
    """
    width = transpose_width(tile)
    bk_w = bk - bk % width
    bq_w = bq - bq % width
    # W runs of src at a time, each read along: W streams the hardware
    # prefetcher follows (the blocks down the runs first would be bq streams)
    flagged = 0
    for rb in range(0, bq_w, width):
        for cb in range(0, bk_w, width):
            if overwrite:
                flagged |= transpose_load(tile, src, start + rb * stride + cb, stride, cb, rb, scale)
            else:
                flagged |= transpose_add(tile, src, start + rb * stride + cb, stride, cb, rb, scale)
    for c in range(bk):
        row = tile[c]
        for r in range(0 if c >= bk_w else bq_w, bq):
            value = src[start + r * stride + c]
            flagged |= 0 if value < np.inf else 1
            x = value * scale
            row[r] = x if overwrite else row[r] + x
    return flagged == 0


@njit(cache=True, fastmath=False)
def _store_transposed(tile, bk, bq, dst, start, stride, scale):
    """``dst[start + r * stride + c] = scale * tile[c, r]`` for ``c < bk``, ``r < bq``.

    Square blocks of ``W`` go through SIMD registers (`transpose_store`), the
    edges element by element: a key-major tile written out query-major, into
    a result the kernel does not read again. Where the runs of ``dst`` start
    on cache lines, their whole lines are streamed (`transpose_stream`): the
    runs are short and far apart, and ordinary stores first read each line.
    """
    width = transpose_width(tile)
    line = stream_width(tile)
    bk_w = bk - bk % width
    bq_w = bq - bq % width
    line_bytes = line * dst.itemsize
    on_lines = (dst.ctypes.data + start * dst.itemsize) % line_bytes == 0 and stride % line == 0
    bk_s = bk - bk % line if on_lines else 0
    for rb in range(0, bq_w, width):  # W runs of dst at a time, as in `_add_transposed`
        for cb in range(0, bk_s, line):
            transpose_stream(tile, dst, start + rb * stride + cb, stride, cb, rb, scale)
        for cb in range(bk_s, bk_w, width):
            transpose_store(tile, dst, start + rb * stride + cb, stride, cb, rb, scale)
    for c in range(bk):
        row = tile[c]
        for r in range(0 if c >= bk_w else bq_w, bq):
            dst[start + r * stride + c] = row[r] * scale
    if bk_s > 0:
        stream_fence()


@njit(cache=True, fastmath=False)
def _accumulate_transposed(tile, bk, bq, dst, start, stride, scale):
    """``dst[start + r * stride + c] += scale * tile[c, r]`` in float64, for ``c < bk``, ``r < bq``.

    `_store_transposed` into float64 partial sums (`transpose_accumulate`):
    a key-major tile added into a query-major float64 ``dbias``.
    """
    width = transpose_width(tile)
    bk_w = bk - bk % width
    bq_w = bq - bq % width
    for rb in range(0, bq_w, width):
        for cb in range(0, bk_w, width):
            transpose_accumulate(tile, dst, start + rb * stride + cb, stride, cb, rb, scale)
    for c in range(bk):
        row = tile[c]
        for r in range(0 if c >= bk_w else bq_w, bq):
            dst[start + r * stride + c] += np.float64(row[r]) * scale


@njit(cache=True, fastmath=_FASTMATH)
def _remove_in_row(row, opt, b, h, j, i0, r_lo, r_hi, M, shift, nvm, check_kept):
    """NVM, gate and mask on one key's row of a tile; True if an entry of ``[r_lo, r_hi)`` is kept."""
    neg_inf = -np.inf
    if nvm:
        for r in range(r_lo, r_hi):
            x = row[r]
            row[r] = x if x >= 0 else neg_inf
    if opt.has_gate:
        base = j - shift - i0 + M - 1  # table index of (j, i0 + r) is base - r
        for r in range(r_lo, r_hi):
            row[r] += opt.log_gate[b, h, base - r]
    if opt.has_mask:
        s_b, s_h, s_i, s_j = opt.mask_strides[0], opt.mask_strides[1], opt.mask_strides[2], opt.mask_strides[3]
        start = b * s_b + h * s_h + j * s_j + i0 * s_i
        for r in range(r_lo, r_hi):
            if not opt.mask[start + r * s_i]:
                row[r] = neg_inf
    if check_kept:
        for r in range(r_lo, r_hi):
            if row[r] > neg_inf:
                return True
        return False
    return r_hi > r_lo


@njit(cache=True, fastmath=_FASTMATH)
def _log_add_exp(a, b):
    if b == -np.inf:
        return a
    if a == -np.inf:
        return b
    hi = max(a, b)
    return hi + math.log1p(math.exp(-abs(a - b)))


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


@njit(nogil=True, cache=True, fastmath=_FASTMATH)
def _forward_kernel(q, k, v, opt, block_q, block_k, out, lse, bad_bias, part, parts):
    """Query tiles: ``out`` and ``lse``; ``bad_bias[b, h, tile]`` counts the tile's NaN and +inf bias entries."""
    B, H, N, D = q.shape
    Hkv, M, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = H // Hkv
    n_qt = (N + block_q - 1) // block_q
    # scratch of the thread, reused by its tasks
    q_t = np.empty((D, block_q), dtype=q.dtype)  # scaled Q^T of the tile
    st = np.empty((block_k, block_q), dtype=q.dtype)
    acc = np.empty((block_q, Dv), dtype=q.dtype)
    row_max = np.empty(block_q, dtype=q.dtype)
    tile_max = np.empty(block_q, dtype=q.dtype)
    shift_by = np.empty(block_q, dtype=q.dtype)
    rescale_by = np.empty(block_q, dtype=q.dtype)
    tile_sum = np.empty(block_q, dtype=q.dtype)
    row_sum = np.empty(block_q)
    no_slope = np.empty((0, 0), dtype=q.dtype)  # the forward takes no tanh slopes
    no_bias_t = np.empty((0, 0), dtype=q.dtype)  # a task has one head: it reads its bias tiles itself
    for task in _task_range(B * H * n_qt, part, parts):
        bh = task // n_qt
        b = bh // H
        h = bh % H
        hk = h // group
        qt = _zigzag(task % n_qt, n_qt)
        i0 = qt * block_q
        bq = min(block_q, N - i0)

        factor = _query_factor(opt, h)
        for r in range(bq):
            for d in range(D):
                q_t[d, r] = q[b, h, i0 + r, d] * factor
        acc[:] = 0.0
        row_max[:] = -np.inf
        row_sum[:] = 0.0

        # NVM tests s before log G is added: with a gate it stays in the
        # logits pass, otherwise it joins the row-max and shift passes.
        nvm_in_logits = opt.nvm and opt.has_gate
        nvm_in_max = opt.nvm and not opt.has_gate
        neg_inf = -np.inf
        off_lo, off_hi = _offset_range(opt, b, h, N, M)
        j_lo, j_hi = _key_range(opt, b, i0, bq, N, M, off_lo, off_hi)
        bad = 0
        for j0 in range(j_lo, j_hi, block_k):
            bk = min(block_k, j_hi - j0)
            if opt.has_bias and j0 + block_k < j_hi:
                _prefetch_bias(opt, b, h, i0, bq, j0 + block_k, min(block_k, j_hi - j0 - block_k), N, M)
            for r in range(bq):
                tile_max[r] = -np.inf
            kept, maxed, clean = _logits_tile(
                st, k[b, hk, j0 : j0 + bk], q_t, D, opt, b, h, i0, bq, j0, bk, N, M,
                off_lo, off_hi, nvm_in_logits, no_slope, tile_max, nvm_in_max, no_bias_t,
            )
            if not clean:
                bad += _count_bad_bias(opt, b, h, i0, i0 + bq, j0, j0 + bk)  # in cache after the tile
            if not kept:
                continue
            if not maxed:
                _column_max(st, bk, bq, tile_max, nvm_in_max)
            rescale = False
            for r in range(bq):
                new_max = max(row_max[r], tile_max[r])
                # A row with nothing kept yet stays at -inf; shift by 0 so that
                # exp(-inf - 0) = 0 instead of NaN.
                shift_by[r] = new_max if new_max > -np.inf else 0.0
                if new_max > row_max[r]:
                    alpha = math.exp(row_max[r] - shift_by[r])
                    row_sum[r] *= alpha
                    if alpha != 1.0:
                        rescale = True
                    rescale_by[r] = alpha
                else:
                    rescale_by[r] = 1.0
                row_max[r] = new_max
            if rescale:
                for r in range(bq):
                    alpha = rescale_by[r]
                    for d in range(Dv):
                        acc[r, d] *= alpha
            for r in range(bq):
                tile_sum[r] = 0.0
            exp_shift_sum(st, bk, bq, shift_by, nvm_in_max, tile_sum)
            for r in range(bq):
                row_sum[r] += tile_sum[r]
            matmul_tn(st, v[b, hk, j0 : j0 + bk], acc, bq, Dv, bk, True)
        # the bias of the keys skipped, which no tile read
        bad += _count_bad_bias(opt, b, h, i0, i0 + bq, np.intp(0), j_lo)
        bad += _count_bad_bias(opt, b, h, i0, i0 + bq, j_hi, M)
        bad_bias[b, h, qt] = bad

        # lse = m + log(l + beta exp(-m)) = logaddexp(m + log l, log beta)
        log_beta = math.log(opt.beta[h]) if opt.beta[h] > 0 else -np.inf
        for r in range(bq):
            i = i0 + r
            if row_sum[r] > 0.0:
                m = np.float64(row_max[r])
                lse_r = _log_add_exp(m + math.log(row_sum[r]), log_beta)
                weight = math.exp(m - lse_r)
                for d in range(Dv):
                    out[b, h, i, d] = acc[r, d] * weight
                lse[b, h, i] = lse_r
            else:
                for d in range(Dv):
                    out[b, h, i, d] = 0.0
                lse[b, h, i] = log_beta


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


@njit(nogil=True, cache=True, fastmath=False)
def _backward_prepare(q, dout, out, opt, block_q, q_scaled, q_scaled_t, dout_t, delta, part, parts):
    """Scaled queries (rows and Q^T tiles), dout^T tiles and delta in float64."""
    B, H, N, D = q.shape
    Dv = dout.shape[3]
    for bh in _task_range(B * H, part, parts):
        b = bh // H
        h = bh % H
        factor = opt.scale / opt.tau[h]
        logit_factor = _query_factor(opt, h)
        for i in range(N):
            it = i // block_q
            r = i - it * block_q
            acc = 0.0
            for d in range(Dv):
                acc += np.float64(dout[b, h, i, d]) * np.float64(out[b, h, i, d])
                dout_t[b, h, it, d, r] = dout[b, h, i, d]
            delta[b, h, i] = acc
            for d in range(D):
                q_scaled[b, h, i, d] = q[b, h, i, d] * factor
                q_scaled_t[b, h, it, d, r] = q[b, h, i, d] * logit_factor


@njit(cache=True, fastmath=False)
def _row_stats(lse, delta, b, h, i0, bq, lse_t, delta_t):
    for r in range(bq):
        value = lse[b, h, i0 + r]
        # An empty row with beta = 0 has lse = -inf and only -inf logits:
        # shift by +inf so that exp(z - lse) = 0 rather than NaN.
        lse_t[r] = np.inf if value == -np.inf else value
        delta_t[r] = delta[b, h, i0 + r]


@njit(nogil=True, cache=True, fastmath=False)
def _backward_kernel(
    k, v, q_scaled, q_scaled_t, dout, dout_t, lse, delta, opt, block_q, block_k,
    kt0, kt1, dk, dv, dq_shares, share_rows, dtau_part, dsigma_part,
    dbias_params, dbias_strides, dbias_direct, dbias_partials, bad_bias, part, parts,
):
    """Key tiles ``kt0 .. kt1 - 1``: dk, dv, the tile's share of dq, dtau, dsigma and dbias sums.

    ``dq_shares[t, b, h]`` receives, for rows ``share_rows[t, b, h]`` (a range
    of whole query tiles), ``sum_j dz_ij k_j`` over the keys of tile
    ``kt0 + t``; rows outside the range are not written. ``dbias`` goes
    where `_DbiasPlan` says (``dbias_params``): each task covers one key tile
    and, when the bias is broadcast over the batch or the heads, a lane of
    (batch, kv head) pairs. ``bad_bias[b, h, kt]`` counts the NaN and +inf
    bias entries of the key tile, over all queries.
    """
    B, Hkv, M, D = k.shape
    Dv = v.shape[3]
    H, N = q_scaled.shape[1], q_scaled.shape[2]
    group = H // Hkv
    n_chunk = kt1 - kt0
    dbias_mode = dbias_params[0]
    fold_b = dbias_params[1] != 0
    fold_h = dbias_params[2] != 0
    lanes = dbias_params[3]
    slots_per_lane = dbias_params[4]
    d_b, d_h, d_i, d_j = dbias_strides[0], dbias_strides[1], dbias_strides[2], dbias_strides[3]
    outer_h = 1 if fold_h else Hkv
    pairs_h = Hkv if fold_h else 1
    pairs = (B if fold_b else 1) * pairs_h
    n_outer = (1 if fold_b else B) * outer_h
    # A task interleaves the query tiles of up to `pair_batch` (batch, kv
    # head) pairs of its lane, heads inner: a broadcast bias tile and its
    # dbias partial are used by every head while they are in cache.
    pair_batch = dbias_params[5]
    heads = pair_batch * group
    # scratch of the thread, reused by its tasks
    st = np.empty((block_k, block_q), dtype=k.dtype)  # logits z
    pt = np.empty((block_k, block_q), dtype=k.dtype)  # probabilities
    dpt = np.empty((block_k, block_q), dtype=k.dtype)  # dP, then dz
    slope = np.empty((block_k, block_q) if opt.has_softcap else (0, 0), dtype=k.dtype)
    lse_t = np.empty(block_q, dtype=k.dtype)
    no_max = np.empty(0, dtype=k.dtype)  # the backward takes no tile maxima
    delta_t = np.empty(block_q, dtype=k.dtype)
    # A dbias broadcast over heads and laid out along the keys: the batch's
    # dz / tau_h are summed key-major in the kernel dtype, each row as it is
    # formed (in cache), then written out transposed once per query tile.
    sum_heads = dbias_mode >= 2 and d_j == 1 and d_i > 1 and d_h == 0
    dz_sum = np.empty((block_k, block_q) if sum_heads else (0, 0), dtype=k.dtype)
    # A bias the batch's heads share, laid out along the keys: each tile is
    # loaded key-major once for them all (one transpose instead of one per head).
    b_b, b_h, b_i, b_j = opt.bias_strides[0], opt.bias_strides[1], opt.bias_strides[2], opt.bias_strides[3]
    share_bias = opt.has_bias and heads > 1 and b_h == 0 and b_j == 1 and b_i > 1
    bias_t = np.empty((block_k, block_q) if share_bias else (0, 0), dtype=k.dtype)
    one = _like(1.0, bias_t)
    dk_acc = np.empty((pair_batch, block_k, D), dtype=k.dtype)
    dv_acc = np.empty((pair_batch, block_k, Dv), dtype=k.dtype)
    # per head of the batch: dtau and dsigma sums by query, bad bias entries,
    # and offsets [off_lo, off_hi] and query tiles [it_lo, it_hi)
    dtau_acc = np.empty((heads, block_q))
    dsigma_acc = np.empty((heads, block_q))
    bad = np.empty(heads, dtype=np.int64)
    spans = np.empty((heads, 4), dtype=np.int64)
    # NVM tests s before log G is added: with a gate it stays in the logits
    # pass, otherwise it joins the pass that forms z - lse (the logits z
    # themselves are read only where p != 0).
    nvm_in_logits = opt.nvm and opt.has_gate
    nvm_in_exp = opt.nvm and not opt.has_gate
    neg_inf = -np.inf
    for task in _task_range(n_outer * lanes * n_chunk, part, parts):
        rest = task // n_chunk
        t = _zigzag(task % n_chunk, n_chunk)
        lane = rest % lanes
        outer = rest // lanes
        kt = kt0 + t
        j0 = kt * block_k
        bk_all = min(block_k, M - j0)
        slot = lane * slots_per_lane + (t if slots_per_lane > 1 else 0)
        lane_hi = (lane + 1) * pairs // lanes
        for first in range(lane * pairs // lanes, lane_hi, pair_batch):
            n_pairs = min(pair_batch, lane_hi - first)
            it_first = N
            it_last = 0
            for pp in range(n_pairs):
                b, hk = _pair_head(first + pp, fold_b, fold_h, pairs_h, outer, outer_h)
                bk = max(min(bk_all, opt.kv_lengths[b] - j0), 0)  # keys past kv_lengths get 0
                dk_acc[pp, :bk_all] = 0.0
                dv_acc[pp, :bk_all] = 0.0
                for g in range(group):
                    hh = pp * group + g
                    h = hk * group + g
                    off_lo, off_hi = _offset_range(opt, b, h, N, M)
                    i_lo, i_hi = _query_range(opt, b, j0, bk, N, off_lo, off_hi)
                    spans[hh, 0] = off_lo
                    spans[hh, 1] = off_hi
                    dtau_acc[hh] = 0.0
                    dsigma_acc[hh] = 0.0
                    if bk == 0 or i_lo >= i_hi:
                        bad[hh] = _count_bad_bias(opt, b, h, np.intp(0), N, j0, j0 + bk_all)
                        spans[hh, 2] = 0
                        spans[hh, 3] = 0
                        share_rows[t, b, h, 0] = 0
                        share_rows[t, b, h, 1] = 0
                        continue
                    it_lo = i_lo // block_q
                    it_hi = (i_hi - 1) // block_q + 1
                    spans[hh, 2] = it_lo
                    spans[hh, 3] = it_hi
                    it_first = min(it_first, it_lo)
                    it_last = max(it_last, it_hi)
                    # the bias of the queries skipped, which no tile reads, and
                    # of the keys past kv_lengths
                    rows_lo, rows_hi = it_lo * block_q, min(it_hi * block_q, N)
                    n_bad = _count_bad_bias(opt, b, h, np.intp(0), rows_lo, j0, j0 + bk_all)
                    n_bad += _count_bad_bias(opt, b, h, rows_hi, N, j0, j0 + bk_all)
                    n_bad += _count_bad_bias(opt, b, h, rows_lo, rows_hi, j0 + bk, j0 + bk_all)
                    bad[hh] = n_bad
                    share_rows[t, b, h, 0] = rows_lo
                    share_rows[t, b, h, 1] = rows_hi
            for it in range(it_first, it_last):
                i0 = it * block_q
                bq = min(block_q, N - i0)
                summed = False  # dz_sum holds this query tile's sum
                bias_loaded = False  # bias_t holds this query tile's bias
                bias_t_clean = False  # and none of its entries is NaN or +inf
                for pp in range(n_pairs):
                    b, hk = _pair_head(first + pp, fold_b, fold_h, pairs_h, outer, outer_h)
                    bk = max(min(bk_all, opt.kv_lengths[b] - j0), 0)
                    k_j = k[b, hk, j0 : j0 + bk]
                    v_j = v[b, hk, j0 : j0 + bk]
                    dk_pair = dk_acc[pp]
                    dv_pair = dv_acc[pp]
                    for g in range(group):
                        hh = pp * group + g
                        h = hk * group + g
                        if it < spans[hh, 2] or it >= spans[hh, 3]:
                            continue
                        off_lo, off_hi = spans[hh, 0], spans[hh, 1]
                        inv_tau = 1.0 / opt.tau[h]
                        inv_tau_t = _like(inv_tau, dpt)
                        share = dq_shares[t, b, h, i0 : i0 + bq]
                        if opt.has_bias and it + 1 < spans[hh, 3] and not bias_loaded:
                            _prefetch_bias(opt, b, h, i0 + block_q, block_q, j0, bk_all, N, M)
                        if share_bias and not bias_loaded:
                            # b is the batch's own, or the bias does not depend on it
                            start = b * b_b + i0 * b_i + j0
                            bias_t_clean = _add_transposed(bias_t, bk_all, bq, opt.bias, start, b_i, one, np.bool_(True))
                            bias_loaded = True
                        kept, _, clean = _logits_tile(
                            st, k_j, q_scaled_t[b, h, it], D, opt, b, h, i0, bq, j0, bk, N, M,
                            off_lo, off_hi, nvm_in_logits, slope, no_max, opt.nvm, bias_t,
                        )
                        if not (clean or (share_bias and bias_t_clean)):
                            bad[hh] += _count_bad_bias(opt, b, h, i0, i0 + bq, j0, j0 + bk)  # in cache
                        if not kept:
                            for r in range(bq):
                                for d in range(D):
                                    share[r, d] = 0.0
                            continue
                        _row_stats(lse, delta, b, h, i0, bq, lse_t, delta_t)
                        delta_r = delta[b, h, i0 : i0 + bq]
                        dtau_h = dtau_acc[hh]
                        dsigma_h = dsigma_acc[hh]
                        if nvm_in_exp:
                            for c in range(bk):
                                for r in range(bq):
                                    x = st[c, r]
                                    pt[c, r] = x - lse_t[r] if x >= 0 else neg_inf
                        else:
                            for c in range(bk):
                                for r in range(bq):
                                    pt[c, r] = st[c, r] - lse_t[r]
                        exp_inplace(pt, bk, bq)
                        matmul_nn(pt, dout[b, h, i0 : i0 + bq], dv_pair, bk, Dv, bq, True)
                        matmul_nn(v_j, dout_t[b, h, it], dpt, bk, bq, Dv, False)
                        # dz in the working dtype feeds the products; the dtau and
                        # dsigma sums take dz in float64 against the float64 delta.
                        if sum_heads and not summed:
                            dz_sum[:bk_all, :bq] = 0.0
                            summed = True
                        for c in range(bk):
                            if opt.has_gate:
                                base = j0 + c - (opt.kv_ends[b] - N) - i0 + M - 1
                                for r in range(bq):
                                    p = pt[c, r]
                                    dp = dpt[c, r]
                                    dpt[c, r] = p * (dp - delta_t[r])
                                    if p != 0:
                                        dz = np.float64(p) * (np.float64(dp) - delta_r[r])
                                        dtau_h[r] += dz * (
                                            np.float64(st[c, r]) - opt.log_gate[b, h, base - r]
                                        )
                                        dsigma_h[r] += dz * opt.dlog_gate[b, h, base - r]
                            else:
                                for r in range(bq):
                                    p = pt[c, r]
                                    dp = dpt[c, r]
                                    dpt[c, r] = p * (dp - delta_t[r])
                                    s = np.float64(st[c, r]) if p != 0 else 0.0
                                    dtau_h[r] += np.float64(p) * (np.float64(dp) - delta_r[r]) * s
                            if sum_heads:
                                # this head's dbias row (below) into the heads' sum
                                _add_scaled(dz_sum[c, :bq], dpt[c, :bq], inv_tau_t, False)
                        # dbias = ds = dz / tau_h, before the soft-cap's slope
                        start = b * d_b + h * d_h + i0 * d_i + j0 * d_j
                        if dbias_mode == 1:
                            # dbias[i0 + r, j0 + c] = dz[c, r] / tau (d_j = 1 for M > 1)
                            _store_transposed(dpt, bk, bq, dbias_direct, start, d_i, inv_tau_t)
                        elif dbias_mode == 2 and not sum_heads:
                            partial = dbias_partials[slot]
                            if d_i == 0:
                                _accumulate_columns(dpt, bk, bq, partial, start, d_j, inv_tau)
                            elif d_j == 1 and d_i > 1:
                                # keys contiguous in dbias: the tile added transposed
                                _accumulate_transposed(dpt, bk, bq, partial, start, d_i, inv_tau)
                            else:
                                for c in range(bk):
                                    row = dpt[c]
                                    at = start + c * d_j
                                    for r in range(bq):
                                        partial[at + r * d_i] += np.float64(row[r]) * inv_tau
                        if opt.has_softcap:
                            # ds_raw = ds (1 - tanh^2): dk and dq take the raw score's gradient
                            for c in range(bk):
                                row = dpt[c]
                                slope_row = slope[c]
                                for r in range(bq):
                                    row[r] *= slope_row[r]
                        # dk_j = scale/tau_h sum_i dz_ij q_i = sum_i dz_ij q_scaled_i
                        matmul_nn(dpt, q_scaled[b, h, i0 : i0 + bq], dk_pair, bk, D, bq, True)
                        # this key tile's share of dq_i = scale/tau_h sum_j dz_ij k_j
                        matmul_tn(dpt, k_j, share, bq, D, bk, False)
                if summed:
                    start = _pair_head(first, fold_b, fold_h, pairs_h, outer, outer_h)[0] * d_b
                    start += i0 * d_i + j0
                    if dbias_mode == 3:
                        # the whole sum: the result
                        _store_transposed(dz_sum, bk_all, bq, dbias_direct, start, d_i, one)
                    else:
                        _accumulate_transposed(dz_sum, bk_all, bq, dbias_partials[slot], start, d_i, 1.0)
            for pp in range(n_pairs):
                b, hk = _pair_head(first + pp, fold_b, fold_h, pairs_h, outer, outer_h)
                for g in range(group):
                    hh = pp * group + g
                    h = hk * group + g
                    dtau = 0.0
                    dsigma = 0.0
                    for r in range(block_q):
                        dtau += dtau_acc[hh, r]
                        dsigma += dsigma_acc[hh, r]
                    # dtau_h = -(1/tau^2) sum dz s = -(1/tau) sum dz (s / tau)
                    dtau_part[b, h, kt] = -dtau / opt.tau[h]
                    dsigma_part[b, h, kt] = dsigma
                    bad_bias[b, h, kt] = bad[hh]
                dk[b, hk, j0 : j0 + bk_all] = dk_acc[pp, :bk_all]
                dv[b, hk, j0 : j0 + bk_all] = dv_acc[pp, :bk_all]


@njit(cache=True, fastmath=False)
def _pair_head(pair, fold_b, fold_h, pairs_h, outer, outer_h):
    """The (batch, kv head) of a task's ``pair`` (its lane's folded axes) and ``outer`` (the others)."""
    b = pair // pairs_h if fold_b else outer // outer_h
    hk = pair % pairs_h if fold_h else outer % outer_h
    return b, hk


@njit(cache=True, fastmath=False)
def _accumulate_columns(tile, bk, bq, dst, start, stride, scale):
    """``dst[start + c * stride] += scale * sum_r tile[c, r]`` in float64, for ``c < bk``."""
    for c in range(bk):
        row = tile[c]
        # four running sums: no single chain of additions
        a0 = 0.0
        a1 = 0.0
        a2 = 0.0
        a3 = 0.0
        r4 = bq - bq % 4
        for r in range(0, r4, 4):
            a0 += np.float64(row[r])
            a1 += np.float64(row[r + 1])
            a2 += np.float64(row[r + 2])
            a3 += np.float64(row[r + 3])
        for r in range(r4, bq):
            a0 += np.float64(row[r])
        dst[start + c * stride] += ((a0 + a1) + (a2 + a3)) * scale


@njit(nogil=True, cache=True, fastmath=False)
def _sum_dq_shares(dq_shares, share_rows, n_shares, block_q, dq, part, parts):
    """``dq += sum_t dq_shares[t]`` over each share's rows, in the order of ``t``."""
    B, H, N, D = dq.shape
    n_qt = (N + block_q - 1) // block_q
    for task in _task_range(B * H * n_qt, part, parts):
        bh = task // n_qt
        b = bh // H
        h = bh % H
        i0 = (task % n_qt) * block_q
        i1 = min(i0 + block_q, N)
        for t in range(n_shares):
            lo = max(share_rows[t, b, h, 0], i0)
            hi = min(share_rows[t, b, h, 1], i1)
            for i in range(lo, hi):
                for d in range(D):
                    dq[b, h, i, d] += dq_shares[t, b, h, i, d]
