"""A call's attention variant: its ``score_mod``, ``mask_mod``, ``block_mask`` and ``captures``, checked.

`make_variant` checks what a call gives (None when it gives none of
them); `Variant.for_problem` checks it against the problem's shape. The
backends read it from the problem's ``variant`` field: the reference calls
the Python functions (`elastic_np.reference._variant`), the CPU kernels
their Numba compilations (`kernel_variant`).
"""

import collections
import dataclasses
from typing import Optional

from elastic_np._variants.block_mask import BlockMask
from elastic_np._variants.functions import checked_captures, compiled_mask, compiled_score, floating

#: What the CPU kernels read of a variant (`elastic_np.cpu._tiles.variant`): each entry None when absent.
#: ``batch`` is added to the kernels' batch index before the functions see it (a packed batch's sequence).
KernelVariant = collections.namedtuple("KernelVariant", "score mask captures blocks block_q block_k batch")


@dataclasses.dataclass(frozen=True, eq=False)
class Variant:
    """A call's user functions and their arrays.

    ``score_mod`` and ``mask_mod``: the user's functions or None (``mask_mod``
    is the block mask's when only ``block_mask`` is given); ``block_mask``:
    a `BlockMask` or None; ``captures``: the checked tuple of arrays both
    functions take after their indices; ``batch_offset``: what is added to a
    problem's batch index ``b`` before the functions see it (a packed batch's
    sequence, its problem's only batch entry).
    """

    score_mod: Optional[object]
    mask_mod: Optional[object]
    block_mask: Optional[BlockMask]
    captures: tuple
    batch_offset: int = 0

    @property
    def floating(self):
        """Whether each capture is floating (has a gradient)."""
        return floating(self.captures)

    def for_problem(self, B, H, N, M):
        """This variant, checked against a ``(B, H, N, M)`` problem (the block mask's shape)."""
        if self.block_mask is not None:
            self.block_mask.check_call(B, H, N, M, None, self.captures)
        return self

    def kernel_variant(self, dtype, with_score=True, replacements=None):
        """The `KernelVariant` of kernels computing in ``dtype`` (``with_score=False``: no ``score``), the
        functions compiled with ``replacements`` (`elastic_np._variants.functions.jitted`)."""
        score = None
        if with_score and self.score_mod is not None:
            score = compiled_score(self.score_mod, self.captures, dtype, replacements)
        mask = None if self.mask_mod is None else compiled_mask(self.mask_mod, self.captures, replacements)
        blocks, block_q, block_k = None, 0, 0
        if self.block_mask is not None:
            blocks = self.block_mask.states
            block_q, block_k = self.block_mask.block_size
        return KernelVariant(score, mask, self.captures, blocks, block_q, block_k, self.batch_offset)


def given(score_mod, mask_mod, block_mask, captures):
    """Whether a call gives any of a variant's arguments (``captures`` other than an empty tuple)."""
    return not (score_mod is None and mask_mod is None and block_mask is None
                and isinstance(captures, tuple) and not captures)


def make_variant(score_mod=None, mask_mod=None, block_mask=None, captures=()):
    """The `Variant` of a call's arguments, or None when it gives none of them; errors name the argument."""
    if not given(score_mod, mask_mod, block_mask, captures):
        return None
    captures = checked_captures(captures)
    if score_mod is None and mask_mod is None and block_mask is None:
        raise ValueError("`captures` are given without `score_mod`, `mask_mod` or `block_mask` to take them")
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"`{name}` must be a function, got {type(fn).__name__}")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"`block_mask` must be an elastic_np.BlockMask (from create_block_mask), got "
                            f"{type(block_mask).__name__}")
        block_mask.check_call(*block_mask.shape, mask_mod, captures)
        mask_mod = block_mask.mask_mod
    return Variant(score_mod, mask_mod, block_mask, captures)
