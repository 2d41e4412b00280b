"""The Dask graph of `elastic_np.dask`: its layers (blocks, fixed merge and sum trees, totals), one function each."""

import itertools
import math
import operator

import dask.array as da
import numpy as np
from dask.highlevelgraph import HighLevelGraph

from elastic_np._contract import _grads, _validation
from elastic_np._contract._types import AttentionGrads
from elastic_np.dask import _blocks


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
# would add a map_blocks layer per gradient, which slows the build.)
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
    the block's chunks (`elastic_np.dask._Setup.inputs`) and its row chunk of each of the
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
