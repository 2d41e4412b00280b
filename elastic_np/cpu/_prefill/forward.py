"""The prefill forward: one task per (batch, head, query tile), the online softmax over key tiles.
"""


import math

import numpy as np
from numba import njit

from elastic_np._contract._ranges import key_range
from elastic_np.cpu._prefill.plan import check_cache, check_paged_cache, kernel_options
from elastic_np.cpu._runtime import config
from elastic_np.cpu._runtime.config import FASTMATH
from elastic_np.cpu._runtime.threads import claim, query_tile, run_tasks, task_counter
from elastic_np.cpu._tiles.cache_scales import cache_scales, fine_operands
from elastic_np.cpu._tiles.calls import exp_shift_sum, matmul_nn, matmul_nn_max, matmul_tn
from elastic_np.cpu._tiles.halves import scratch_for
from elastic_np.cpu._tiles.logits import logits_tile, modify_tile, query_factor
from elastic_np.cpu._tiles.online_softmax import finish_rows, load_queries, online_update
from elastic_np.cpu._tiles.operands import BNHD, head_rows, new, operand, shape
from elastic_np.cpu._tiles.pages import NO_PAGES, cache_tile, key_quant, paged as paged_pages, pool_operand, value_quant
from elastic_np.cpu._tiles.simd import compile_for
from elastic_np.cpu._tiles.variant import EMPTY, kernel_variant, tile_state, uncached


def forward(problem, paged=None, into=None, scale_pages=None):
    """The prefill forward (one task per query tile): ``(out, lse)`` in the input dtype.

    Parameters
    ----------
    problem : elastic_np._contract._problem.AttentionProblem
    paged : tuple, optional
        ``(k_pages, v_pages, block_table)``: the keys and values are read
        from a paged cache, ``(num_blocks, block_size, Hkv, D)`` pools, in
        place (`elastic_np.cpu._tiles.pages`); ``problem``'s ``k`` and ``v``
        then give only the shapes, its ``kv_lengths`` the keys each batch
        entry's pages hold (their values are checked here, as `check_cache`
        checks a contiguous cache's).
    into : ndarray, optional
        A C-contiguous writeable ``(B, N, H, Dv)`` array of ``problem``'s
        dtype to write ``out`` into, where ``q`` is read in that layout
        (`elastic_np.cpu._tiles.operands.BNHD`; else a new array is returned).
    scale_pages : tuple, optional
        A paged quantized cache's per-token or per-group scales,
        ``(num_blocks, block_size, Hkv, D // G)`` for ``k`` and for ``v``
        (``problem``'s stand in for them). A quantized cache is read in
        place, a key tile's bytes dequantized into the thread's scratch
        (`elastic_np.cpu._tiles.pages.cache_tile`).

    Returns
    -------
    out : ndarray, shape (B, H, N, Dv)
        In the dtype and the layout of ``q`` (`elastic_np.cpu._tiles.operands`).
    lse : ndarray, shape (B, H, N)
        In the dtype of the computation (float32 for bfloat16 and float16).
    """
    dtype = problem.compute_dtype
    compile_for(dtype, _FORWARD_TILES)
    B, H, Hkv, N, M, D, Dv = problem.shape
    q = operand(problem.q)
    if paged is None:
        check_cache(problem)
        k, v, pages = operand(problem.k), operand(problem.v), NO_PAGES
    else:
        check_paged_cache(paged, problem)
        k, v = pool_operand(paged[0]), pool_operand(paged[1])
        pages = paged_pages(paged[2], paged[0].shape[1])
    out, out_operand = new((B, H, N, Dv), problem.dtype, q[1], storage=into if q[1] == BNHD else None)
    lse = np.empty((B, H, N), dtype=dtype)
    opt = kernel_options(problem, with_sigma_grad=False, dtype=dtype)
    variant = kernel_variant(problem, dtype)
    kernel = _forward_kernel if variant is None else _VARIANT_KERNEL
    run_tasks(kernel, q, k, v, pages, (opt, variant), _quant(problem, scale_pages), config.BLOCK_Q,
              config.BLOCK_K, out_operand, lse, tasks=task_counter(), work=B * H * N * M * (D + Dv))
    if variant is not None:
        check_variant_rows(lse)
    return out, lse


def check_variant_rows(lse):
    """A `ValueError` where a user's ``score_mod`` gave a NaN or ``+inf`` to an entry kept: its row's ``lse`` is NaN."""
    if np.isnan(lse).any():
        raise ValueError("`score_mod` returned NaN or +inf for an entry that is kept: every kept score must be "
                         "finite (return -inf to remove an entry)")


def _quant(problem, scale_pages):
    """The kernel's ``quant``: None for a float cache, else `cache_tile`'s ``quant`` of ``k`` and of ``v``."""
    if problem.quantized is None:
        return None
    factors = cache_scales(problem)
    fine = fine_operands(problem, scale_pages)
    return tuple((np.ascontiguousarray(factors[:, i]), fine[i]) for i in (0, 1))


# The typed tile functions each pass calls: a first call compiles only those (`compile_for`).
_FORWARD_TILES = (matmul_nn, matmul_nn_max, matmul_tn, exp_shift_sum, modify_tile)


@njit(nogil=True, cache=True, fastmath=FASTMATH)
def _forward_kernel(q, k, v, pages, options, quant, block_q, block_k, out, lse, tasks, part, parts):
    """Query tiles: ``out`` and ``lse``; ``options = (opt, variant)``, the plan's options and a user's functions
    (`kernel_variant`, or None); ``q``, ``k``, ``v`` and ``out`` are operands (`operand`), ``k`` and ``v``
    those of a paged cache's pools where ``pages`` is not `NO_PAGES` (`elastic_np.cpu._tiles.pages`), and
    those of a quantized cache with ``quant = (k's, v's)`` `cache_tile` scales (else None).

    A task is one query tile of one (batch, head); each thread takes the next
    unclaimed one from the call's counter ``tasks`` (`claim`).

    The kernel computes in ``lse``'s dtype; half storage is converted a key tile at a time
    (`elastic_np.cpu._tiles.halves`).
    """
    opt, variant = options
    B, H, N, D = shape(q)
    Hkv, Dv = shape(k)[1], shape(v)[3]
    group = H // Hkv
    n_qt = (N + block_q - 1) // block_q
    dtype = lse.dtype
    # scratch of the thread, reused by its tasks
    q_t = np.empty((D, block_q), dtype=dtype)  # scaled Q^T of the tile
    st = np.empty((block_k, block_q), dtype=dtype)
    acc = np.empty((block_q, Dv), dtype=dtype)
    row_max = np.empty(block_q, dtype=dtype)
    tile_max = np.empty(block_q, dtype=dtype)
    shift_by = np.empty(block_q, dtype=dtype)
    rescale_by = np.empty(block_q, dtype=dtype)
    tile_sum = np.empty(block_q, dtype=dtype)
    scratch = (tile_max, shift_by, rescale_by, tile_sum)  # of `online_update`
    row_sum = np.empty(block_q)
    k_half = scratch_for(k[0], block_k, D, dtype)  # (a quantized cache's rows dequantized there)
    v_half = scratch_for(v[0], block_k, Dv, dtype)
    k_quant, v_quant = key_quant(quant), value_quant(quant)
    # a paged tile over several pages is gathered into these (a half's into its scratch)
    k_gathered = k_half if k_half.shape[0] > 0 or pages[1] == 0 else np.empty((block_k, D), dtype=dtype)
    v_gathered = v_half if v_half.shape[0] > 0 or pages[1] == 0 else np.empty((block_k, Dv), dtype=dtype)
    no_cap_slope = np.empty((0, 0), dtype=dtype)  # the forward takes no tanh slopes
    n_tasks = B * H * n_qt
    for _ in range(n_tasks):
        task = claim(tasks)
        if task >= n_tasks:
            break
        b, h, hk, qt, i0, bq = query_tile(task, n_qt, H, group, block_q, N)

        load_queries(head_rows(q, b, h, i0, bq), query_factor(opt, h), q_t)
        acc[:] = 0.0
        row_max[:] = -np.inf
        row_sum[:] = 0.0

        # NVM tests s before log G is added: with a gate it stays in the
        # logits pass, otherwise it joins the row-max and shift passes.
        nvm_in_logits = opt.nvm and opt.has_gate
        nvm_in_max = opt.nvm and not opt.has_gate
        off_lo, off_hi = opt.band[b, h, 0], opt.band[b, h, 1]
        j_lo, j_hi = key_range(opt.diag_shift[b], i0, i0 + bq, off_lo, off_hi, opt.kv_lengths[b])
        for j0 in range(j_lo, j_hi, block_k):
            bk = min(block_k, j_hi - j0)
            if tile_state(variant, b, h, i0, bq, j0, bk) == EMPTY:
                continue
            for r in range(bq):
                tile_max[r] = -np.inf
            kept, maxed = logits_tile(
                st, cache_tile(k, pages, b, hk, j0, bk, D, k_half, k_gathered, k_quant), q_t, opt, (b, h, i0, bq, j0),
                nvm_in_logits, no_cap_slope, tile_max, nvm_in_max, variant,
            )
            if kept:
                v_j = cache_tile(v, pages, b, hk, j0, bk, Dv, v_half, v_gathered, v_quant)
                online_update(st, v_j, bk, bq, maxed, nvm_in_max, scratch, (row_max, row_sum, acc))
        log_beta = math.log(opt.beta[h]) if opt.beta[h] > 0 else -np.inf
        finish_rows(acc, row_max, row_sum, log_beta, head_rows(out, b, h, i0, bq), lse[b, h, i0 : i0 + bq])


#: `_forward_kernel` for the calls with a user's variant, compiled per function, never saved to Numba's cache.
_VARIANT_KERNEL = uncached(_forward_kernel)
