"""Numba CPU kernels: tiled online-softmax attention, forward, backward and double backward.

The contract is the one of `elastic_np.reference.attention` (see the
project's contract, section 2): every option (causal, ``window_size``,
``kv_lengths``, boolean ``mask``, NVM, per-head ``tau`` and ``beta``, the
dynamic window, and the score modifiers ``softcap``, ``alibi_slopes`` and an
additive ``bias`` with its gradient) in float32 or float64, output in the
input dtype; bfloat16 and float16 are read as they are stored, computed in
float32 and written back rounded (`elastic_np.cpu._tiles.halves`), ``lse``
in float32.

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
  ``config.DQ_SHARES_BYTES``). No two tasks write the same memory and every sum runs
  in a fixed order, so results are the same bits on every run and for every
  thread count.
- double backward (the backward's tangent, `double_backward`): a query pass
  like the forward (one task per query tile: the tangents of ``out`` and
  ``lse``), then a key pass like the backward (its tasks, dq shares and
  dbias plan: the tangents of the gradients).
- score modifiers: applied to each tile where its logits are formed
  (`elastic_np.cpu._tiles.logits.logits_tile`), before NVM, the
  temperature's division (already in the scaled queries) and the gate:
  ``tanh`` is the vectorised one of `elastic_np.cpu._tiles.tanh`, the bias
  is read tile by tile from its distinct entries (no copy when its dtype is
  the kernel's), whose values the kernel plan checks first
  (`elastic_np._contract._compact.compact_bias`). ``dbias`` is written by
  the task that owns each of its elements: when the bias is broadcast over
  the batch or the heads, each task walks a fixed range of (batch, kv head)
  pairs (a "lane") and the lanes' float64 partials are summed in order; when
  it is broadcast over the keys, each key tile keeps a partial of its own
  (like the shares of dq), summed in key-tile order
  (`elastic_np.cpu._prefill.dbias.DbiasPlan`).

The tasks of a kernel run on the calling thread and a pool of Python
threads (`elastic_np.cpu._runtime.threads.run_tasks`; the kernels release
the GIL), as many as `numba.get_num_threads` says, so the number of threads
follows `numba.set_num_threads` (`thread_count`).

Modules
-------
Five subpackages, whose ``__init__`` files import nothing: this module
imports every module that makes a cached function inside
`elastic_np.cpu._runtime.numba_private.own_cache`.

``_runtime``
    how the kernels run: ``config`` (every tunable), ``numba_private`` (each
    use of Numba's internals, the cache folder of each setting),
    ``threads`` (the pool and each thread's share of the tasks), ``openmp``
    (the other libraries' OpenMP workers), ``scratch`` (arrays kept between
    calls)
``_tiles``
    what one task does to a tile: the primitives (``simd``, ``products``,
    ``exp``, ``tanh``, ``transpose``; ``calls``, the same behind C entry
    points; ``amx``), the arrays as the kernels read and write them
    (``operands``, ``halves``), the logits of a tile (``logits``,
    ``scalar``) and the online softmax's steps (``online_softmax``)
``_prefill``
    ``plan`` (the options as runtime values, kept per ``plan_key``, for
    every kernel), ``forward``, ``forward_amx``, ``backward``,
    ``key_tiles`` (the backward's key tiles, shared with the double
    backward's key pass), ``dbias`` (where the bias's gradient goes),
    ``values`` (compiled checks of arrays' values)
``_decode``
    ``plan`` (which decode kernel, its tiles and key splits), ``decode``
    (the kernels), ``merge`` (a task's result: its rows of the output, or
    its split's partials and their merge), ``tiles`` and ``products`` (how
    they read the cache)
``_double_backward``
    ``double_backward`` (the host side), ``tangents`` (the direction as the
    kernels read it), ``tangent_rows`` (the query pass), ``tangent_keys``
    (the key pass)
"""


import numpy as np

from elastic_np._contract import _problem, _validation
from elastic_np.cpu._runtime.numba_private import own_cache
from elastic_np.reference._backward import check_backward_arrays  # NumPy arrays in the problem's dtype

with own_cache():  # every module of the package that makes a cached function is imported here
    from elastic_np.cpu._decode import decode, plan as decode_plan, planned
    from elastic_np.cpu._double_backward.double_backward import double_backward
    from elastic_np.cpu._prefill import forward as prefill, forward_amx
    from elastic_np.cpu._prefill.backward import backward, planned as planned_backward
    from elastic_np.cpu._prefill import values
    from elastic_np.cpu._prefill.values import below_inf, finite
    from elastic_np.cpu._runtime.threads import start_threads, thread_count

#: Takes a user's ``score_mod``, ``mask_mod`` and ``block_mask`` (`elastic_np._variants`).
takes_variants = True

__all__ = [
    "dtypes", "is_available", "check_available", "prepare", "check_backward_arrays", "forward", "paged_forward",
    "planned_forward", "backward", "planned_backward", "finite", "below_inf", "load",
    "double_backward", "thread_count", "start_threads",
]


#: The dtypes of ``q``, ``k``, ``v`` the kernels take: they compute in float32 for the halves.
dtypes = ("float32", "float64", *_validation.HALF_DTYPES)


def is_available():
    """True: the CPU kernels need only NumPy and Numba."""
    return True


def load():
    """Load what any first call of the kernels loads before its own: Numba's CPU target (its typing and lowering
    registries, about half a second once per process) and the value checks' loops (`values.compile_for`, from
    Numba's cache where they are there). `elastic_np.torch` calls it as it is imported, so that a first call's time
    is its own kernels' (docs/performance.rst, "The first call")."""
    values.compile_for(np.dtype(np.float32))


def check_available():
    """Raise nothing: the CPU backend is always usable once imported."""
    return None


def prepare(q, k, v, **options):
    """`elastic_np._contract._problem.prepare`, leaving the bias's values, and the keys' and values', to the backend.

    The bias's values are checked on its distinct entries only, before and
    after a conversion to the kernels' dtype (`elastic_np.cpu._prefill.plan`), not
    on the broadcast view. The decode kernel finds a NaN or inf key or value
    as it reads them (`elastic_np.cpu._decode.decode`): at decode shapes a separate
    pass over the cache costs as much as the attention; the other paths
    check them first.
    """
    problem = _problem.prepare(q, k, v, defer_bias_check=True, defer_kv_check=True, **options)
    if problem.quantized is not None and problem.compute_dtype != np.float32:
        raise TypeError(f"the cpu kernels read a quantized cache ({problem.quantized}) with `q` in float32, bfloat16 "
                        f"or float16, not {problem.dtype}")
    return problem


def forward(problem):
    """Attention forward for a validated problem: ``(out, lse)`` in the input dtype.

    The decode kernel when the problem has a few queries per sequence
    (`elastic_np.cpu._decode.plan.takes`), the prefill kernel otherwise: on AMX
    tiles for a bfloat16 problem where the CPU has them (`elastic_np.cpu._prefill.forward_amx.takes`)
    and its cache is not quantized (the float32 products dequantize a quantized cache's tiles into
    scratch as they read them: `elastic_np.cpu._tiles.pages.cache_tile`). A problem with a user's
    ``score_mod`` or ``mask_mod`` runs on the prefill kernel whatever its shape (`elastic_np.cpu._tiles.variant`).

    Parameters
    ----------
    problem : elastic_np._contract._problem.AttentionProblem

    Returns
    -------
    out : ndarray, shape (B, H, N, Dv)
    lse : ndarray, shape (B, H, N)
    """
    if problem.variant is not None:
        return prefill.forward(problem)
    if decode_plan.takes(problem):
        return decode.forward(problem)
    if problem.quantized is not None:
        return prefill.forward(problem)
    if forward_amx.takes(problem):
        return forward_amx.forward(problem)
    return prefill.forward(problem)


def paged_forward(problem, paged, into=None, scale_pages=None):
    """`forward` of a problem whose keys and values are a paged cache's: read from the pages in place.

    ``paged = (k_pages, v_pages, block_table)``, ``(num_blocks, block_size,
    Hkv, D)`` pools and the pages of each batch entry; ``problem``'s ``k``
    and ``v`` stand in for the gathered ``(B, Hkv, M, D)`` arrays (shapes
    only), its ``kv_lengths`` the keys each entry uses. The decode kernel
    or the prefill kernel, as `forward` chooses, with the bits `forward`
    gives on the gathered arrays; a bfloat16 problem that `forward` runs on
    AMX tiles reads its keys from the pages too, and transposes its values
    from them into the copy that kernel makes of them in any case
    (`elastic_np.cpu._prefill.forward_amx.paged_values_transposed`); a
    quantized cache's chunk is the prefill kernel's, its tiles dequantized
    from the pages as they are read; so is a problem with a user's variant.
    ``into``: where the prefill kernels may write ``out``
    (`elastic_np.cpu._prefill.forward.forward`'s). ``scale_pages``: a
    quantized cache's per-token or per-group scales, ``(num_blocks,
    block_size, Hkv, D // G)`` for ``k`` and for ``v`` (``problem``'s
    scales stand in for them), or None.
    """
    if problem.variant is not None:
        return prefill.forward(problem, paged=paged, into=into, scale_pages=scale_pages)
    if decode_plan.takes(problem):
        return decode.forward(problem, paged=paged, scale_pages=scale_pages)
    if problem.quantized is not None:
        return prefill.forward(problem, paged=paged, into=into, scale_pages=scale_pages)
    if forward_amx.takes(problem):
        return forward_amx.forward(problem, paged=paged, into=into)
    return prefill.forward(problem, paged=paged, into=into)


def planned_forward(problem, like=None):
    """`forward` of ``problem`` as ``run(q, k, v) -> (out, lse)``, for any ``(B, H, N, D)`` arrays of its shapes
    and dtype, their values checked as a call in full checks them (`elastic_np._api.plans`; the decode kernels
    check what they read: `planned.contiguous`): what `forward` derives from the problem's fields alone is
    derived once. The kernel is chosen on every run, as `forward` chooses it. ``like``: the
    ``run`` of a problem that differs from this one in its number of keys alone (`planned.contiguous`).
    """
    def otherwise(q, k, v):  # the prefill kernels'
        _validation.check_finite(q, "q")
        return forward(problem.with_arrays(q, k, v))

    return planned.contiguous(problem, otherwise, like)
