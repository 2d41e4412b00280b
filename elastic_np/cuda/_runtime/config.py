"""The tunables of the CUDA kernels: tile sizes, the tensor-core switches, decoding's split-KV, the shared-memory limit.

The block and tile sizes are read by the host functions at launch time (tile
sizes are runtime arguments and the shared memory is allocated dynamically),
so changing one needs no recompilation; tests set them small to force
multi-block grids with a partial last tile.

The register micro-tile sizes ``REG_M``, ``REG_N``, ``ACC_COLS`` (and the
decode kernel's ``DECODE_REG_N``, ``DECODE_ACC_COLS``) are
different: they size ``cuda.local.array`` s and the fully unrolled loops over
them, so they are compile-time constants of the kernels, frozen when a kernel
is compiled (changing one means a new compilation: a fresh process, and the
on-disk cache of the kernels cleared).

The host shrinks a tile (halving the larger of the query and key tiles, the
key tile on a tie) when the shared memory it needs for the given head dims and
dtype exceeds the limit (`elastic_np.cuda._runtime.gpu.shared_limit`: ``MAX_SHARED_BYTES``
when set, else the GPU's opt-in maximum), and raises `shared_memory_error` when
no tile is left to shrink.
"""

#: Forward micro-tile: query rows per thread (compile-time).
REG_M = 4
#: Forward micro-tile: keys per thread per key tile (compile-time).
REG_N = 4
#: Forward micro-tile: output columns per thread and pass over the keys
#: (compile-time); heads wider than ``ACC_COLS * FORWARD_BLOCK_K / REG_N``
#: output columns take several passes.
ACC_COLS = 8

#: Forward: query rows per block (the query tile), a multiple of ``REG_M``; the
#: block has ``(FORWARD_BLOCK_Q / REG_M) * (FORWARD_BLOCK_K / REG_N)`` threads.
FORWARD_BLOCK_Q = 64
#: Forward: keys per shared-memory K/V tile at most; ``FORWARD_BLOCK_K / REG_N``
#: (the threads sharing a query row, combined by warp shuffles) must be a power
#: of two of at most 32. The forward takes the fewest lanes a row whose
#: accumulators hold the value head in one pass (``Dv / ACC_COLS``), but at
#: least ``FORWARD_MIN_BLOCK_K / REG_N``: lanes beyond the head's columns would
#: only add registers and shared memory.
FORWARD_BLOCK_K = 64
#: Forward: keys per K/V tile at least (before the shared memory shrinks it).
FORWARD_MIN_BLOCK_K = 32

#: Forward on the tensor cores (`elastic_np.cuda._tensor_core.forward`, sm_80 and later): False
#: keeps every forward on the SIMT kernel above (as on GPUs before sm_80).
TENSOR_CORES = True
#: Whether a float32 forward at the default ``precision`` takes the tensor cores (as
#: 3xTF32). Off: the tensor cores' accumulation truncates, which takes the output past
#: the float32 rule, and the SIMT backward's recomputed scores would differ from the
#: forward's, which the gradients' rule does not survive; float64 (DMMA) and
#: ``precision="tf32"`` take the tensor cores.
TC_FLOAT32 = False
#: Tensor-core forward: warps per block at most (16 query rows each); halved until
#: the shared memory fits.
TC_FORWARD_WARPS = 8
#: Tensor-core forward: keys per K/V tile by itemsize (32 or 64; the kernels with every
#: option take 32), each a kernel of its own (`elastic_np.cuda._tensor_core.forward.KERNELS`).
#: float64 takes 32, with which its kernel keeps its fragments in registers.
TC_KEYS = {4: 64, 8: 32}
#: Tensor-core forward: copy 16 bytes at a time where the rows allow it (False: element by element).
TC_VECTOR_COPY = True
#: Backward on the tensor cores (`elastic_np.cuda._tensor_core.backward`) where the forward ran on them
#: without the general score pipeline, except ``precision="tf32"`` (whose backward keeps
#: float32): float64, and the float32 default with ``TC_FLOAT32``. Off until it is timed
#: on a GPU; the simulator runs it.
TC_BACKWARD = False
#: Tensor-core backward: warps per block at most (16 query rows, or keys, each); halved
#: until the shared memory fits.
TC_BACKWARD_WARPS = 4
#: Tensor-core backward: keys per K/V tile of the dq kernel and queries per Q/dO tile of the
#: dk/dv kernel, by (kernel, itemsize, head width 64 or 128), each a kernel of its own: the
#: fragments of a thread mostly stay in its registers (python -m elastic_np.cuda --resources).
TC_BACKWARD_TILES = {
    ("dq", 4, 64): 64, ("dq", 4, 128): 32, ("dq", 8, 64): 32, ("dq", 8, 128): 16,
    ("dkdv", 4, 64): 32, ("dkdv", 4, 128): 16, ("dkdv", 8, 64): 16, ("dkdv", 8, 128): 8,
}
#: Tensor-core dk/dv kernel (compile-time): the most words of fragments a thread keeps
#: (``dk``, ``dv``, ``S^T``, ``dP^T``: head width plus query tile, twice in float64) for one pass
#: over the query tiles; beyond it, two passes (``dv``, then ``dk``), which form ``S^T`` twice.
#: 96 words stay in the registers on sm_90 (``python -m elastic_np.cuda --resources``).
TC_BACKWARD_ONE_PASS = 96
#: Tensor-core forward: padding of the shared-memory rows, in elements (compile-time): a row
#: stride of 4 modulo 8 words puts a fragment's reads in distinct banks.
TC_PAD = 4

#: Backward ``dq`` kernel (`elastic_np.cuda._simt.backward`): query rows per block,
#: a multiple of ``REG_M``; the block has ``(DQ_BLOCK_Q / REG_M) * (DQ_BLOCK_K /
#: REG_N)`` threads, each with a ``REG_M x REG_N`` micro-tile.
DQ_BLOCK_Q = 64
#: Backward ``dq`` kernel: keys per shared-memory K/V tile, a multiple of ``REG_N``.
DQ_BLOCK_K = 32

#: Backward ``dk``/``dv`` kernel: keys per block (the key tile), a multiple of
#: ``REG_M``; the block has ``(DKDV_BLOCK_K / REG_M) * (DKDV_BLOCK_Q / REG_N)`` threads.
DKDV_BLOCK_K = 64
#: Backward ``dk``/``dv`` kernel: queries per shared-memory Q/dout tile, a multiple of ``REG_N``.
DKDV_BLOCK_Q = 32

#: Backward ``delta = dout . out - dlse`` kernel: threads per block, one query row each.
DELTA_THREADS = 128

#: Backward ``dbias`` kernel (broadcast biases only): at most this many threads
#: per block, one block per entry of the bias, each thread summing a fixed share
#: of the entries it stands for.
DBIAS_THREADS = 128

#: Decode kernel (`elastic_np.cuda._simt.decode`): `elastic_np.cuda.forward` takes it
#: for 1 to ``DECODE_MAX_QUERIES`` queries per sequence...
DECODE_MAX_QUERIES = 16
#: ... when the stacked rows (query heads of a GQA group x queries) are at most this many.
DECODE_MAX_ROWS = 128
#: Decode: threads per block at most (stacked rows per block x lanes per row).
DECODE_THREADS = 128
#: Decode: lanes sharing a stacked row at most (a power of two of at most 32).
DECODE_LANES = 32
#: Decode micro-tile: keys per lane per K/V tile (compile-time); a K/V tile
#: holds ``DECODE_REG_N`` keys per lane of a row.
DECODE_REG_N = 1
#: Decode micro-tile: output columns per lane and pass over the keys (compile-time).
DECODE_ACC_COLS = 8
#: Decode split-KV: the keys of each (batch, kv head, row chunk) are split
#: until the grid has about this many blocks...
DECODE_MIN_BLOCKS = 512
#: ... but no split gets fewer keys than this (the number of splits depends on
#: the shape and these constants only).
DECODE_MIN_SPLIT_KEYS = 128
#: Decode: dynamic shared memory per block at most (None: the GPU's limit, as the other kernels):
#: smaller blocks let more of them share an SM (docs/performance.rst, "The CUDA decode").
DECODE_MAX_SHARED_BYTES = 48 * 1024
#: Decode merge kernel: threads per block at most (one block per stacked row).
DECODE_MERGE_THREADS = 128

#: The option arrays on the device (`elastic_np.cuda._launch.options`): the last this many
#: distinct sets are kept, so a repeated call copies none of them again...
PLAN_CACHE_SIZE = 64
#: ... when they hold at most this many bytes in all (a large mask is copied per call).
PLAN_MAX_BYTES = 64 * 1024

#: Upper bound on dynamic shared memory per block; None: the GPU's opt-in maximum
#: (``MAX_SHARED_MEMORY_PER_BLOCK_OPTIN``, 227 KB on an H100; kernels launched with
#: more than ``DEFAULT_SHARED_BYTES`` are opted in), and ``DEFAULT_SHARED_BYTES``
#: under the simulator and where no GPU is usable (the compiled-code reports).
MAX_SHARED_BYTES = None
#: Dynamic shared memory per block that every launch may use without opting in.
DEFAULT_SHARED_BYTES = 48 * 1024


def shared_memory_error(D, Dv, limit):
    """The error for head dims ``D``, ``Dv`` whose smallest tiles still exceed ``limit`` bytes."""
    return ValueError(
        f"head dims D={D}, Dv={Dv} need more shared memory than the {limit} bytes a block may use "
        "(MAX_SHARED_BYTES, or the GPU's limit when it is None)"
    )
