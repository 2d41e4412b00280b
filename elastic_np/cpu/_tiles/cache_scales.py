"""A quantized cache's scales as the CPU kernels take them (host code).

The kernels read the bytes of an int8 or float8 cache
(`elastic_np.cpu._tiles.quantized`), widened to float32 times `UNIT`; the
scales reach them as `cache_scales`' per-head factors (that unit folded
in) and, for per-token or per-group scales, as `fine_operands`, operands
shaped like the cache's with ``D // G`` entries a row
(`elastic_np._contract._quantized.fine_scale`).
"""

import numpy as np

from elastic_np._contract._quantized import is_fine
from elastic_np.cpu._tiles.operands import operand
from elastic_np.cpu._tiles.pages import pool_operand
from elastic_np.cpu._tiles.quantized import UNIT


def cache_scales(problem):
    """The ``(Hkv, 2)`` factors of the keys and values read, in the compute dtype.

    A quantized cache's ``(k_scale, v_scale)`` over the `UNIT` its bytes widen
    to (`elastic_np.cpu._tiles.quantized`); ones for a float cache (per-token
    and per-group scales are `fine_operands`; here only the unit). The decode
    kernel multiplies its scaled queries by the key factor
    (`elastic_np.cpu._decode.decode._start_rows`) and a split's sums by the
    value factor (`elastic_np.cpu._decode.merge.store_split`): the cache
    is never dequantized; the prefill kernel dequantizes a tile with them
    (`elastic_np.cpu._tiles.pages.cache_tile`).
    """
    Hkv = problem.k.shape[1]
    if problem.quantized is None:
        return np.ones((Hkv, 2), dtype=problem.compute_dtype)
    unit = UNIT[problem.quantized]
    k_scale, v_scale = (np.ones(Hkv) if is_fine(s) else s for s in (problem.k_scale, problem.v_scale))
    scales = np.stack([k_scale / unit, v_scale / unit], axis=1).astype(problem.compute_dtype)
    if not (np.isfinite(scales).all() and (scales >= np.finfo(scales.dtype).tiny).all()):
        raise ValueError(f"`k_scale` and `v_scale` over {unit} (the {problem.quantized} bytes' unit) must be "
                         f"normal {scales.dtype} numbers, got {problem.k_scale} and {problem.v_scale}")
    return scales


#: `fine_operands` of a cache with per-head scales: operands of no scale a row (``D // G`` = 0), which the kernels
#: read as "per head" where they run. Not None: a quantized cache's kernels then compile once for per-head, per-token
#: and per-group scales (of float32), not once for the first and again for the others.
NO_FINE = (operand(np.empty((0, 0, 0, 0), dtype=np.float32)),) * 2


def fine_operands(problem, scale_pages=None):
    """The kernel's ``fine``: None for a float cache; for a quantized one, the operands of its per-token or
    per-group scales (those of ``scale_pages`` for a paged cache, `elastic_np.cpu._decode.decode.forward`'s), or
    `NO_FINE` for per-head scales."""
    if problem.quantized is None:
        return None
    if not is_fine(problem.k_scale):
        return NO_FINE
    if scale_pages is not None:
        return tuple(pool_operand(pool) for pool in scale_pages)
    return operand(problem.k_scale), operand(problem.v_scale)

