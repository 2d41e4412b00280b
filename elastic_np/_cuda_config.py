"""Tunables of the numba.cuda kernels in `elastic_np.cuda`.

The block and tile sizes are read by the host functions at launch time (tile
sizes are runtime arguments and the shared memory is allocated dynamically),
so changing one needs no recompilation; tests set them small to force
multi-block grids with a partial last tile.

The register micro-tile sizes ``REG_M``, ``REG_N``, ``ACC_COLS`` are
different: they size ``cuda.local.array`` s and the fully unrolled loops over
them, so they are compile-time constants of the kernels, frozen when a kernel
is compiled (changing one means a new compilation: a fresh process, and the
on-disk cache of the kernels cleared).

The host shrinks a tile (halving the larger of the query and key tiles, the
key tile on a tie) when the shared memory it needs for the given head dims and
dtype exceeds ``MAX_SHARED_BYTES``.
"""

#: Forward micro-tile: query rows per thread (compile-time).
REG_M = 4
#: Forward micro-tile: keys per thread per key tile (compile-time).
REG_N = 4
#: Forward micro-tile: output columns per thread and pass over the keys
#: (compile-time); heads wider than ``ACC_COLS * FORWARD_BLOCK_N / REG_N``
#: output columns take several passes.
ACC_COLS = 8

#: Forward: query rows per block (the query tile), a multiple of ``REG_M``; the
#: block has ``(FORWARD_BLOCK_M / REG_M) * (FORWARD_BLOCK_N / REG_N)`` threads.
FORWARD_BLOCK_M = 64
#: Forward: keys per shared-memory K/V tile; ``FORWARD_BLOCK_N / REG_N`` (the
#: threads sharing a query row, combined by warp shuffles) must be a power of
#: two of at most 32.
FORWARD_BLOCK_N = 64

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
