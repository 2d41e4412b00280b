"""Every kernel choice of the CUDA backend: which kernels run a problem, and with which tiles.

In the manner of FlashAttention 3's ``heuristics.h``: short functions of the
shape, the dtype, the options that decide a kernel, the config
(`elastic_np.cuda._runtime.config`), the GPU's compute capability and its
shared-memory limit (`elastic_np.cuda._runtime.gpu.shared_limit`), never of
timings, so a problem always takes the same kernels and gives the same bits.
The launches (`elastic_np.cuda._launch.forward`, ``decode``, ``backward``)
do what these say; the shared memory they weigh is each kernel's layout
(`elastic_np.cuda._launch.layouts`).

- Forward: the decode kernels for 1 to ``DECODE_MAX_QUERIES`` queries and at
  most ``DECODE_MAX_ROWS`` stacked rows (`takes_decode`; `decode_geometry`,
  `decode_splits`); else the tensor cores where `tensor_core_forward` finds
  tiles (float64 or ``precision="tf32"``, sm_80 on); else the SIMT flash
  forward (`forward_tiles`).
- Backward: the tensor cores where `tensor_core_backward` finds tiles (with
  ``TC_BACKWARD``), else the SIMT kernels (`backward_tiles`).

Worked example, on an H100 (227 KB of shared memory a block), the shipped
config, ``B=2, H=8, Hkv=2, D=Dv=64``, no option but ``causal``:

- ``N=M=1024`` in float32: not decoding (``N > 16``); the float32 default
  stays off the tensor cores (``TC_FLOAT32`` False), so the SIMT forward:
  key tiles of 32 (8 lanes a row hold the 64 value columns, ``ACC_COLS=8``),
  64 query rows a block, 128 threads, 39,552 bytes; 256 blocks. Its
  backward: ``dq`` blocks of 64 queries by 32 keys (75,520 bytes),
  ``dk``/``dv`` blocks of 64 keys by 32 queries (67,072 bytes), 128 threads
  each.
- The same in float64: the tensor cores, kernel ``(32, 64, False)`` (key
  tiles of ``TC_KEYS[8] = 32``, 64 value columns a pass, the simple score
  pipeline), 8 warps (128 query rows) a block, 172,032 bytes; 128 blocks of
  256 threads; 16-byte copies when the rows are aligned. The backward stays
  SIMT (``TC_BACKWARD`` False).
- A decoding step, ``N=1``, ``M=1024``, float32: 4 stacked rows (the 4
  query heads of a kv head) in one block a (batch, kv head), 8 lanes a row
  to hold the 64 value columns, doubled to 32 while ``DECODE_THREADS=128``
  allows (key tiles of 32), 34,592 bytes; those 4 blocks are fewer than
  ``DECODE_MIN_BLOCKS``, so the keys split 8 ways (no split under
  ``DECODE_MIN_SPLIT_KEYS = 128`` keys): 32 blocks of 128 threads, then the
  merge.
"""

from elastic_np.cuda._launch import layouts
from elastic_np.cuda._runtime import config
from elastic_np.cuda._runtime.gpu import compute_capability, pow2_at_least, shared_limit, simulator


def takes_decode(p):
    """True when `elastic_np.cuda.forward` runs problem ``p`` through the decode kernels."""
    B, H, Hkv, N, M, D, Dv = p.shape
    return 1 <= N <= config.DECODE_MAX_QUERIES and (H // Hkv) * N <= config.DECODE_MAX_ROWS


def decode_geometry(rows, D, Dv, itemsize):
    """``(rows_blk, tpr)`` of the decode kernel: stacked rows per block and lanes per row.

    ``tpr`` starts as the fewest lanes whose accumulators hold the value head
    in one pass (at most ``DECODE_LANES``), the block takes as many rows as
    ``DECODE_THREADS`` allows, and spare threads go to more lanes per row
    (longer K/V tiles). Then, while the shared memory exceeds the limit (at
    most ``DECODE_MAX_SHARED_BYTES``), the larger of the K/V tiles and the
    query tile is halved.
    """
    lanes, threads = config.DECODE_LANES, config.DECODE_THREADS
    if lanes < 1 or lanes > 32 or lanes & (lanes - 1):
        raise ValueError(f"DECODE_LANES={lanes} must be a power of two of at most 32")
    if threads < 1:
        raise ValueError(f"DECODE_THREADS={threads} must be at least 1")
    tpr = min(lanes, pow2_at_least(-(-max(Dv, 1) // config.DECODE_ACC_COLS)))
    tpr = min(tpr, pow2_at_least(threads + 1) // 2)  # the largest power of two <= threads
    chunks = -(-rows // max(1, threads // tpr))
    rows_blk = -(-rows // chunks)  # as even as the chunks allow
    while 2 * tpr <= lanes and rows_blk * 2 * tpr <= threads:
        tpr *= 2
    limit = shared_limit()
    if config.DECODE_MAX_SHARED_BYTES is not None:
        limit = min(limit, config.DECODE_MAX_SHARED_BYTES)
    while layouts.decode_elements(rows_blk, tpr, D, Dv) * itemsize > limit:
        if tpr > 1 and (layouts.decode_kv_elements(tpr, D, Dv) >= rows_blk * (D + 1) or rows_blk == 1):
            tpr //= 2
        elif rows_blk > 1:
            rows_blk = -(-rows_blk // 2)
        else:
            raise config.shared_memory_error(D, Dv, limit)
    return rows_blk, tpr


def decode_splits(blocks, M):
    """Key splits per (batch, kv head, row chunk) when ``blocks`` such blocks are too few (the shape only)."""
    if blocks == 0 or blocks >= config.DECODE_MIN_BLOCKS:
        return 1
    wanted = -(-config.DECODE_MIN_BLOCKS // blocks)
    return max(1, min(wanted, M // max(1, config.DECODE_MIN_SPLIT_KEYS)))


def forward_tiles(itemsize, D, Dv):
    """``(threads, key tile)`` of the SIMT forward, from the config, shrunk until the shared memory fits.

    The key tile gives a row the fewest lanes whose accumulators hold the value
    head in one pass, between ``FORWARD_MIN_BLOCK_K`` and ``FORWARD_BLOCK_K`` keys.
    """
    block_q, block_k = config.FORWARD_BLOCK_Q, config.FORWARD_BLOCK_K
    tpr = block_k // config.REG_N
    if block_k % config.REG_N or tpr < 1 or tpr > 32 or tpr & (tpr - 1):
        raise ValueError(
            f"FORWARD_BLOCK_K={block_k} must be REG_N={config.REG_N} times a power of two of at most 32"
        )
    if block_q % config.REG_M or block_q < config.REG_M:
        raise ValueError(f"FORWARD_BLOCK_Q={block_q} must be a multiple of REG_M={config.REG_M}")

    def threads():
        return (block_q // config.REG_M) * (block_k // config.REG_N)

    one_pass = config.REG_N * pow2_at_least(-(-max(Dv, 1) // config.ACC_COLS))
    block_k = min(block_k, max(one_pass, config.FORWARD_MIN_BLOCK_K))
    limit = shared_limit()
    while layouts.forward_elements(threads(), block_k, D, Dv) * itemsize > limit:
        if block_k > config.REG_N and (block_k >= block_q or block_q <= config.REG_M):
            block_k //= 2
        elif block_q > config.REG_M and block_q % (2 * config.REG_M) == 0:
            block_q //= 2
        else:
            raise config.shared_memory_error(D, Dv, limit)
    return threads(), block_k


def needs_general(p):
    """Whether problem ``p`` has an option the simple tensor-core kernels do not take (mask, bias, NVM, ...)."""
    return (p.mask is not None or p.bias is not None or p.nvm or p.sigma is not None or p.alibi is not None
            or p.softcap is not None)


def tensor_core_geometry(itemsize, D, Dv, general=False):
    """``(kernel key, warps, shared bytes)`` of the tensor-core forward, or None where its tiles cannot fit.

    The key is ``(keys per tile, value columns per pass, general)`` of
    `elastic_np.cuda._tensor_core.forward.KERNELS`: key tiles of
    ``TC_KEYS[dtype]`` (32 with the general pipeline, whose calls cost
    registers), value columns in passes of 128 for float32 heads over 64,
    else 64. The warps per block (16 query rows each) halve from
    ``TC_FORWARD_WARPS`` until the shared memory fits.
    """
    block_k = 32 if general else config.TC_KEYS[itemsize]
    width_v = 128 if Dv > 64 and itemsize == 4 else 64
    warps = config.TC_FORWARD_WARPS
    limit = shared_limit()
    while warps >= 1:
        shared = layouts.tensor_core_forward_elements(warps, block_k, width_v, D) * itemsize
        if shared <= limit:
            return (block_k, width_v, bool(general)), warps, shared
        warps //= 2
    return None


def tensor_core_forward(p):
    """The tensor-core forward's `tensor_core_geometry` for problem ``p``, or None where the SIMT kernel runs.

    The tensor cores take float64 and ``precision="tf32"`` (the float32
    default only with ``TC_FLOAT32``), on sm_80 and later (and the
    simulator), unless ``TENSOR_CORES`` is off or the tiles cannot fit.
    """
    itemsize = p.dtype.itemsize
    if not config.TENSOR_CORES or not (itemsize == 8 or p.precision == "tf32" or config.TC_FLOAT32):
        return None
    if compute_capability() < (8, 0):
        return None
    B, H, Hkv, N, M, D, Dv = p.shape
    return tensor_core_geometry(itemsize, D, Dv, needs_general(p))


def vector_copies(itemsize, D, Dv, arrays):
    """Whether the tensor-core kernels copy 16 bytes at a time: rows of whole, 16-byte aligned units.

    ``arrays`` are the device arrays they read (C-contiguous);
    ``TC_VECTOR_COPY`` False copies element by element.
    """
    unit = 16 // itemsize
    if not config.TC_VECTOR_COPY or D % unit or Dv % unit:
        return False
    if simulator():
        return True
    return all(a.__cuda_array_interface__["data"][0] % 16 == 0 for a in arrays)


def backward_tiles(kind, itemsize, D, Dv):
    """``(threads, rows, cols)`` of a SIMT ``"dq"`` or ``"dkdv"`` block, the larger tile halved until it fits.

    ``dq``: ``rows = DQ_BLOCK_Q`` queries, ``cols = DQ_BLOCK_K`` keys per tile;
    ``dkdv``: ``rows = DKDV_BLOCK_K`` keys, ``cols = DKDV_BLOCK_Q`` queries per
    tile. ``rows`` must be a multiple of ``REG_M``, ``cols`` of ``REG_N``;
    the block has ``(rows / REG_M) (cols / REG_N)`` threads.
    """
    names = ("DQ_BLOCK_Q", "DQ_BLOCK_K") if kind == "dq" else ("DKDV_BLOCK_K", "DKDV_BLOCK_Q")
    rows, cols = (getattr(config, name) for name in names)
    reg_m, reg_n = config.REG_M, config.REG_N
    if rows % reg_m or rows < reg_m:
        raise ValueError(f"{names[0]}={rows} must be a positive multiple of REG_M={reg_m}")
    if cols % reg_n or cols < reg_n:
        raise ValueError(f"{names[1]}={cols} must be a positive multiple of REG_N={reg_n}")
    limit = shared_limit()
    while layouts.backward_elements(kind, rows, cols, D, Dv) * itemsize > limit:
        if cols > reg_n and cols % (2 * reg_n) == 0 and (cols >= rows or rows % (2 * reg_m)):
            cols //= 2
        elif rows > reg_m and rows % (2 * reg_m) == 0:
            rows //= 2
        else:
            raise config.shared_memory_error(D, Dv, limit)
    return (rows // reg_m) * (cols // reg_n), rows, cols


def tensor_core_backward(p):
    """``(dq, dkdv)``, each ``(kernel key, warps, shared bytes)``, or None where the SIMT backward runs.

    The tensor cores take the backward (``TC_BACKWARD``) where the forward
    ran on them without the general score pipeline (`tensor_core_forward`),
    except with ``precision="tf32"``, whose backward keeps float32 (the
    contract); heads up to 128 columns. The warps per block halve from
    ``TC_BACKWARD_WARPS`` until the shared memory fits.
    """
    if not config.TC_BACKWARD or p.precision == "tf32":
        return None
    forward = tensor_core_forward(p)
    if forward is None or forward[0][2]:
        return None
    B, H, Hkv, N, M, D, Dv = p.shape
    itemsize = p.dtype.itemsize
    width = next((w for w in (64, 128) if max(D, Dv) <= w), None)
    if width is None:
        return None
    limit = shared_limit()
    plans = []
    for kind in ("dq", "dkdv"):
        tile = config.TC_BACKWARD_TILES[kind, itemsize, width]
        warps = config.TC_BACKWARD_WARPS
        while warps > 1 and layouts.tensor_core_backward_elements(kind, warps, tile, width) * itemsize > limit:
            warps //= 2
        shared = layouts.tensor_core_backward_elements(kind, warps, tile, width) * itemsize
        if shared > limit:
            return None
        plans.append(((kind, tile, width), warps, shared))
    return tuple(plans)
