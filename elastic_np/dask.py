r"""Attention on Dask arrays: batches, heads, queries and keys in chunks, on any Dask scheduler.

``elastic_np.dask.attention`` takes the options of `elastic_np.attention`
and ``q``, ``k``, ``v`` as Dask arrays (NumPy arrays are wrapped as one
chunk). Their chunks along the batch, the heads and the queries (those of
``q``) and along the keys (those of ``k``) cut the problem into blocks:

- the blocks of one (batch, head, query) chunk over the key chunks are
  partial attentions with ``beta = 0``, merged exactly in a fixed binary tree
  in key-chunk order, ``beta`` added once at the root (`merge_attention`);
- a block that causal, the window, ``kv_lengths`` or the dynamic window's
  band removes entirely is no task at all;
- each block is one ordinary `elastic_np.attention` call, shifted so that
  its offsets are those of the whole problem (`elastic_np._dask_blocks`).

``attention_backward`` sums ``dq`` over key chunks, ``dk``/``dv`` over query
chunks and the query heads of each group, ``dtau``, ``dbeta``, ``dsigma`` and
``dbias`` over blocks, each in a fixed order: the result depends on the
chunking only, never on the scheduler or the worker count.

Requires ``pip install "elastic_np[dask]"`` (``dask[array]`` and
``distributed``); ``import elastic_np`` never imports this module.
"""

import dataclasses
import math
import operator

import dask
import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from elastic_np import _dask_blocks, _dispatch, _options, _spec
from elastic_np._options import AttentionGrads

__all__ = ["attention", "attention_backward", "compute_grads"]


@dataclasses.dataclass(frozen=True, eq=False)
class _Setup:
    """Validated inputs rechunked to one block grid, and the block spec."""

    q: da.Array
    k: da.Array
    v: da.Array
    mask: object  # 4-D dask array or None
    bias: object
    spec: _dask_blocks.BlockSpec
    problem: _options.AttentionProblem  # shapes and normalised options (stand-in arrays)
    dtype: np.dtype

    def offsets(self, axis_chunks):
        return np.concatenate([[0], np.cumsum(axis_chunks)]).astype(int)

    def blocks(self):
        """``(index, block)`` for every (batch, head, query, key) chunk, in a fixed order."""
        qc, kc = self.q.chunks, self.k.chunks
        ob, oh, oi, oj = (self.offsets(c) for c in (qc[0], qc[1], qc[2], kc[2]))
        for bi in range(len(qc[0])):
            for hi in range(len(qc[1])):
                for ii in range(len(qc[2])):
                    for ji in range(len(kc[2])):
                        yield (bi, hi, ii, ji), (
                            int(ob[bi]), int(ob[bi + 1]), int(oh[hi]), int(oh[hi + 1]),
                            int(oi[ii]), int(oi[ii + 1]), int(oj[ji]), int(oj[ji + 1]),
                        )

    def kv_cover(self, block):
        """Chunk indices of ``k`` along the heads that hold the block's kv heads, and the first head."""
        h0, h1 = block[2], block[3]
        g = self.spec.group
        lo, hi = h0 // g, (max(h1, h0 + 1) - 1) // g + 1
        starts = self.offsets(self.k.chunks[1])
        cover = [c for c in range(len(starts) - 1) if starts[c] < hi and starts[c + 1] > lo]
        return cover, int(starts[cover[0]])

    def inputs(self, index, block):
        """The block task's arguments that come from chunks: q, k, v, mask, bias, kv_first."""
        bi, hi, ii, ji = index
        cover, kv_first = self.kv_cover(block)
        if len(cover) == 1:  # no copy
            k, v = (self.k.name, bi, cover[0], ji, 0), (self.v.name, bi, cover[0], ji, 0)
        else:
            k = (np.concatenate, [(self.k.name, bi, c, ji, 0) for c in cover], 1)
            v = (np.concatenate, [(self.v.name, bi, c, ji, 0) for c in cover], 1)
        return (self.q.name, bi, hi, ii, 0), k, v, self._option_key(self.mask, index), \
            self._option_key(self.bias, index), kv_first

    @staticmethod
    def _option_key(a, index):
        if a is None:
            return None
        return (a.name,) + tuple(0 if a.shape[ax] == 1 else index[ax] for ax in range(4))


def _setup(q, k, v, options, backend, threads_per_task):
    if backend == "auto":
        backend = "cuda" if _dispatch._cuda_is_available() else "cpu"
    module = _dispatch.get_backend(backend)
    q, k, v = (da.asarray(a) for a in (q, k, v))
    mask, bias = options.pop("mask"), options.pop("bias")
    kv_lengths = options.pop("kv_lengths")
    if isinstance(kv_lengths, da.Array):
        kv_lengths = kv_lengths.compute()

    def stand_in(a):  # the shape and dtype alone: nothing is read here
        if a is None:
            return None
        a = a if isinstance(a, da.Array) else np.asarray(a)
        return np.broadcast_to(np.zeros((), a.dtype), a.shape)

    problem = _options.prepare(
        *(stand_in(a) for a in (q, k, v)), mask=stand_in(mask), bias=stand_in(bias),
        kv_lengths=kv_lengths, dtypes=module.dtypes, check_finite=False, **options,
    )
    if not isinstance(threads_per_task, (int, np.integer)) or threads_per_task < 1:
        raise ValueError(f"`threads_per_task` must be an integer >= 1, got {threads_per_task!r}")
    B, H, Hkv, N, M, D, Dv = problem.shape
    q = q.rechunk({3: -1})
    k = k.rechunk({0: q.chunks[0], 3: -1})
    v = v.rechunk({0: q.chunks[0], 1: k.chunks[1], 2: k.chunks[2], 3: -1})
    grid = (q.chunks[0], q.chunks[1], q.chunks[2], k.chunks[2])
    mask, bias = (_grid_array(a, grid) for a in (mask, bias))
    spec = _dask_blocks.BlockSpec(
        N=N, M=M, group=problem.group_size, ends=np.asarray(problem.kv_ends),
        problem=dataclasses.replace(problem, q=None, k=None, v=None, mask=None, bias=None),
        options=dict(options, scale=problem.scale, beta=0.0, align="array"),
        backend=backend, threads=int(threads_per_task),
    )
    dtype = np.dtype(np.float64) if module.dtypes is None else q.dtype
    return _Setup(q, k, v, mask, bias, spec, problem, dtype)


def _grid_array(a, grid):
    """A mask or bias as a 4-D Dask array chunked like the blocks (size-1 axes stay one chunk)."""
    if a is None:
        return None
    a = da.asarray(a)
    a = a.reshape((1,) * (4 - a.ndim) + a.shape)
    return a.rechunk(tuple(-1 if n == 1 else c for n, c in zip(a.shape, grid)))


def _graph(name, dsk, inputs, extra=None):
    """One graph with layer ``name`` (all the tasks) over ``inputs``, and ``extra`` layers reading it."""
    inputs = [a for a in inputs if a is not None]
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=inputs)
    if not extra:
        return graph
    layers = dict(graph.layers)
    deps = dict(graph.dependencies)
    for extra_name, extra_dsk in extra.items():
        layers[extra_name] = extra_dsk
        deps[extra_name] = {name}
    return HighLevelGraph(layers, deps)


def _merge_pair(a, b):
    r"""Two partials over disjoint key sets, ``beta = 0``, as one in float64 (`merge_attention`'s formula).

    Written out rather than calling `elastic_np.reference.merge_attention` so that it
    allocates only the result and one temporary of the ``out`` size: Dask's
    worker processes start with ``MALLOC_TRIM_THRESHOLD_`` set, which makes
    every large allocation a fresh ``mmap``.
    """
    (out_a, lse_a), (out_b, lse_b) = a, b
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        lse = np.logaddexp(lse_a.astype(np.float64, copy=False), lse_b)
        shift = np.where(np.isneginf(lse), 0.0, lse)  # a row kept by neither: weights 0, not NaN
        out = np.multiply(out_a, np.exp(lse_a - shift)[..., None], dtype=np.float64)
        out += np.multiply(out_b, np.exp(lse_b - shift)[..., None], dtype=np.float64)
    return out, lse


def _finish(partial, beta, dtype):
    """The root: ``beta`` (per head) added once to the merged denominator, rounded once to ``dtype``."""
    out_p, lse_p = partial
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        lse = np.logaddexp(lse_p.astype(np.float64, copy=False), np.log(beta)[:, None])
        shift = np.where(np.isneginf(lse), 0.0, lse)
        out = np.multiply(out_p, np.exp(lse_p - shift)[..., None], dtype=np.float64)
    return out.astype(dtype, copy=False), lse.astype(dtype, copy=False)


def _empty_partial(shape):
    return np.zeros(shape), np.full(shape[:3], -np.inf)


@_spec.takes_options(own=("mask", "bias"))
def attention(q, k, v, *, return_lse=False, backend="cpu", threads_per_task=1, **options):
    """`elastic_np.attention` over Dask arrays, lazily: a Dask array (and ``lse``).

    Parameters
    ----------
    q, k, v : dask.array.Array or array_like
        Shapes as for `elastic_np.attention`. The chunks of ``q`` along
        batch, heads and queries and those of ``k`` along the keys set the
        blocks (``k`` and ``v`` are rechunked to ``q``'s batch chunks, ``v``
        to ``k``'s); the head dims are made one chunk.
    mask, bias : dask.array.Array or array_like, optional
        Rechunked like the scores they apply to (axes of size 1 stay broadcast).
    backend : {"cpu", "reference", "cuda", "auto"}, optional
        The backend each block runs on.
    threads_per_task : int, optional
        Kernel threads of each block task (1: one per Dask worker thread).
    %(other_names)s
        As for `elastic_np.attention`.

    Returns
    -------
    out : dask.array.Array, shape (B, H, N, Dv)
        Chunked like ``q`` along (B, H, N); the dtype of `elastic_np.attention`.
    lse : dask.array.Array, shape (B, H, N)
        Only with ``return_lse=True``.

    Examples
    --------
    >>> import dask.array as da, numpy as np
    >>> import elastic_np.dask as enpd
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (da.from_array(rng.standard_normal((1, 2, 8, 4)), chunks=(1, 1, 4, 4)) for _ in range(3))
    >>> out = enpd.attention(q, k, v, causal=True, backend="reference")
    >>> out.chunks[2], out.compute(scheduler="sync").shape
    ((4, 4), (1, 2, 8, 4))
    """
    setup = _setup(q, k, v, _spec.complete(options, "attention"), backend, threads_per_task)
    spec, dtype = setup.spec, setup.dtype
    token = tokenize(setup.q, setup.k, setup.v, setup.mask, setup.bias, spec.__dict__, setup.problem.beta, dtype)
    part, node, root = (f"enp-{s}-{token}" for s in ("partial", "merge", "root"))
    out_name, lse_name = f"enp-attention-{token}", f"enp-lse-{token}"
    Dv = setup.problem.shape[6]
    beta_h = setup.problem.beta
    dsk, lse_dsk = {}, {}
    leaves = {}
    for index, block in setup.blocks():
        if _dask_blocks.plan(spec, block):
            dsk[(part,) + index] = (_dask_blocks.forward_block, spec, block) + setup.inputs(index, block)
            leaves.setdefault(index[:3], []).append((part,) + index)
    qc = setup.q.chunks
    for bi, b_len in enumerate(qc[0]):
        for hi, h_len in enumerate(qc[1]):
            h0 = int(sum(qc[1][:hi]))
            for ii, n_len in enumerate(qc[2]):
                row = (bi, hi, ii)
                level = leaves.get(row) or [(node, *row, "empty")]
                if row not in leaves:
                    dsk[level[0]] = (_empty_partial, (b_len, h_len, n_len, Dv))
                depth = 0
                while len(level) > 1:  # a fixed binary tree over key chunks, in order
                    nxt = []
                    for t in range(0, len(level) - 1, 2):
                        key = (node, *row, depth, t // 2)
                        dsk[key] = (_merge_pair, level[t], level[t + 1])
                        nxt.append(key)
                    if len(level) % 2:
                        nxt.append(level[-1])
                    level, depth = nxt, depth + 1
                dsk[(root, *row)] = (_finish, level[0], beta_h[h0:h0 + h_len], dtype)
                dsk[(out_name, *row, 0)] = (operator.getitem, (root, *row), 0)
                lse_dsk[(lse_name, *row)] = (operator.getitem, (root, *row), 1)
    graph = _graph(out_name, dsk, [setup.q, setup.k, setup.v, setup.mask, setup.bias],
                   {lse_name: lse_dsk})
    out = da.Array(graph, out_name, chunks=qc[:3] + ((Dv,),), dtype=dtype)
    if not return_lse:
        return out
    lse = da.Array(graph, lse_name, chunks=qc[:3], dtype=dtype)
    return out, lse


@_spec.takes_options()
def attention_backward(dout, q, k, v, out, lse, *, dlse=None, backend="cpu", threads_per_task=1, **options):
    """`elastic_np.attention_backward` over Dask arrays, lazily.

    ``out`` and ``lse`` are those of `attention` (``return_lse=True``): each
    block's share of the gradients is computed against the whole rows'
    ``lse``, so the shares add up exactly. ``dlse``, the cotangent of ``lse``
    (None for zeros), is chunked like the rows and goes to every block of its rows.

    Parameters
    ----------
    dout, q, k, v, out, lse, dlse : dask.array.Array or array_like
        As for `elastic_np.attention_backward`.
    backend, threads_per_task
        As for `attention`.
    %(other_names)s
        As for `elastic_np.attention`.

    Returns
    -------
    AttentionGrads
        Of Dask arrays: ``dq`` chunked like ``q``, ``dk`` and ``dv`` like ``k``
        (after its rechunking to ``q``'s batch chunks), ``dtau``, ``dbeta``,
        ``dsigma`` and ``dbias`` in the shapes of ``tau``, ``beta``,
        ``sigma`` and ``bias`` (0-d arrays for scalars). `compute_grads`
        computes them all in one pass.

    Examples
    --------
    >>> import dask.array as da, numpy as np
    >>> import elastic_np.dask as enpd
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (da.from_array(rng.standard_normal((1, 2, 8, 4)), chunks=(1, 1, 4, 4)) for _ in range(3))
    >>> out, lse = enpd.attention(q, k, v, tau=0.5, return_lse=True, backend="reference")
    >>> grads = enpd.attention_backward(da.ones_like(out), q, k, v, out, lse, tau=0.5, backend="reference")
    >>> g = enpd.compute_grads(grads, scheduler="sync")
    >>> g.dk.shape, isinstance(g.dtau, float)
    ((1, 2, 8, 4), True)
    """
    setup = _setup(q, k, v, _spec.complete(options, "attention_backward"), backend, threads_per_task)
    spec, problem = setup.spec, setup.problem
    B, H, Hkv, N, M, D, Dv = problem.shape
    rows = setup.q.chunks[:3]
    dout, out = (_rows_array(a, (B, H, N, Dv), rows + ((Dv,),), name) for a, name in
                 ((dout, "dout"), (out, "out")))
    lse = _rows_array(lse, (B, H, N), rows, "lse")
    if dlse is not None:
        dlse = _rows_array(dlse, (B, H, N), rows, "dlse")
    token = tokenize(setup.q, setup.k, setup.v, setup.mask, setup.bias, dout, out, lse, dlse,
                     spec.__dict__, setup.dtype)
    name = f"enp-backward-{token}"
    blk, dq_n, dk_n, dv_n, small_n, dbias_n = (
        f"{name}-{s}" for s in ("block", "dq", "dk", "dv", "small", "dbias"))
    dsk = {}
    done = []
    for index, block in setup.blocks():
        if not _dask_blocks.plan(spec, block):
            continue
        q_key, k_in, v_in, m_key, b_key, kv_first = setup.inputs(index, block)
        row = index[:3]
        dsk[(blk,) + index] = (_dask_blocks.backward_block, spec, block, q_key, k_in, v_in,
                               (dout.name, *row, 0), (out.name, *row, 0), (lse.name, *row),
                               m_key, b_key, kv_first, _row_key(dlse, row))
        done.append((index, block))
    # Each block's result is split into its fields on the worker that holds it, so that a sum
    # moves only the field it needs; the sums are binary trees in block order (fixed bits).
    fields = {"dq": 0, "dk": 1, "dv": 2, "dtau": 3, "dsigma": 4, "dbias": 5}
    for index, _ in done:
        for field, slot in fields.items():
            dsk[(f"{blk}-{field}",) + index] = (operator.getitem, (blk,) + index, slot)
    layers = {}
    qc = setup.q.chunks
    by_row = {}
    for index, _ in done:
        by_row.setdefault(index[:3], []).append((f"{blk}-dq",) + index)
    layers[dq_n] = {}
    for row in np.ndindex(*setup.q.numblocks[:3]):
        shape = tuple(qc[ax][row[ax]] for ax in range(3)) + (D,)
        _tree_sum(dsk, layers[dq_n], f"{blk}-dq-sum", row, by_row.get(row, []), shape, setup.dtype,
                  (dq_n,) + row + (0,))
    # dk, dv: every block's share of the kv heads of each chunk of k
    kc = setup.k.chunks
    k_starts = setup.offsets(kc[1])
    for field, lname, width in (("dk", dk_n, D), ("dv", dv_n, Dv)):
        shares = {}
        for index, block in done:
            cover, kv_first = setup.kv_cover(block)
            for c in cover:
                key = (f"{blk}-{field}-heads",) + index + (c,)
                dsk[key] = (_heads, (f"{blk}-{field}",) + index,
                            int(k_starts[c]) - kv_first, int(k_starts[c + 1]) - kv_first)
                shares.setdefault((index[0], c, index[3]), []).append(key)
        layers[lname] = {}
        for chunk in np.ndindex(*setup.k.numblocks[:3]):
            shape = tuple(kc[ax][chunk[ax]] for ax in range(3)) + (width,)
            _tree_sum(dsk, layers[lname], f"{blk}-{field}-sum", chunk, shares.get(chunk, []), shape,
                      setup.dtype, (lname,) + chunk + (0,))
    # dtau, dsigma from the blocks; dbeta from whole rows (it is a function of the row alone)
    heads = [(block[0], block[2], index) for index, block in done]
    oh = setup.offsets(qc[1])
    row_blocks = list(np.ndindex(*setup.q.numblocks[:3]))
    dbeta_rows = [(_dask_blocks.dbeta_rows, (dout.name, *r, 0), (out.name, *r, 0), (lse.name, *r),
                   _row_key(dlse, r)) for r in row_blocks]
    small = {
        "dtau": (problem.tau_shape, (_per_head, [h0 for _, h0, _ in heads],
                                     [(f"{blk}-dtau",) + index for *_, index in heads], H, problem.tau_shape)),
        "dbeta": (problem.beta_shape, (_sink_per_head, [int(oh[r[1]]) for r in row_blocks], dbeta_rows, H,
                                       problem.beta_shape)),
    }
    if problem.sigma is not None:
        small["dsigma"] = (problem.sigma_shape, (
            _per_batch_head, [(b0, h0) for b0, h0, _ in heads], [(f"{blk}-dsigma",) + index for *_, index in heads],
            (B, H), problem.sigma_shape))
    for field, (shape, task) in small.items():
        layers[f"{small_n}-{field}"] = {(f"{small_n}-{field}",) + (0,) * len(shape): task}
    if setup.bias is not None:
        layers[dbias_n] = _dbias_layer(setup, dsk, dbias_n, blk, done)
    deps = [a for a in (setup.q, setup.k, setup.v, setup.mask, setup.bias, dout, out, lse, dlse) if a is not None]
    graph = HighLevelGraph.from_collections(blk, dsk, dependencies=deps)
    all_layers, all_deps = dict(graph.layers), dict(graph.dependencies)
    for lname, layer in layers.items():
        all_layers[lname] = layer
        all_deps[lname] = {blk, dout.name, out.name, lse.name} | ({dlse.name} if dlse is not None else set())
    graph = HighLevelGraph(all_layers, all_deps)

    def scalar(field, shape):
        return da.Array(graph, f"{small_n}-{field}", chunks=tuple((n,) for n in shape), dtype=np.float64)

    dbias = None
    if setup.bias is not None:
        b4 = setup.bias
        dbias = da.Array(graph, dbias_n, chunks=b4.chunks, dtype=setup.dtype).reshape(problem.bias_shape)
    return AttentionGrads(
        dq=da.Array(graph, dq_n, chunks=qc[:3] + ((D,),), dtype=setup.dtype),
        dk=da.Array(graph, dk_n, chunks=kc[:3] + ((D,),), dtype=setup.dtype),
        dv=da.Array(graph, dv_n, chunks=kc[:3] + ((Dv,),), dtype=setup.dtype),
        dtau=scalar("dtau", problem.tau_shape),
        dbeta=scalar("dbeta", problem.beta_shape),
        dsigma=None if problem.sigma is None else scalar("dsigma", problem.sigma_shape),
        dbias=dbias,
    )


def compute_grads(grads, **compute_kwargs):
    """Compute every field of `attention_backward`'s result in one pass.

    Returns `AttentionGrads` of NumPy arrays, with ``dtau``, ``dbeta`` and
    ``dsigma`` Python floats where ``tau``, ``beta``, ``sigma`` were scalars,
    as `elastic_np.attention_backward` returns them. ``compute_kwargs`` go to
    `dask.compute` (``scheduler=...``; a ``distributed.Client`` in use is the default).
    """
    names = [f.name for f in dataclasses.fields(AttentionGrads)]
    lazy = {n: getattr(grads, n) for n in names if getattr(grads, n) is not None}
    values = dict(zip(lazy, dask.compute(*lazy.values(), **compute_kwargs)))
    for n in ("dtau", "dbeta", "dsigma"):
        if n in values and np.ndim(values[n]) == 0:
            values[n] = float(values[n])
    return AttentionGrads(**{n: values.get(n) for n in names})


def _rows_array(a, shape, chunks, name):
    """``dout``, ``out``, ``lse`` or ``dlse`` as a Dask array chunked like the query rows."""
    a = da.asarray(a)
    if a.shape != shape:
        raise ValueError(f"`{name}` must have shape {shape}, got {a.shape}")
    return a.rechunk(chunks)


def _row_key(a, row):
    """The key of ``a``'s chunk of the query rows ``row`` (batch, heads, queries); None without ``a``."""
    return None if a is None else (a.name, *row)


def _heads(a, lo, hi):
    """Heads ``lo:hi`` (axis 1) of a block's ``dk`` or ``dv``."""
    return a[:, lo:hi]


def _per_head(firsts, shares, H, shape):
    """Per-head shares (``share`` of heads from ``h0``) summed into ``(H,)`` in order, then to ``shape``."""
    total = np.zeros(H)
    for h0, share in zip(firsts, shares):
        total[h0:h0 + len(share)] += share
    return np.asarray(_options.sum_to_shape(total, shape), dtype=np.float64)


def _sink_per_head(firsts, terms, H, shape):
    """``dbeta`` from the row chunks' `~elastic_np._options.sink_terms` (heads from ``h0``), merged in order."""
    top, scaled = np.zeros(H), np.zeros(H)
    for h0, part in zip(firsts, terms):
        heads = slice(h0, h0 + len(part[1]))
        top[heads], scaled[heads] = _options.merge_sink_terms((top[heads], scaled[heads]), part)
    if math.prod(shape) > 1:
        return np.asarray(_options.sum_to_shape(_options.sink_from_terms(top, scaled), shape), dtype=np.float64)
    if H == 0:
        return np.zeros(shape)
    shared = (top[:1], scaled[:1])  # one beta for every head: its rows merged over the heads too
    for h in range(1, H):
        shared = _options.merge_sink_terms(shared, (top[h:h + 1], scaled[h:h + 1]))
    return _options.sink_from_terms(*shared).reshape(shape)


def _per_batch_head(firsts, shares, BH, shape):
    """``(B, H)`` shares from ``(b0, h0)`` summed in order, then to ``shape``."""
    total = np.zeros(BH)
    for (b0, h0), share in zip(firsts, shares):
        total[b0:b0 + share.shape[0], h0:h0 + share.shape[1]] += share
    return np.asarray(_options.sum_to_shape(total, shape), dtype=np.float64)


def _dbias_layer(setup, dsk, name, blk, done):
    """``dbias`` chunked like the 4-D bias: each chunk sums its blocks (over the broadcast axes)."""
    bias = setup.bias
    shares = {}
    for index, _ in done:
        chunk = tuple(0 if bias.shape[ax] == 1 else index[ax] for ax in range(4))
        shares.setdefault(chunk, []).append((f"{blk}-dbias",) + index)
    layer = {}
    for chunk in np.ndindex(*bias.numblocks):
        shape = tuple(bias.chunks[ax][chunk[ax]] for ax in range(4))
        _tree_sum(dsk, layer, f"{blk}-dbias-sum", chunk, shares.get(chunk, []), shape, setup.dtype,
                  (name,) + chunk)
    return layer


def _tree_sum(dsk, out_layer, name, where, leaves, shape, dtype, out_key):
    """Tasks summing ``leaves`` (float64 arrays) in a binary tree in their order, rounded once to ``dtype``.

    The tree's tasks go into ``dsk``, the rounded sum ``out_key`` into
    ``out_layer``; zeros when there are no leaves.
    """
    level, depth = list(leaves), 0
    while len(level) > 1:
        nxt = []
        for t in range(0, len(level) - 1, 2):
            key = (name,) + tuple(where) + (depth, t // 2)
            dsk[key] = (operator.add, level[t], level[t + 1])
            nxt.append(key)
        if len(level) % 2:
            nxt.append(level[-1])
        level, depth = nxt, depth + 1
    out_layer[out_key] = (_rounded, level[0] if level else None, shape, dtype)


def _rounded(total, shape, dtype):
    """A float64 sum in ``dtype`` (zeros of ``shape`` for no sum)."""
    return np.zeros(shape, dtype=dtype) if total is None else total.astype(dtype, copy=False)
