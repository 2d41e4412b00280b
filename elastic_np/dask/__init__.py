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
  its offsets are those of the whole problem (`elastic_np.dask._blocks`).

``attention_backward`` sums ``dq`` over key chunks, ``dk``/``dv`` over query
chunks and the query heads of each group, ``dtau``, ``dbeta``, ``dsigma`` and
``dbias`` over blocks, each in a fixed order: the result depends on the
chunking only, never on the scheduler or the worker count.

The graph is a ``HighLevelGraph`` of layers, one function each (below
`compute_grads`): `_block_layer` (a task per block that keeps something),
`_tree_layer` (a fixed binary tree per output chunk: the forward's merges,
the backward's sums, `_sum_layers`), `_item_layer` and `_fields_layer`
(a task's result split), `_total_layers` (``dtau``, ``dbeta``, ``dsigma``,
one task each). Dask's ``blockwise`` and ``reduction`` would make a task of
every block and pick their own trees, so the layers are written out.

Requires ``pip install "elastic_np[dask]"`` (``dask[array]`` and
``distributed``); ``import elastic_np`` never imports this module.
"""

import dataclasses
import functools
import itertools
import math
import operator

import dask
import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from elastic_np._api import dispatch
from elastic_np._contract import _grads, _problem, _spec, _validation
from elastic_np.dask import _blocks
from elastic_np._contract._types import AttentionGrads

__all__ = ["attention", "attention_backward", "compute_grads"]


@dataclasses.dataclass(frozen=True, eq=False)
class _Setup:
    """Validated inputs rechunked to one block grid, and the block spec."""

    q: da.Array
    k: da.Array
    v: da.Array
    mask: object  # 4-D dask array or None
    bias: object
    spec: _blocks.BlockSpec
    problem: _problem.AttentionProblem  # shapes and normalised options (stand-in arrays)
    dtype: np.dtype

    def chunked(self):
        """The Dask arrays every block reads chunks of: q, k, v, mask, bias (None where not given)."""
        return [self.q, self.k, self.v, self.mask, self.bias]

    def offsets(self, axis_chunks):
        return np.concatenate([[0], np.cumsum(axis_chunks)]).astype(int)

    @functools.cached_property
    def kv_starts(self):
        """The first kv head of each chunk of ``k`` along the heads, and the end (Python ints)."""
        return [int(s) for s in self.offsets(self.k.chunks[1])]

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
        starts = self.kv_starts
        cover = [c for c in range(len(starts) - 1) if starts[c] < hi and starts[c + 1] > lo]
        return cover, starts[cover[0]]

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


def _as_bhnd(arrays, options):
    """``(arrays, layout)``: 4-D ``arrays`` read in ``options["layout"]`` as ``(B, H, N, ·)`` Dask arrays
    (lazy transposes, no copy), the layout taken out of ``options`` (the blocks see ``"bhnd"``)."""
    layout = _spec.check_layout(options.pop("layout"))
    if layout == "bhnd":
        return arrays, layout
    return [None if a is None else da.asarray(a).transpose(0, 2, 1, 3) for a in arrays], layout


def _setup(q, k, v, options, backend, threads_per_task):
    if backend == "auto":
        backend = "cuda" if dispatch._cuda_is_available() else "cpu"
    module = dispatch.get_backend(backend)
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

    problem = _problem.prepare(
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
    spec = _blocks.BlockSpec(
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
    """The root: ``beta`` (per head) added once to the merged denominator, rounded once to ``dtype``.

    ``lse`` in the dtype of the computation (float32 for bfloat16 and float16).
    """
    out_p, lse_p = partial
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        lse = np.logaddexp(lse_p.astype(np.float64, copy=False), np.log(beta)[:, None])
        shift = np.where(np.isneginf(lse), 0.0, lse)
        out = np.multiply(out_p, np.exp(lse_p - shift)[..., None], dtype=np.float64)
    return out.astype(dtype, copy=False), lse.astype(_validation.compute_dtype(dtype), copy=False)


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
        Chunked like ``q`` along (B, H, N); the dtype of `elastic_np.attention`
        (``(B, N, H, Dv)`` with ``layout="bnhd"``).
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
    options = _spec.complete(options, "attention")
    (q, k, v), layout = _as_bhnd([q, k, v], options)
    setup = _setup(q, k, v, options, backend, threads_per_task)
    token = tokenize(setup.q, setup.k, setup.v, setup.mask, setup.bias, setup.spec.__dict__, setup.problem.beta,
                     setup.dtype)
    part, merged, out_name, lse_name = (f"enp-{s}-{token}" for s in ("partial", "merge", "attention", "lse"))
    blocks, kept = _block_layer(setup, part, _blocks.forward_block)
    rows = setup.q.chunks[:3]
    layers = {
        part: (blocks, setup.chunked()),
        merged: (_tree_layer(merged, rows, _leaves(part, kept, _row), _merge_pair, _finish_root(setup)), [part]),
        out_name: (_item_layer(out_name, merged, rows, 0, tail=(0,)), [merged]),
        lse_name: (_item_layer(lse_name, merged, rows, 1), [merged]),
    }
    graph = _graph(setup.chunked(), layers)
    out = da.Array(graph, out_name, chunks=rows + ((setup.problem.shape[6],),), dtype=setup.dtype)
    if layout == "bnhd":
        out = out.transpose(0, 2, 1, 3)
    if not return_lse:
        return out
    return out, da.Array(graph, lse_name, chunks=rows, dtype=_validation.compute_dtype(setup.dtype))


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
    options = _spec.complete(options, "attention_backward")
    (dout, q, k, v, out), layout = _as_bhnd([dout, q, k, v, out], options)
    setup = _setup(q, k, v, options, backend, threads_per_task)
    B, H, Hkv, N, M, D, Dv = setup.problem.shape
    rows = setup.q.chunks[:3]
    row_arrays = [_rows_array(a, (B, H, N, Dv), rows + ((Dv,),), name) for a, name in ((dout, "dout"), (out, "out"))]
    row_arrays += [_rows_array(lse, (B, H, N), rows, "lse"),
                   None if dlse is None else _rows_array(dlse, (B, H, N), rows, "dlse")]
    token = tokenize(setup.q, setup.k, setup.v, setup.mask, setup.bias, *row_arrays, setup.spec.__dict__,
                     setup.dtype)
    name = f"enp-backward-{token}"
    blocks, kept = _block_layer(setup, name, _blocks.backward_block, row_arrays)
    layers = {
        name: (blocks, setup.chunked() + row_arrays),
        f"{name}-fields": (_fields_layer(name, kept), [name]),
    }
    layers.update(_sum_layers(setup, name, kept))
    layers.update(_total_layers(setup, name, kept, row_arrays))
    grads = _gradient_arrays(setup, name, _graph(setup.chunked() + row_arrays, layers))
    if layout == "bhnd":
        return grads
    return dataclasses.replace(grads, **{n: getattr(grads, n).transpose(0, 2, 1, 3) for n in ("dq", "dk", "dv")})


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


def _row(index):
    """The query rows (batch, head and query chunk) of a block's index."""
    return index[:3]


def _row_key(a, row):
    """The key of ``a``'s chunk of the query rows ``row`` (batch, heads, queries); None without ``a``."""
    return None if a is None else (a.name, *row) + (0,) * (a.ndim - 3)


def _heads(a, lo, hi):
    """Heads ``lo:hi`` (axis 1) of a block's ``dk`` or ``dv``."""
    return a[:, lo:hi]


def _per_head(firsts, shares, H, shape):
    """Per-head shares (``share`` of heads from ``h0``) summed into ``(H,)`` in order, then to ``shape``."""
    total = np.zeros(H)
    for h0, share in zip(firsts, shares):
        total[h0:h0 + len(share)] += share
    return np.asarray(_grads.sum_to_shape(total, shape), dtype=np.float64)


def _sink_per_head(firsts, terms, H, shape):
    """``dbeta`` from the row chunks' `~elastic_np._contract._grads.sink_terms` (heads from ``h0``), merged in order."""
    top, scaled = np.zeros(H), np.zeros(H)
    for h0, part in zip(firsts, terms):
        heads = slice(h0, h0 + len(part[1]))
        top[heads], scaled[heads] = _grads.merge_sink_terms((top[heads], scaled[heads]), part)
    if math.prod(shape) > 1:
        return np.asarray(_grads.sum_to_shape(_grads.sink_from_terms(top, scaled), shape), dtype=np.float64)
    if H == 0:
        return np.zeros(shape)
    shared = (top[:1], scaled[:1])  # one beta for every head: its rows merged over the heads too
    for h in range(1, H):
        shared = _grads.merge_sink_terms(shared, (top[h:h + 1], scaled[h:h + 1]))
    return _grads.sink_from_terms(*shared).reshape(shape)


def _per_batch_head(firsts, shares, BH, shape):
    """``(B, H)`` shares from ``(b0, h0)`` summed in order, then to ``shape``."""
    total = np.zeros(BH)
    for (b0, h0), share in zip(firsts, shares):
        total[b0:b0 + share.shape[0], h0:h0 + share.shape[1]] += share
    return np.asarray(_grads.sum_to_shape(total, shape), dtype=np.float64)




# ---------------------------------------------------------------------------
# The graph, one function per layer. The blocks are sparse (no task for a block
# that keeps nothing) and every sum is in a fixed order, neither of which
# `dask.array.blockwise` or `dask.array.reduction` keeps, so these layers are
# written out. (The sums' rounding is each tree's root task: Dask's `astype`
# would add a map_blocks layer per gradient, which measurably slowed the build.)
# ---------------------------------------------------------------------------


def _graph(inputs, layers):
    """One graph: the ``inputs``' graphs and ``layers``, ``{name: (tasks, what the layer reads)}``.

    What a layer reads: names of other layers and Dask arrays (None: nothing).
    """
    graph = HighLevelGraph.merge(*(a.__dask_graph__() for a in inputs if a is not None))
    all_layers, deps = dict(graph.layers), dict(graph.dependencies)
    for name, (tasks, reads) in layers.items():
        all_layers[name] = tasks
        deps[name] = set()
        for read in reads:
            if read is not None:
                deps[name].update([read] if isinstance(read, str) else read.__dask_layers__())
    return HighLevelGraph(all_layers, deps)


def _chunk_indices(grid):
    """The index of every chunk of the chunks ``grid``, in C order."""
    return itertools.product(*(range(len(sizes)) for sizes in grid))


def _chunk_shape(grid, chunk):
    """The shape of chunk ``chunk`` (an index per axis) of the chunks ``grid``."""
    return tuple(int(sizes[i]) for sizes, i in zip(grid, chunk))


def _block_layer(setup, name, fn, row_arrays=()):
    """A task ``(name, b, h, i, j)`` per block that keeps something, and the kept ``(index, block)`` in order.

    The task is ``fn(spec, block, q, k, v, mask, bias, kv_first, *rows)`` on
    the block's chunks (`_Setup.inputs`) and its row chunk of each of the
    ``row_arrays`` (chunked like the query rows; None is passed as None).
    A block that keeps nothing is no task.
    """
    tasks, kept = {}, []
    for index, block in setup.blocks():
        if _blocks.plan(setup.spec, block):
            rows = [_row_key(a, _row(index)) for a in row_arrays]
            tasks[(name,) + index] = (fn, setup.spec, block, *setup.inputs(index, block), *rows)
            kept.append((index, block))
    return tasks, kept


def _leaves(name, kept, chunk_of):
    """The keys ``(name, *index)`` of the ``kept`` blocks by the chunk ``chunk_of(index)`` they go to, in order."""
    leaves = {}
    for index, _ in kept:
        leaves.setdefault(chunk_of(index), []).append((name,) + index)
    return leaves


def _tree_layer(name, grid, leaves, combine, root):
    """Per chunk of the chunks ``grid``: its ``leaves`` combined two by two in a fixed binary tree, in order.

    ``leaves`` maps a chunk's index to its leaf keys; ``root(chunk, top)``
    is the chunk's task ``(name, *chunk)``, from the tree's top key (None
    for a chunk without leaves).
    """
    tasks = {}
    for chunk in _chunk_indices(grid):
        level, depth = list(leaves.get(chunk, ())), 0
        while len(level) > 1:
            pairs = range(0, len(level) - 1, 2)
            nodes = [(f"{name}-tree",) + chunk + (depth, t // 2) for t in pairs]
            tasks.update((node, (combine, level[t], level[t + 1])) for node, t in zip(nodes, pairs))
            level, depth = nodes + level[2 * len(nodes):], depth + 1
        tasks[(name,) + chunk] = root(chunk, level[0] if level else None)
    return tasks


def _finish_root(setup):
    """The forward tree's root task: `_finish` of a row's merged partial (an empty one for a row with none)."""
    rows, heads = setup.q.chunks[:3], setup.offsets(setup.q.chunks[1])
    Dv, beta = setup.problem.shape[6], setup.problem.beta

    def root(row, top):
        if top is None:
            top = (_empty_partial, _chunk_shape(rows, row) + (Dv,))
        return (_finish, top, beta[heads[row[1]]:heads[row[1] + 1]], setup.dtype)

    return root


def _item_layer(name, source, grid, item, tail=()):
    """``(name, *chunk, *tail)``: item ``item`` of the task ``(source, *chunk)``, for every chunk of ``grid``."""
    return {(name,) + chunk + tail: (operator.getitem, (source,) + chunk, item)
            for chunk in _chunk_indices(grid)}


#: The fields of `elastic_np.dask._blocks.backward_block`'s result, in order.
_BLOCK_FIELDS = ("dq", "dk", "dv", "dtau", "dsigma", "dbias")


def _fields_layer(name, kept):
    """Each block's result split into its fields, ``(f"{name}-{field}", *index)``.

    Split on the worker that holds the block, so that a sum moves only the
    field it needs.
    """
    return {(f"{name}-{field}",) + index: (operator.getitem, (name,) + index, slot)
            for index, _ in kept for slot, field in enumerate(_BLOCK_FIELDS)}


def _sum_layer(name, grid, leaves, dtype, reads):
    """A layer of sums in the chunks ``grid``: each chunk's float64 ``leaves`` (`_tree_layer`), rounded once."""
    def root(chunk, top):
        return (_rounded, top, _chunk_shape(grid, chunk), dtype)

    return _tree_layer(name, grid, leaves, operator.add, root), reads


def _rounded(total, shape, dtype):
    """A float64 sum in ``dtype`` (zeros of ``shape`` for no sum)."""
    return np.zeros(shape, dtype=dtype) if total is None else total.astype(dtype, copy=False)


def _kv_sum_layer(setup, name, field, kept, width):
    """``dk`` or ``dv`` in ``k``'s chunks: every block's share of the kv heads of each chunk (`_heads`), summed."""
    starts = setup.kv_starts
    tasks, leaves = {}, {}
    for index, block in kept:
        cover, kv_first = setup.kv_cover(block)
        for c in cover:
            key = (f"{name}-{field}-heads",) + index + (c,)
            tasks[key] = (_heads, (f"{name}-{field}",) + index, starts[c] - kv_first, starts[c + 1] - kv_first)
            leaves.setdefault((index[0], c, index[3], 0), []).append(key)
    sums, reads = _sum_layer(f"{name}-{field}-sum", setup.k.chunks[:3] + ((width,),), leaves, setup.dtype,
                             [f"{name}-fields"])
    return {**tasks, **sums}, reads


def _sum_layers(setup, name, kept):
    """``dq`` over key chunks, ``dk`` and ``dv`` over query chunks and group heads, ``dbias`` over blocks.

    Layers ``f"{name}-{field}-sum"`` of the sums in the chunks of the
    gradient (``dbias``: of the 4-D bias, its size-1 axes summed over).
    """
    D, Dv = setup.problem.shape[5:]
    fields, dtype = [f"{name}-fields"], setup.dtype
    layers = {
        f"{name}-dq-sum": _sum_layer(f"{name}-dq-sum", setup.q.chunks[:3] + ((D,),),
                                     _leaves(f"{name}-dq", kept, lambda index: _row(index) + (0,)), dtype, fields),
        f"{name}-dk-sum": _kv_sum_layer(setup, name, "dk", kept, D),
        f"{name}-dv-sum": _kv_sum_layer(setup, name, "dv", kept, Dv),
    }
    bias = setup.bias
    if bias is not None:
        def chunk(index):
            return tuple(0 if bias.shape[ax] == 1 else index[ax] for ax in range(4))

        layers[f"{name}-dbias-sum"] = _sum_layer(f"{name}-dbias-sum", bias.chunks,
                                                 _leaves(f"{name}-dbias", kept, chunk), dtype, fields)
    return layers


def _total_layers(setup, name, kept, row_arrays):
    """``dtau`` and ``dsigma`` summed over the blocks, ``dbeta`` merged over the row chunks, in order.

    One task each, in layers ``f"{name}-total-{field}"``: ``dbeta`` depends on
    whole rows only, so its terms come from each row chunk (`dbeta_rows`),
    not from the blocks.
    """
    problem = setup.problem
    B, H = problem.shape[:2]
    firsts = [(block[0], block[2]) for _, block in kept]
    rows = list(_chunk_indices(setup.q.chunks[:3]))
    heads = setup.offsets(setup.q.chunks[1])
    terms = [(_blocks.dbeta_rows, *(_row_key(a, row) for a in row_arrays)) for row in rows]
    totals = {
        "dtau": (problem.tau_shape, _per_head, [h0 for _, h0 in firsts], f"{name}-dtau", H),
        "dbeta": (problem.beta_shape, _sink_per_head, [int(heads[row[1]]) for row in rows], terms, H),
    }
    if problem.sigma is not None:
        totals["dsigma"] = (problem.sigma_shape, _per_batch_head, firsts, f"{name}-dsigma", (B, H))
    layers = {}
    for field, (shape, fn, where, shares, size) in totals.items():
        if isinstance(shares, str):  # a field of every block
            shares = [(shares,) + index for index, _ in kept]
        key = (f"{name}-total-{field}",) + (0,) * len(shape)
        layers[key[0]] = ({key: (fn, where, shares, size, shape)}, [f"{name}-fields"] + row_arrays)
    return layers


def _gradient_arrays(setup, name, graph):
    """`AttentionGrads` of the backward's ``graph``: the sums in the dtype, the totals in float64."""
    problem = setup.problem
    D, Dv = problem.shape[5:]

    def array(layer, chunks, dtype=setup.dtype):
        return da.Array(graph, f"{name}-{layer}", chunks=chunks, dtype=dtype)

    def total(field, shape):
        return array(f"total-{field}", tuple((n,) for n in shape), np.float64)

    qc, kc = setup.q.chunks[:3], setup.k.chunks[:3]
    dbias = None
    if setup.bias is not None:
        dbias = array("dbias-sum", setup.bias.chunks).reshape(problem.bias_shape)
    return AttentionGrads(
        dq=array("dq-sum", qc + ((D,),)),
        dk=array("dk-sum", kc + ((D,),)),
        dv=array("dv-sum", kc + ((Dv,),)),
        dtau=total("dtau", problem.tau_shape),
        dbeta=total("dbeta", problem.beta_shape),
        dsigma=None if problem.sigma is None else total("dsigma", problem.sigma_shape),
        dbias=dbias,
    )
