"""Block masks: a ``mask_mod`` evaluated once per block of (query, key) entries, as FlexAttention's ``BlockMask``.

`create_block_mask` evaluates ``mask_mod`` on every entry of a ``(B, H, N,
M)`` problem and records each block of ``block_size`` queries by
``block_size`` keys as empty (nothing kept: the kernels skip it), full
(everything kept: no mask evaluated) or partial (the kernels evaluate
``mask_mod`` entry by entry). One block mask serves every call and layer
with the same shape, ``mask_mod`` and captures.
"""

import numpy as np
from numba import njit

from elastic_np._variants.functions import checked_captures, compiled_mask, scalar_of

#: The states of a block.
EMPTY, FULL, PARTIAL = 0, 1, 2


class BlockMask:
    """Which blocks of a ``(B, H, N, M)`` problem ``mask_mod`` leaves empty, full or partial.

    Made by `create_block_mask`; pass it to `elastic_np.attention` (and
    `elastic_np.attention_backward`) as ``block_mask`` with the same
    ``captures``.

    Attributes
    ----------
    states : ndarray of int8, shape (B or 1, H or 1, ceil(N / bq), ceil(M / bk))
        `EMPTY` (0), `FULL` (1) or `PARTIAL` (2) per block; read-only. An
        axis of length 1 holds for every batch entry (head).
    block_size : (int, int)
        Queries and keys per block, ``(bq, bk)``.
    shape : (int, int, int, int)
        ``(B, H, N, M)`` it was made for (1 where broadcast).
    mask_mod : callable
        The function it was made from.
    captures : tuple of ndarray
        The arrays ``mask_mod`` was evaluated with.
    """

    def __init__(self, states, block_size, shape, mask_mod, captures):
        states.setflags(write=False)
        self.states = states
        self.block_size = block_size
        self.shape = shape
        self.mask_mod = mask_mod
        self.captures = captures

    @property
    def sparsity(self):
        """The fraction of blocks that are empty (skipped by the kernels)."""
        return float(np.mean(self.states == EMPTY)) if self.states.size else 0.0

    def __repr__(self):
        counts = [int(np.sum(self.states == state)) for state in (EMPTY, FULL, PARTIAL)]
        return (f"BlockMask(shape={self.shape}, block_size={self.block_size}, empty={counts[0]}, "
                f"full={counts[1]}, partial={counts[2]}, mask_mod={getattr(self.mask_mod, '__name__', '?')})")

    def for_sequences(self, S, H, N, M):
        """Raise a `ValueError` naming ``block_mask`` unless it covers a packed batch of ``S`` sequences of at most
        ``N`` queries over ``M`` keys (made for ``(S or 1, H or 1, N or more, M or more)``: ``b`` the sequence)."""
        Bm, Hm, Nm, Mm = self.shape
        if Nm < N or Mm < M or Bm not in (1, S) or Hm not in (1, H):
            raise ValueError(f"`block_mask` was made for (B, H, N, M) = {self.shape}; a packed batch of {S} "
                             f"sequences with {H} heads, at most {N} queries and {M} keys each, takes one made for "
                             f"({S} or 1, {H} or 1, {N} or more, {M} or more)")

    def sequence(self, s, N, M):
        """The blocks of sequence ``s`` of a packed batch (`for_sequences`), ``N`` queries over ``M`` keys, as a
        block mask of its own: a block is empty or full for the sequence where it is for the whole block."""
        bq, bk = self.block_size
        states = self.states[s if self.states.shape[0] > 1 else 0, :, : -(-N // bq), : -(-M // bk)]
        return BlockMask(np.ascontiguousarray(states[None]), self.block_size, (1, self.shape[1], N, M),
                         self.mask_mod, self.captures)

    def check_call(self, B, H, N, M, mask_mod, captures):
        """Raise a `ValueError` naming ``block_mask`` unless it was made for this call's shape, ``mask_mod`` and
        number of captures (their values are not compared: a block mask holds what ``mask_mod`` kept when it
        was made, and a call that passes other values to a ``mask_mod`` that reads them gets that mask's blocks)."""
        Bm, Hm, Nm, Mm = self.shape
        if Nm != N or Mm != M or Bm not in (1, B) or Hm not in (1, H):
            raise ValueError(f"`block_mask` was made for (B, H, N, M) = {self.shape}; this call has "
                             f"{(B, H, N, M)} (its B and H may be 1, broadcast)")
        if mask_mod is not None and mask_mod is not self.mask_mod:
            raise ValueError("`mask_mod` is not the function `block_mask` was made from: pass one of them, "
                             "or the same function to both")
        if len(captures) != len(self.captures):
            raise ValueError(f"`block_mask` was made with {len(self.captures)} `captures` and this call passes "
                             f"{len(captures)}: `mask_mod` takes the call's captures")


def create_block_mask(mask_mod, B, H, N, M, *, captures=(), block_size=128):
    """Evaluate ``mask_mod`` on a ``(B, H, N, M)`` problem, block by block: a reusable `BlockMask`.

    Parameters
    ----------
    mask_mod : callable
        ``mask_mod(b, h, q_idx, kv_idx, *captures) -> bool``, True where
        query ``q_idx`` of head ``h`` of batch entry ``b`` may attend to key
        ``kv_idx``; plain Python that Numba compiles (``math``, NumPy
        scalars, indexing into ``captures``).
    B, H : int or None
        Batch entries and heads; None when the mask is the same for all
        (evaluated once, for ``b = 0`` or ``h = 0``).
    N, M : int
        Queries and keys.
    captures : tuple of ndarray, optional
        The arrays passed to ``mask_mod`` after the indices; the calls that
        take the block mask pass as many, to ``mask_mod`` and ``score_mod``
        alike (the values it reads should be the same: the blocks are not
        evaluated again).
    block_size : int or (int, int), optional
        Queries and keys per block (default 128, the kernels' tile).

    Returns
    -------
    BlockMask

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> def causal(b, h, q_idx, kv_idx):
    ...     return q_idx >= kv_idx
    >>> block_mask = enp.create_block_mask(causal, None, None, 256, 256)
    >>> block_mask.states[0, 0]
    array([[2, 0],
           [1, 2]], dtype=int8)
    """
    captures = checked_captures(captures)
    B, H = (1 if n is None else _size(n, name) for n, name in ((B, "B"), (H, "H")))
    N, M = _size(N, "N"), _size(M, "M")
    bq, bk = _block_size(block_size)
    mask_fn = compiled_mask(mask_mod, captures)
    states = np.empty((B, H, -(-N // bq), -(-M // bk)), dtype=np.int8)
    _classify(mask_fn, captures, N, M, bq, bk, states)
    return BlockMask(states, (bq, bk), (B, H, N, M), mask_mod, captures)


def _size(n, name):
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"`{name}` must be an integer >= 0, got {n!r}")
    return int(n)


def _block_size(block_size):
    sizes = (block_size, block_size) if isinstance(block_size, (int, np.integer)) else tuple(block_size)
    if len(sizes) != 2 or not all(isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_))
                                  and s >= 1 for s in sizes):
        raise ValueError(f"`block_size` must be an integer >= 1 or a pair of them, got {block_size!r}")
    return int(sizes[0]), int(sizes[1])


@njit(nogil=True, fastmath=False)
def _classify(mask_fn, captures, N, M, bq, bk, states):
    """``states[b, h, qb, kb]``: `EMPTY`, `FULL` or `PARTIAL` from ``mask_fn`` on the block's entries."""
    B, H, n_qb, n_kb = states.shape
    for b in range(B):
        for h in range(H):
            for qb in range(n_qb):
                for kb in range(n_kb):
                    kept = 0
                    for i in range(qb * bq, min(qb * bq + bq, N)):
                        for j in range(kb * bk, min(kb * bk + bk, M)):
                            if scalar_of(mask_fn(b, h, i, j, *captures)):
                                kept += 1
                    size = (min(qb * bq + bq, N) - qb * bq) * (min(kb * bk + bk, M) - kb * bk)
                    states[b, h, qb, kb] = EMPTY if kept == 0 else (FULL if kept == size else PARTIAL)
