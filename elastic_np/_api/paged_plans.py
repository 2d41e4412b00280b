"""Plans of a paged cache's decoding step: `elastic_np.varlen_attention` with ``block_table``, repeated.

A serving engine's step calls every layer with the same batch layout: the
same ``cu_seqlens_q``, ``block_table`` and ``seqused_k``, pools of the same
shapes, the same options. The first call of a layout checks all of it
(every page in range, distinct, the lengths within their pages); its plan
(`keep`) keeps the problem, the decode schedule and the table, and a later
call of the layout, looked up by the arrays' shapes, strides and dtypes and
the index arrays' bytes (`key`), checks only ``q`` for NaN and inf (the
kernel checks the pages it reads, as it does on every call) and runs the
kernel. A call whose pools are not C-contiguous, whose index arrays are not
NumPy integer arrays of at most `KEYED_SIZE` entries, or whose options are
not Python scalars is checked in full every time.
"""

import numpy as np

from elastic_np._api import plans
from elastic_np._contract import _validation
from elastic_np._contract._problem import Kept

#: The most entries of an index array a call is looked up by (its bytes enter the key).
KEYED_SIZE = 1 << 14

#: The latest plans, by `key`: ``run(q, k, v) -> (out, lse)``.
PLANS = Kept(64)


def key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, block_table, seqused_k, return_lse, backend, options):
    """The key a paged call is looked up by, or None where it is not (``options`` complete)."""
    if cu_seqlens_k is not None or type(return_lse) is not bool or not _pools(q, k, v):
        return None
    index = _index((cu_seqlens_q, block_table, seqused_k))
    if index is None or not all(m is None or type(m) is int for m in (max_q, max_k)):
        return None
    values = tuple(options[name] for name in plans.KEYED[:-2]) + (return_lse, backend)
    floats = tuple(options[name] for name in plans.FLOATS)
    keyed = plans.options_key(values, floats, options["window_size"])
    if keyed is None:
        return None
    return "paged", plans.with_arrays(q, k, v, keyed), index, max_q, max_k


def _pools(q, k, v):
    """Whether ``q`` and the pools are NumPy arrays, the pools C-contiguous."""
    arrays = type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray
    return arrays and k.flags.c_contiguous and v.flags.c_contiguous


def _index(arrays):
    """``(dtype, shape, bytes)`` of each index array, or None unless all are small NumPy integer arrays."""
    index = []
    for a in arrays:
        if type(a) is not np.ndarray or a.dtype.kind not in "iu" or a.size > KEYED_SIZE:
            return None
        index.append((a.dtype, a.shape, a.tobytes()))
    return tuple(index)


def keep(call_key, run):
    """Keep ``run`` (`elastic_np._api.paged.batch`'s) for calls of ``call_key``."""
    if call_key is not None and run is not None:
        PLANS.get_or_make(call_key, lambda: run)


def run(planned, q, k, v, return_lse):
    """A looked-up call: ``q`` checked as a call in full checks it, then the plan's kernel."""
    _validation.check_finite(q, "q")
    out, lse = planned(q, k, v)
    return (out, lse) if return_lse else out
