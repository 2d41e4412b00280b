"""Tunables of the numba.cuda kernels in `elastic_np.cuda`.

Every value here is read by the host functions at launch time (tile sizes are
runtime arguments and the shared memory is allocated dynamically), so changing
one needs no recompilation; tests set them small to force multi-block grids.

The host shrinks a tile (halving the key tile first, then the query tile) when
the shared memory it needs for the given head dims and dtype exceeds
``MAX_SHARED_BYTES``.
"""

#: Forward: threads per block, one query row each (the query tile).
FORWARD_BLOCK_M = 64
#: Forward: keys per shared-memory K/V tile.
FORWARD_BLOCK_N = 16

#: Backward ``dq`` kernel: threads per block, one query row each.
DQ_BLOCK_M = 32
#: Backward ``dq`` kernel: keys per shared-memory K/V tile.
DQ_BLOCK_N = 16

#: Backward ``dk``/``dv`` kernel: threads per block, one key each (the key tile).
DKDV_BLOCK_N = 32
#: Backward ``dk``/``dv`` kernel: queries per shared-memory Q/dout tile.
DKDV_BLOCK_M = 16

#: Backward ``dbias`` kernel (broadcast biases only): at most this many threads
#: per block, one block per entry of the bias, each thread summing a fixed share
#: of the entries it stands for.
DBIAS_THREADS = 128

#: Upper bound on dynamic shared memory per block (the default limit without opt-in).
MAX_SHARED_BYTES = 48 * 1024
