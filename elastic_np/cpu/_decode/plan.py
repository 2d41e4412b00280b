"""The decode kernels' schedule: which kernel, its tiles and key splits, from the problem's shape and options.

Everything here depends on the shapes, the dtype and the option values
alone, so `schedule` keeps its result per ``plan_key``
(`elastic_np._contract._problem.AttentionProblem`): every layer of a model's step
repeats one.
"""

import collections

import numpy as np

from elastic_np._contract._problem import Kept
from elastic_np.cpu._decode.tiles import _together
from elastic_np.cpu._prefill.plan import kernel_options
from elastic_np.cpu._runtime import config
from elastic_np.cpu._tiles.operands import BNHD


def takes(problem):
    """True when the decode kernel computes this problem's forward."""
    B, H, Hkv, N, M, D, Dv = problem.shape
    return takes_rows(N, (H // Hkv) * N)


def takes_rows(N, rows):
    """`takes` for ``N`` queries, ``rows`` of them stacked a kv head."""
    return 1 <= N <= config.DECODE_MAX_QUERIES and rows <= config.DECODE_MAX_ROWS


def block_keys(rows, key_major):
    """Keys per tile for ``rows`` stacked rows: 128 suit a few rows, 256 many (docs/performance.rst)."""
    if key_major:
        return config.DECODE_BLOCK_K
    return max(1, config.DECODE_BLOCK_K // 2) if rows <= config.DECODE_FEW_ROWS else config.DECODE_BLOCK_K


def tile_reads(together, half, block_size, block_k):
    """``(ahead, by_run, run_keys)``: how the stacked-rows kernel's tasks read their tiles (`_visit`).

    ``together``: a task takes every kv head (`_tile_of_heads`); ``half``:
    the cache holds bfloat16 or float16; ``block_size``: keys a page (0:
    not paged). A task over every kv head of a half cache reads its tiles
    ``by_run``, run after run of at most `DECODE_RUN_KEYS` keys (within a
    page), every head's rows of a run in turn, each head hinting its own
    rows `DECODE_RUN_HINT_KEYS` on; any other task reads them head by
    head, whole pages at a time, hinting `DECODE_HINT_KEYS` on: the first
    order is the faster for halves, the second for float32 and float64
    (docs/performance.rst, "Paged caches"). ``ahead`` is rounded up to a
    whole number of runs, or of pages.
    """
    by_run = together and half
    run_keys = config.DECODE_RUN_KEYS if by_run else block_k
    if block_size > 0:
        run_keys = min(run_keys, block_size)
    keys = config.DECODE_RUN_HINT_KEYS if by_run else config.DECODE_HINT_KEYS
    unit = run_keys if by_run else max(block_size, 1)
    return -(-keys // unit) * unit, by_run, run_keys


def splits(B, Hkv, M):
    """Key splits per (batch, kv head): from the shape alone, never the thread count."""
    if B * Hkv == 0 or B * Hkv >= config.DECODE_MIN_TASKS:
        return 1
    wanted = -(-config.DECODE_MIN_TASKS // (B * Hkv))
    return max(1, min(wanted, M // config.DECODE_MIN_SPLIT_KEYS))


#: What `elastic_np.cpu._decode.decode.forward` runs for a problem, from its fields and layout alone (`schedule`).
_Plan = collections.namedtuple("_Plan", ["key_major", "opt", "together", "split_start", "most", "tiles", "work"])
#: The `_Plan` of the latest problems with a ``plan_key``: every layer of a model's step repeats one.
_PLANS = Kept(64)


def schedule(problem, k_layout, block_size, entry_splits):
    """The `_Plan` of ``problem`` with keys stored in ``k_layout`` (`BNHD` or not), pages of ``block_size``
    keys (None: no pages) and ``entry_splits``; looked up when neither varies beyond the problem's key."""
    key = None
    if problem.plan_key is not None and entry_splits is None:
        key = (problem.plan_key, problem.dtype, k_layout, block_size, config.GENERATION)
    return _PLANS.get_or_make(key, lambda: _made(problem, k_layout, block_size, entry_splits))


def _made(problem, k_layout, block_size, entry_splits):
    """`schedule`'s `_Plan`, made."""
    B, H, Hkv, N, M, D, Dv = problem.shape
    key_major = N >= config.DECODE_KEY_MAJOR_QUERIES and problem.quantized is None  # bytes: the stacked rows
    opt = kernel_options(problem, with_sigma_grad=False, dtype=problem.compute_dtype)
    together = not key_major and k_layout == BNHD and _together(opt)
    block_k = block_keys((H // Hkv) * N, key_major)
    if entry_splits is None:  # every entry the same count: one NumPy call, not three (every new shape makes one)
        most = splits(B, Hkv, M)
        split_start = np.arange(0, (B + 1) * most, most, dtype=np.int64)
    else:
        split_start = np.concatenate(([0], np.cumsum(entry_splits))).astype(np.int64)  # entry b's splits start here
        most = int(np.max(entry_splits, initial=1))
    tiles = block_k if key_major else (
        block_k, *tile_reads(together, problem.dtype.itemsize == 2, block_size or 0, block_k))
    return _Plan(key_major, opt, together, split_start, max(most, 1), tiles,
                 H * N * int(problem.kv_lengths.sum()) * (D + Dv))

