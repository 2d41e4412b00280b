"""A user's ``score_mod`` and ``mask_mod`` on a tile (`elastic_np._variants`), and the score's gradient.

The kernels take the variant as an argument of its own (`kernel_variant`: a
`elastic_np._variants.variant.KernelVariant` or None), apart from their
options, so that a new function recompiles only what reads it. Every function here
is chosen when the kernel compiles, by the variant's type: for None (every
call without a variant) each is a no-op or a constant, so those kernels
compile to the code they had; for a variant, a kernel is compiled for its
functions (once per process: Numba cannot cache code that calls a
function passed in).

- `tile_state`: whether a tile is empty (skipped), full or partial
  under the block mask;
- `score_stage`: ``s <- score_mod(s, b, h, i, j, *captures)`` on the tile's
  logits ``s / tau_h``, entries already removed (``-inf``) left alone;
- `mask_stage`: ``mask_mod`` on a partial tile's entries;
- `score_gradient`: the backward's ``dz`` taken through ``score_mod`` to its
  input, and the captures' gradients (the derivative's ``vjp``,
  `elastic_np._variants.derivative`).
"""

import numpy as np
from numba import jit, types
from numba.extending import overload

from elastic_np._variants.functions import scalar_of
from elastic_np.cpu._tiles.scalar import scalar_like
from elastic_np.cpu._tiles.vector_math import REPLACEMENTS

#: A tile's states under a block mask (`elastic_np._variants.block_mask`).
EMPTY, FULL, PARTIAL = 0, 1, 2


def kernel_variant(problem, dtype, with_score=True):
    """What the kernels computing in ``dtype`` take of ``problem``'s variant (None without one): its
    `KernelVariant`, the functions compiled with the tiles' vectorised ``exp`` and ``tanh`` (`REPLACEMENTS`);
    ``with_score=False``: without its ``score_mod`` (the backward's logits tiles, which it applies itself)."""
    if problem.variant is None:
        return None
    return problem.variant.kernel_variant(dtype, with_score=with_score, replacements=REPLACEMENTS)


def uncached(kernel):
    """``kernel``'s code, with its options (``fastmath``, ``nogil``), in a dispatcher that never saves to Numba's
    cache: the one a call with a user's variant runs. A signature holding a function cannot be loaded by another
    process, and its entry in the cache's index would outlive the function: saving the index again once the
    function is gone fails (``ReferenceError``), and every later compile of the kernel with it."""
    return jit(cache=False, **kernel.targetoptions)(kernel.py_func)


def _absent(value):
    """Whether a variant (or one of its fields) is absent: typed None."""
    return isinstance(value, (types.NoneType, types.Omitted)) or value is None


def changes_logits(variant):
    """Whether ``variant`` may change a tile's logits after the product (a constant when compiled)."""
    return variant is not None


@overload(changes_logits, jit_options={"fastmath": False})
def _changes_logits(variant):
    constant = not _absent(variant)
    return lambda variant: constant


def tile_state(variant, b, h, i0, bq, j0, bk):
    """`EMPTY`, `FULL` or `PARTIAL`: the tile ``[i0, i0 + bq) x [j0, j0 + bk)`` of ``(b, h)`` under ``variant``."""


@overload(tile_state, jit_options={"fastmath": False})
def _tile_state(variant, b, h, i0, bq, j0, bk):
    if _absent(variant) or (_absent(variant.types[1]) and _absent(variant.types[3])):
        return lambda variant, b, h, i0, bq, j0, bk: FULL
    if _absent(variant.types[3]):
        return lambda variant, b, h, i0, bq, j0, bk: PARTIAL
    return _block_state


def _block_state(variant, b, h, i0, bq, j0, bk):
    """The state of the tile from the block mask's blocks it overlaps: empty or full if all are."""
    blocks = variant.blocks
    if bq <= 0 or bk <= 0:
        return EMPTY
    bb = b if blocks.shape[0] > 1 else 0
    hh = h if blocks.shape[1] > 1 else 0
    all_empty, all_full = True, True
    for qb in range(i0 // variant.block_q, (i0 + bq - 1) // variant.block_q + 1):
        for kb in range(j0 // variant.block_k, (j0 + bk - 1) // variant.block_k + 1):
            state = blocks[bb, hh, qb, kb]
            all_empty = all_empty and state == EMPTY
            all_full = all_full and state == FULL
    return EMPTY if all_empty else (FULL if all_full else PARTIAL)


def narrow_spans(variant, b, hk, j0, bk, block_q, N, spans, share_rows, first_last):
    """The backward's query tiles of a key tile (`elastic_np.cpu._prefill.key_tiles.group_spans`'s ``spans``,
    ``share_rows`` and their union ``first_last``) with the tiles that the block mask makes `EMPTY` at either end
    of each head's span left out: their shares of ``dq`` are neither zeroed nor summed (``N`` queries). Returns
    the union."""


@overload(narrow_spans, jit_options={"fastmath": False})
def _narrow_spans(variant, b, hk, j0, bk, block_q, N, spans, share_rows, first_last):
    if _absent(variant) or _absent(variant.types[3]):
        return lambda variant, b, hk, j0, bk, block_q, N, spans, share_rows, first_last: first_last

    def narrow(variant, b, hk, j0, bk, block_q, N, spans, share_rows, first_last):
        group = spans.shape[0]
        it_first, it_last = N, 0  # (`group_spans`' empty union)
        for g in range(group):
            h = hk * group + g
            lo, hi = spans[g, 0], spans[g, 1]
            while lo < hi and _empty_query_tile(variant, b, h, lo, block_q, N, j0, bk):
                lo += 1
            while hi > lo and _empty_query_tile(variant, b, h, hi - 1, block_q, N, j0, bk):
                hi -= 1
            if lo == hi:
                lo, hi = 0, 0
            else:
                it_first, it_last = min(it_first, lo), max(it_last, hi)
            spans[g, 0], spans[g, 1] = lo, hi
            share_rows[b, h, 0], share_rows[b, h, 1] = lo * block_q, min(hi * block_q, N)
        return it_first, it_last

    return narrow


@jit(nopython=True, inline="always", fastmath=False)
def _empty_query_tile(variant, b, h, it, block_q, N, j0, bk):
    """Whether query tile ``it`` (of ``N`` queries) of head ``(b, h)`` is `EMPTY` against keys ``j0 .. j0 + bk - 1``."""
    i0 = it * block_q
    return tile_state(variant, b, h, i0, min(block_q, N - i0), j0, bk) == EMPTY


def score_stage(st, bk, bq, variant, tile, tau_h):
    """``st[c, r] = score_mod(st[c, r] tau_h, b, h, i0 + r, j0 + c, *captures) / tau_h`` where ``> -inf``.

    A NaN or ``+inf`` that the masks keep makes its row's sum NaN, which
    `elastic_np.cpu._tiles.online_softmax.finish_rows` gives ``lse`` and the
    forward reports (`elastic_np.cpu._prefill.forward.check_variant_rows`).
    """


@overload(score_stage, jit_options={"fastmath": False})
def _score_stage(st, bk, bq, variant, tile, tau_h):
    if _absent(variant) or _absent(variant.types[0]):
        return lambda st, bk, bq, variant, tile, tau_h: None

    def stage(st, bk, bq, variant, tile, tau_h):
        score, captures = variant.score, variant.captures
        b, h, i0, _, j0 = tile
        b = b + variant.batch
        unit = tau_h == 1.0  # (the common case: no product, no quotient)
        removed = scalar_like(-np.inf, st)
        # Key rows four at a time, as slices of length bq: four independent
        # chains of the function's arithmetic in flight, in SIMD registers
        # where it allows (`elastic_np.cpu._tiles.logits._softcap_tile`).
        bk4 = bk - bk % 4
        for c in range(0, bk4, 4):
            r0, r1, r2, r3 = st[c, :bq], st[c + 1, :bq], st[c + 2, :bq], st[c + 3, :bq]
            j = j0 + c
            for r in range(r0.shape[0]):
                i = i0 + r
                r0[r] = _scored(score, captures, r0[r], b, h, i, j, tau_h, unit, removed)
                r1[r] = _scored(score, captures, r1[r], b, h, i, j + 1, tau_h, unit, removed)
                r2[r] = _scored(score, captures, r2[r], b, h, i, j + 2, tau_h, unit, removed)
                r3[r] = _scored(score, captures, r3[r], b, h, i, j + 3, tau_h, unit, removed)
        for c in range(bk4, bk):
            row = st[c, :bq]
            for r in range(row.shape[0]):
                row[r] = _scored(score, captures, row[r], b, h, i0 + r, j0 + c, tau_h, unit, removed)

    return stage


@jit(nopython=True, inline="always", fastmath=False)
def _scored(score, captures, x, b, h, i, j, tau_h, unit, removed):
    """`score_stage`'s entry: ``score_mod(x tau_h, ...) / tau_h`` (``unit``: ``tau_h == 1``, neither), or
    ``removed`` (``-inf`` in the tile's dtype) where ``x`` is ``-inf``. Not ``x`` itself: storing ``x`` back
    makes the loop's store a masked one, which costs many cycles on some CPUs (AMD's)."""
    if unit:
        y = scalar_of(score(x, b, h, i, j, *captures))
    else:
        y = scalar_of(score(x * tau_h, b, h, i, j, *captures)) / tau_h
    return y if x != -np.inf else removed


def mask_stage(st, bk, bq, variant, tile, kept):
    """``mask_mod`` on a partial tile: ``-inf`` where False; returns whether an entry is kept (``kept``: before).

    With a block mask, a tile it calls partial holds a kept entry (its blocks
    were made from the same function), so the entries are not scanned: a
    tile found empty would only be skipped, and computing it gives the same
    result (a row with nothing kept stays at ``-inf``).
    """


@overload(mask_stage, jit_options={"fastmath": False})
def _mask_stage(st, bk, bq, variant, tile, kept):
    if _absent(variant) or _absent(variant.types[1]):
        return lambda st, bk, bq, variant, tile, kept: kept
    scan = _absent(variant.types[3])

    def stage(st, bk, bq, variant, tile, kept):
        b, h, i0, _, j0 = tile
        if not kept or tile_state(variant, b, h, i0, bq, j0, bk) != PARTIAL:
            return kept
        mask, captures = variant.mask, variant.captures
        seen_b = b + variant.batch
        any_kept = False
        for c in range(bk):
            row = st[c, :bq]  # branch-free over a slice: vectorised where the function allows
            j = j0 + c
            for r in range(row.shape[0]):
                row[r] = row[r] if scalar_of(mask(seen_b, h, i0 + r, j, *captures)) else -np.inf
            if scan:
                for r in range(row.shape[0]):
                    any_kept = any_kept or row[r] != -np.inf
        return any_kept or not scan

    return stage


def score_gradient(dpt, pre, bk, bq, gradient, tile, tau_h, slot):
    """``dz`` (in ``dpt``) taken to the input of ``score_mod``; the captures' gradients into their ``slot``.

    ``pre``: the tile's logits before `score_stage` (``s / tau_h``);
    ``gradient = (vjp, parts, captures)``, the derivative's ``vjp`` and
    per-slot float64 sums of the captures' gradients. With ``s' =
    score_mod(s)`` and ``z = s' / tau_h``: ``dL/ds' = dz / tau_h``, and the
    tile's next steps want ``dL/d(s / tau_h) = tau_h dL/ds``. An entry with
    ``dz = 0`` (removed, or ``p = 0``) gets 0 and gives the captures 0: the
    derivative never multiplies a zero adjoint through.
    """


@overload(score_gradient, jit_options={"fastmath": False})
def _score_gradient(dpt, pre, bk, bq, gradient, tile, tau_h, slot):
    if _absent(gradient):
        return lambda dpt, pre, bk, bq, gradient, tile, tau_h, slot: None

    def stage(dpt, pre, bk, bq, gradient, tile, tau_h, slot):
        vjp, captures = gradient.vjp, gradient.captures
        dcaptures = slot_views(gradient.slots, slot)
        b, h, i0, _, j0 = tile
        b = b + gradient.batch
        for c in range(bk):
            row, pre_row = dpt[c, :bq], pre[c, :bq]  # slices: the loops run vectorised where the vjp allows
            j = j0 + c
            if tau_h == 1.0:
                for r in range(row.shape[0]):
                    row[r] = vjp(pre_row[r], b, h, i0 + r, j, captures, row[r], dcaptures)
            else:
                for r in range(row.shape[0]):
                    row[r] = vjp(pre_row[r] * tau_h, b, h, i0 + r, j, captures, row[r] / tau_h, dcaptures) * tau_h

    return stage


def slot_views(parts, slot):
    """``(parts[0][slot], parts[1][slot], ...)``: one slot of each capture's gradient sums."""


@overload(slot_views, jit_options={"fastmath": False})
def _slot_views(parts, slot):
    items = "".join(f"parts[{i}][slot], " for i in range(len(parts.types)))
    namespace = {}
    exec(f"def views(parts, slot):\n    return ({items})\n", namespace)
    return namespace["views"]


def saved_score_stage(st, pre, bk, bq, variant, tile, tau_h):
    """`score_stage`, the tile's logits before it kept in ``pre`` (the backward's, for `score_gradient`)."""


@overload(saved_score_stage, jit_options={"fastmath": False})
def _saved_score_stage(st, pre, bk, bq, variant, tile, tau_h):
    if _absent(variant) or _absent(variant.types[0]):
        return lambda st, pre, bk, bq, variant, tile, tau_h: None

    def stage(st, pre, bk, bq, variant, tile, tau_h):
        for c in range(bk):
            for r in range(bq):
                pre[c, r] = st[c, r]
        score_stage(st, bk, bq, variant, tile, tau_h)

    return stage
