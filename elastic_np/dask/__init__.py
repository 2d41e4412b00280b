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

The graph is a ``HighLevelGraph`` of layers, one function each
(`elastic_np.dask._layers`): `_block_layer` (a task per block that keeps something),
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

import dask
import dask.array as da
import numpy as np
from dask.base import tokenize

from elastic_np._api import dispatch
from elastic_np._contract import _problem, _spec, _validation
from elastic_np.dask import _blocks, _layers
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
        backend = "cuda" if dispatch.cuda_is_available() else "cpu"
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
    mask, bias = (_layers._grid_array(a, grid) for a in (mask, bias))
    spec = _blocks.BlockSpec(
        N=N, M=M, group=problem.group_size, ends=np.asarray(problem.kv_ends),
        problem=dataclasses.replace(problem, q=None, k=None, v=None, mask=None, bias=None),
        options=dict(options, scale=problem.scale, beta=0.0, align="array"),
        backend=backend, threads=int(threads_per_task),
    )
    dtype = np.dtype(np.float64) if module.dtypes is None else q.dtype
    return _Setup(q, k, v, mask, bias, spec, problem, dtype)


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
    blocks, kept = _layers._block_layer(setup, part, _blocks.forward_block)
    rows = setup.q.chunks[:3]
    layers = {
        part: (blocks, setup.chunked()),
        merged: (_layers._tree_layer(merged, rows, _layers._leaves(part, kept, _layers._row), _layers._merge_pair, _layers._finish_root(setup)), [part]),
        out_name: (_layers._item_layer(out_name, merged, rows, 0, tail=(0,)), [merged]),
        lse_name: (_layers._item_layer(lse_name, merged, rows, 1), [merged]),
    }
    graph = _layers._graph(setup.chunked(), layers)
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
    row_arrays = [_layers._rows_array(a, (B, H, N, Dv), rows + ((Dv,),), name) for a, name in ((dout, "dout"), (out, "out"))]
    row_arrays += [_layers._rows_array(lse, (B, H, N), rows, "lse"),
                   None if dlse is None else _layers._rows_array(dlse, (B, H, N), rows, "dlse")]
    token = tokenize(setup.q, setup.k, setup.v, setup.mask, setup.bias, *row_arrays, setup.spec.__dict__,
                     setup.dtype)
    name = f"enp-backward-{token}"
    blocks, kept = _layers._block_layer(setup, name, _blocks.backward_block, row_arrays)
    layers = {
        name: (blocks, setup.chunked() + row_arrays),
        f"{name}-fields": (_layers._fields_layer(name, kept), [name]),
    }
    layers.update(_layers._sum_layers(setup, name, kept))
    layers.update(_layers._total_layers(setup, name, kept, row_arrays))
    grads = _layers._gradient_arrays(setup, name, _layers._graph(setup.chunked() + row_arrays, layers))
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
