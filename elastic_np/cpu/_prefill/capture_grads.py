"""The gradients of a user's captures in the backward: a float64 sum per task, added in task order.

A ``score_mod`` reads its captures (a bias table, per-head slopes) at
indices it computes, so any task may add to any entry. Each task of the
backward's kernel adds into a slot of its own (`elastic_np.cpu._tiles.variant.score_gradient`);
after each chunk of key tiles the slots are added in task order. The
result has the same bits for every thread count and run.
"""

import collections

import numpy as np

from elastic_np._variants.derivative import differentiate
from elastic_np.cpu._tiles.vector_math import VJP_NAMES

#: What the backward's kernel takes (a named tuple: Numba calls a function in a plain tuple through a pointer).
Gradient = collections.namedtuple("Gradient", "vjp slots captures batch")

#: The most the slots may take; more is an error that says to pass the array as ``bias``.
SLOT_BYTES_MAX = 1 << 30


class CaptureGradients:
    """The slots of a backward's capture gradients, and their sums.

    Parameters
    ----------
    problem : elastic_np._contract._problem.AttentionProblem
    params : ndarray
        The `elastic_np.cpu._prefill.dbias.DbiasPlan`'s ``params``, which
        say how many tasks a key tile has.
    chunk : int
        Key tiles per kernel run.
    dtype : numpy.dtype
        The kernels' (float32: the derivative computes in float32, as they do).

    Attributes
    ----------
    gradient : Gradient or None
        What the kernel takes, ``(vjp, slots, captures, batch)``: the derivative's
        ``vjp`` (`elastic_np._variants.derivative`), per capture a float64
        ``(tasks, *shape)`` array of slots (``(tasks, 1)``, never written,
        for an integer or bool capture); None without a ``score_mod``.
    """

    def __init__(self, problem, params, chunk, dtype):
        variant = problem.variant
        self.gradient = None
        if variant is None or variant.score_mod is None:
            return
        B, H, Hkv = problem.shape[:3]
        fold_b, fold_h = params[1] != 0, params[2] != 0
        self.tasks_per_tile = (1 if fold_b else B) * (1 if fold_h else Hkv) * int(params[3])
        slots = self.tasks_per_tile * chunk
        floats = sum(c.size for c, f in zip(variant.captures, variant.floating) if f)
        if 8 * slots * floats > SLOT_BYTES_MAX:
            raise ValueError(f"the gradients of `captures` ({floats} floating entries) would take "
                             f"{8 * slots * floats / 2**30:.1f} GiB of per-task sums: pass a table as large as "
                             "the scores as `bias`, whose gradient the kernels write in place")
        self.captures = variant.captures
        self.slots = tuple(np.zeros((slots, *c.shape) if f else (slots, 1))
                           for c, f in zip(variant.captures, variant.floating))
        self.totals = [np.zeros(c.shape) if f else None for c, f in zip(variant.captures, variant.floating)]
        narrow = np.dtype(dtype) == np.float32
        vjp = differentiate(variant.score_mod, variant.captures, names=VJP_NAMES, narrow=narrow).vjp
        self.gradient = Gradient(vjp, self.slots, self.captures, variant.batch_offset)

    def after_chunk(self, n_chunk):
        """Add the slots of a run over ``n_chunk`` key tiles to the totals, in task order; clear them."""
        if self.gradient is None:
            return
        used = self.tasks_per_tile * n_chunk
        for slots, total in zip(self.slots, self.totals):
            if total is not None:
                for task in range(used):
                    total += slots[task]
                slots[:used] = 0.0

    def result(self):
        """The captures' gradients, each in its capture's dtype (None for an integer or bool one); None without a ``score_mod``."""
        if self.gradient is None:
            return None
        return tuple(None if t is None else t.astype(c.dtype) for t, c in zip(self.totals, self.captures))
