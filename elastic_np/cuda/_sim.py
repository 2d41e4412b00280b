"""Warp shuffles for the CUDA simulator, which has none (numba-cuda 0.30).

The kernels combine the partial row max and row sum of the threads of a row
group with ``cuda.shfl_xor_sync``. The simulator runs each thread of a block
as a Python thread and offers ``syncthreads`` but no shuffles; `install` adds
``shfl_xor_sync`` to its fake ``cuda`` module: every thread posts its value
in a table of its block, waits at a barrier, reads its partner's value
(lane ``lane ^ offset``, in the same warp) and waits again before the table
is reused. This is stronger than the hardware (a block-wide barrier, not a
warp's), so it is only right for kernels in which every thread of the block
reaches each shuffle, as ours do (their control flow around the reductions
is uniform). The lane mask is not checked.
"""

import threading


def _shfl_xor_sync(self, mask, value, offset):
    thread = threading.current_thread()
    table = thread._manager.__dict__.setdefault("_elastic_np_shuffle", {})
    table[thread.thread_id] = value
    thread.syncthreads()
    partner = table[thread.thread_id ^ int(offset)]
    thread.syncthreads()
    return partner


def install():
    """Give the simulator's fake ``cuda`` module ``shfl_xor_sync`` (idempotent; a no-op if it has one)."""
    from numba.cuda.simulator import kernelapi

    if not hasattr(kernelapi.FakeCUDAModule, "shfl_xor_sync"):
        kernelapi.FakeCUDAModule.shfl_xor_sync = _shfl_xor_sync
