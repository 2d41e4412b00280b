"""What the CUDA simulator lacks for these kernels: warp shuffles, and a block scheduler that yields while it waits.

The kernels combine the partial row max and row sum of the threads of a row
group with ``cuda.shfl_xor_sync``. The simulator (numba-cuda 0.30) runs each
thread of a block as a Python thread and offers ``syncthreads`` but no
shuffles; `install` adds ``shfl_xor_sync`` to its fake ``cuda`` module:
every thread posts its value in a table of its block, waits at a barrier,
reads its partner's value (lane ``lane ^ offset``, in the same warp) and
waits again before the table is reused. This is stronger than the hardware
(a block-wide barrier, not a warp's), so it is only right for kernels in
which every thread of the block reaches each shuffle, as ours do (their
control flow around the reductions is uniform). The lane mask is not
checked.
"""

import threading
import time

import numpy as np


def _shfl_xor_sync(self, mask, value, offset):
    thread = threading.current_thread()
    table = thread._manager.__dict__.setdefault("_elastic_np_shuffle", {})
    table[thread.thread_id] = value
    thread.syncthreads()
    partner = table[thread.thread_id ^ int(offset)]
    thread.syncthreads()
    return partner


def _run_block(self, grid_point, *args):
    """The simulator's ``BlockManager.run`` with a yielding wait.

    The same steps as numba-cuda 0.30's: start a thread per thread of the
    block, release them when all wait in ``syncthreads``, re-raise the first
    exception. Its loop polls without ever giving up the interpreter lock, so
    each thread woken from a barrier waits for the switch interval (5 ms);
    here the loop yields (``time.sleep(0)``) on every pass, so a woken thread
    runs at once: the barriers of the tensor-core products and the shuffles
    are where the simulated kernels spend their time.
    """
    from numba.cuda.simulator.kernel import BlockThread

    threads = []
    for block_point in np.ndindex(*self._block_dim):
        thread = BlockThread(lambda: self._f(*args), self, grid_point, block_point, self._debug)
        thread.start()
        threads.append(thread)
    live = set(threads)
    blocked = set()
    while live:
        time.sleep(0)
        for thread in live:
            if thread.syncthreads_blocked:
                blocked.add(thread)
            elif thread.exception:
                for other in threads:
                    other.abort = True
                    other.syncthreads_blocked = False
                    other.syncthreads_event.set()
                raise thread.exception[0].with_traceback(thread.exception[1])
        if live == blocked:
            for thread in blocked:
                thread.syncthreads_blocked = False
                thread.syncthreads_event.set()
            blocked = set()
        live = {thread for thread in live if thread.is_alive()}
    for thread in threads:
        if thread.exception:
            raise thread.exception[0].with_traceback(thread.exception[1])


def install():
    """Give the simulator's fake ``cuda`` module ``shfl_xor_sync`` and its blocks a yielding wait (idempotent)."""
    from numba.cuda.simulator import kernel, kernelapi

    if not hasattr(kernelapi.FakeCUDAModule, "shfl_xor_sync"):
        kernelapi.FakeCUDAModule.shfl_xor_sync = _shfl_xor_sync
    kernel.BlockManager.run = _run_block
