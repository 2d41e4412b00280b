"""Where the backward writes the bias's gradient: the plan, and the stage that writes a tile of it.

`DbiasPlan` chooses how ``dbias`` is laid out and summed (direct, or float64
partials per lane of (batch, kv head) pairs, the lanes the key tiles' tasks
take: `elastic_np.cpu._prefill.key_tiles.key_tasks`); the stage of a tile
(`dbias_tile`, compiled on first use behind a C entry point, `ensure_dbias`)
writes a key-major tile query-major (`_store_transposed`) or adds it into
float64 partials (`_accumulate_transposed`, `_accumulate_columns`).
"""

import numpy as np
from numba import carray

from elastic_np.cpu._runtime import config
from elastic_np.cpu._runtime.numba_private import enabled, inner
from elastic_np.cpu._tiles import calls
from elastic_np.cpu._tiles.scalar import scalar_like
from elastic_np.cpu._tiles.transpose import (
    stream_fence, stream_width, transpose_accumulate, transpose_store, transpose_stream, transpose_width,
)


class DbiasPlan:
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

    ``params = [mode, fold_b, fold_h, lanes, slots_per_lane]``; ``strides``
    are the element strides of ``(b, h, i, j)`` into the compact ``dbias``.
    """

    def __init__(self, p, dtype, n_kt, chunk):
        B, H, Hkv, N, M, D, Dv = p.shape
        self.params = np.array([0, 0, 0, 1, 1], dtype=np.int64)
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
        by_memory = config.DBIAS_PARTIALS_BYTES // max(8 * size * slots_per_lane, 1)
        # an empty batch or key set leaves pairs, outer or n_kt at 0: one lane of nothing
        lanes = max(min(pairs, -(-config.DBIAS_MIN_TASKS // max(outer * n_kt, 1)), max(by_memory, 1)), 1)
        self.per_key_tile = per_key_tile
        self.params[:] = (2, fold_b, fold_h, lanes, slots_per_lane)
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
        if mode == 1:
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


@inner(fastmath=False)
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
    for rb in range(0, bq_w, width):  # W runs of dst at a time, as in `elastic_np.cpu._tiles.logits._add_transposed`
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


@inner(fastmath=False)
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


@inner(fastmath=False)
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


@inner(fastmath=False)
def _dbias_tile(dpt, bk, bq, b, h, i0, j0, dbias, slot, inv_tau):
    """``dbias = ds = dz / tau_h`` (before the soft-cap's slope) where `DbiasPlan` says.

    Mode 1 stores the tile into ``direct``; mode 2 adds it into the float64
    ``partials[slot]`` of the task's lane.
    """
    params, strides, direct, partials = dbias
    d_i, d_j = strides[2], strides[3]
    start = b * strides[0] + h * strides[1] + i0 * d_i + j0 * d_j
    if params[0] == 1:
        # dbias[i0 + r, j0 + c] = dz[c, r] / tau (d_j = 1 for M > 1)
        _store_transposed(dpt, bk, bq, direct, start, d_i, scalar_like(inv_tau, dpt))
        return
    partial = partials[slot]
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


def _dbias_entry(dpt, d0, d1, params, n_params, strides, n_strides, direct, n_direct, partials, p0, p1,
                 bk, bq, b, h, i0, j0, slot, inv_tau):
    """The body of the dbias stage's C entry point (`calls.dbias_tile`'s arguments, flattened)."""
    dbias = (carray(params, (n_params,)), carray(strides, (n_strides,)), carray(direct, (n_direct,)),
             carray(partials, (p0, p1)))
    _dbias_tile(carray(dpt, (d0, d1)), bk, bq, b, h, i0, j0, dbias, slot, inv_tau)


def ensure_dbias(dtype):
    """Compile (or load from the cache) the dbias stage for ``dtype`` before a backward with a bias runs.

    Nothing to do when the path ``lazy_stages`` is off (`dbias_tile` is linked in).
    """
    if enabled("lazy_stages"):
        calls.ensure_lazy("dbias_tile", dtype, _dbias_entry)


def _linked_dbias_tile(dpt, dbias, tile, slot, inv_tau):
    """`calls.dbias_tile`'s stage called directly, ``inv_tau`` a double as through the entry point."""
    bk, bq, b, h, i0, j0 = tile
    _dbias_tile(dpt, bk, bq, b, h, i0, j0, dbias, slot, np.float64(inv_tau))


#: What the backward kernel calls for the dbias stage: an entry point compiled on first use, or the stage linked in.
dbias_tile = calls.dbias_tile if enabled("lazy_stages") else inner(fastmath=False)(_linked_dbias_tile)
