"""Moving square blocks of a tile through SIMD registers: transposed loads, adds and stores, prefetch.

``transpose_add``, ``transpose_store``, ``transpose_stream`` (whole cache lines, non-temporal) and
``transpose_accumulate`` (into float64) move ``W x W`` blocks
(`transpose_width`) between a key-major tile and a query-major array;
``prefetch`` hints a line into the cache.
"""

import platform

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np import numpy_support

from elastic_np.cpu._tiles.simd import LINE_BYTES, VECTOR_BYTES, constant_in_jit_code


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint the CPU to bring ``arr.ravel()[index]`` into the cache (jit code only).

    ``llvm.prefetch`` (a read, high locality, data cache): it never faults and
    changes no value, so an index past the end is harmless. Kernels use it
    where their access pattern defeats the hardware prefetcher, such as a
    tile of a C-order array read as many short rows far apart.
    """
    if not (isinstance(arr, types.Array) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # read (0), high temporal locality (3), data cache (1)
        builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, index), codegen


#: Entries per side of the square blocks the transposes move, at least: with
#: AVX2, 8 x 8 float32 blocks (a register per row) beat 16 x 16 ones (two
#: registers per row, and spills), and 8 x 8 float64 blocks beat 4 x 4 ones.
_MIN_TRANSPOSE_WIDTH = 8


@constant_in_jit_code
def transpose_width(x):
    """Entries per side ``W`` of the square blocks `transpose_add` and co. move.

    A SIMD register of the dtype per row, or 8 entries where that is fewer
    (two or more registers per row). ``x`` is a dtype or an array (an array
    in jit code, where the width is a compile-time constant).
    """
    dtype = x.dtype if isinstance(x, np.ndarray) else np.dtype(x)
    return max(VECTOR_BYTES // dtype.itemsize, _MIN_TRANSPOSE_WIDTH)


def transpose_in_registers(builder, rows):
    """Transpose ``W`` vectors of ``W`` lanes: ``log2(W)`` rounds of two-source shuffles.

    Round ``bit`` pairs rows ``i`` and ``i + bit`` (``bit`` clear in ``i``) and
    swaps the entries whose column has the bit set in row ``i`` with those
    where it is clear in row ``i + bit``: each round swaps one bit of the row
    and column indices, so after all rounds entry ``(r, c)`` sits at ``(c, r)``.
    """
    width = len(rows)
    rows = list(rows)
    i32 = ir.IntType(32)
    bit = 1
    while bit < width:
        low = [j if not j & bit else width + j - bit for j in range(width)]
        high = [j + bit if not j & bit else width + j for j in range(width)]
        low, high = (ir.Constant(ir.VectorType(i32, width), m) for m in (low, high))
        for i in range(width):
            if not i & bit:
                a, b = rows[i], rows[i + bit]
                rows[i] = builder.shuffle_vector(a, b, low)
                rows[i + bit] = builder.shuffle_vector(a, b, high)
        bit *= 2
    return rows


@constant_in_jit_code
def stream_width(x):
    """Entries per run ``L`` of `transpose_stream`: whole cache lines, at least ``W``.

    ``x`` is a dtype or an array (an array in jit code, where the width is a
    compile-time constant).
    """
    dtype = x.dtype if isinstance(x, np.ndarray) else np.dtype(x)
    return max(LINE_BYTES // dtype.itemsize, transpose_width(dtype))


def _concatenate(builder, vectors):
    """One vector of the entries of ``vectors`` (a power of two of them, of one type), in order."""
    i32 = ir.IntType(32)
    while len(vectors) > 1:
        n = vectors[0].type.count
        order = ir.Constant(ir.VectorType(i32, 2 * n), list(range(2 * n)))
        vectors = [
            builder.shuffle_vector(vectors[i], vectors[i + 1], order)
            for i in range(0, len(vectors), 2)
        ]
    return vectors[0]


def _make_transpose(mode):
    """``transpose_add``, ``transpose_store``, ``transpose_stream`` or ``transpose_accumulate``.

    (``mode`` "add", "store", "stream" or "accumulate".)
    """
    store = mode in ("store", "stream", "accumulate")

    def codegen(context, builder, signature, args):
        x_ty, flat_ty = signature.args[:2]
        x_val, flat_val, start, stride, row0, col0, scale_val = args
        ir_float = context.get_value_type(x_ty.dtype)
        itemsize = context.get_abi_sizeof(ir_float)
        width = transpose_width(numpy_support.as_dtype(x_ty.dtype))
        vec = ir.VectorType(ir_float, width)
        intp = context.get_value_type(types.intp)
        i32 = ir.IntType(32)
        x_arr = context.make_array(x_ty)(context, builder, x_val)
        lead = cgutils.unpack_tuple(builder, x_arr.shape, 2)[1]
        flat_data = context.make_array(flat_ty)(context, builder, flat_val).data
        # "accumulate": the runs of `flat` are float64, whatever the dtype of x
        flat_float = context.get_value_type(flat_ty.dtype)
        flat_vec = ir.VectorType(flat_float, width)
        flat_align = context.get_abi_sizeof(flat_float)

        def vector_at(data, index, ty=vec):
            return builder.bitcast(builder.gep(data, [index], inbounds=True), ty.as_pointer())

        def flat_run(r):  # the r-th run of `flat`
            index = builder.add(start, builder.mul(stride, ir.Constant(intp, r)))
            return vector_at(flat_data, index, flat_vec)

        def x_row(c):  # row0 + c of x, from column col0
            index = builder.add(builder.mul(builder.add(row0, ir.Constant(intp, c)), lead), col0)
            return vector_at(x_arr.data, index)

        undef = ir.Constant(flat_vec, ir.Undefined)
        splat = builder.shuffle_vector(
            builder.insert_element(undef, scale_val, ir.Constant(i32, 0)),
            undef, ir.Constant(ir.VectorType(i32, width), [0] * width),
        )
        if store:
            # "stream": L / W blocks side by side, so that each run of dst (L
            # entries) is whole cache lines, written with non-temporal stores
            line = stream_width(numpy_support.as_dtype(x_ty.dtype)) if mode == "stream" else width
            blocks = [
                transpose_in_registers(
                    builder, [builder.load(x_row(g + c), align=itemsize) for c in range(width)]
                )
                for g in range(0, line, width)
            ]
            run_splat = _concatenate(builder, [splat] * len(blocks))
            for r in range(width):
                run = _concatenate(builder, [block[r] for block in blocks])
                if mode == "accumulate":
                    ptr = flat_run(r)
                    if flat_vec != vec:
                        run = builder.fpext(run, flat_vec)
                    total = builder.fadd(builder.load(ptr, align=flat_align), builder.fmul(run, splat))
                    builder.store(total, ptr, align=flat_align)
                elif mode == "stream":
                    ptr = builder.bitcast(flat_run(r), run.type.as_pointer())
                    out = builder.store(builder.fmul(run, run_splat), ptr, align=LINE_BYTES)
                    out.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(i32, 1)]))
                else:
                    builder.store(builder.fmul(run, splat), flat_run(r), align=itemsize)
            return context.get_dummy_value()
        rows = [builder.load(flat_run(r), align=itemsize) for r in range(width)]
        for c, row in enumerate(transpose_in_registers(builder, rows)):
            ptr = x_row(c)
            total = builder.fadd(builder.load(ptr, align=itemsize), builder.fmul(row, splat))
            builder.store(total, ptr, align=itemsize)
        return context.get_dummy_value()

    def typer(typingctx, x, flat, start, stride, row0, col0, scale):
        if not (isinstance(x, types.Array) and isinstance(flat, types.Array)):
            return None
        # C-contiguous only: the blocks are addressed from the data pointer and the shape
        if x.ndim != 2 or flat.ndim != 1 or x.layout != "C" or flat.layout != "C" or scale != flat.dtype:
            return None
        if flat.dtype != (types.float64 if mode == "accumulate" else x.dtype):
            return None
        if store and not flat.mutable:
            return None
        sig = types.void(x, flat, types.intp, types.intp, types.intp, types.intp, scale)
        return sig, codegen

    return typer


@intrinsic
def transpose_add(typingctx, x, src, start, stride, row0, col0, scale):
    """``x[row0 + c, col0 + r] += scale * src[start + r * stride + c]`` for ``r, c < W``.

    ``W = transpose_width(x)``; ``x`` is a 2-D C-contiguous array,
    ``src`` a 1-D array of the same dtype, ``scale`` a float of that dtype
    (jit code only). The ``W`` runs of ``src`` are loaded as vectors,
    transposed in registers, multiplied by ``scale`` and added to ``W`` rows of
    ``x`` (one product and one sum per entry): a block of a C-order bias added
    to a key-major score tile without a scalar gather or scatter.
    """
    return _make_transpose("add")(typingctx, x, src, start, stride, row0, col0, scale)


@intrinsic
def transpose_store(typingctx, x, dst, start, stride, row0, col0, scale):
    """``dst[start + r * stride + c] = scale * x[row0 + c, col0 + r]`` for ``r, c < W``.

    The inverse direction of `transpose_add` (jit code only): ``W`` rows of the
    tile ``x`` are loaded, transposed in registers, multiplied by ``scale``
    and stored as ``W`` runs of ``dst``: a key-major gradient tile written
    into a C-order ``dbias``.
    """
    return _make_transpose("store")(typingctx, x, dst, start, stride, row0, col0, scale)


@intrinsic
def transpose_stream(typingctx, x, dst, start, stride, row0, col0, scale):
    """``dst[start + r * stride + c] = scale * x[row0 + c, col0 + r]`` for ``r < W``, ``c < L``.

    As `transpose_store` for ``L / W`` blocks side by side (``L =
    stream_width(x)``), so that each of the ``W`` runs of ``dst`` is whole
    cache lines, written with non-temporal stores: they go to memory without
    first reading the lines into the cache (jit code only). For results that
    are written once and not read again by the kernel, such as a ``dbias``
    with no reduction. The address of ``dst[start]`` and ``stride`` entries
    must be multiples of the cache line (64 bytes), or the stores fault; the
    stores are weakly ordered, so a writer ends with `stream_fence`.
    """
    return _make_transpose("stream")(typingctx, x, dst, start, stride, row0, col0, scale)


#: x86 orders non-temporal stores with ``sfence`` (LLVM's fence is a locked
#: instruction there, which the manuals do not say orders them).
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


@intrinsic
def stream_fence(typingctx):
    """Order the non-temporal stores before it before any later store (jit code only)."""

    def codegen(context, builder, signature, args):
        if _X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse.sfence"), [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def transpose_accumulate(typingctx, x, dst, start, stride, row0, col0, scale):
    """``dst[start + r * stride + c] += scale * x[row0 + c, col0 + r]`` for ``r, c < W``, in float64.

    As `transpose_store` into a float64 ``dst`` (``scale`` a float64), the
    block of ``x`` (float32 or float64) widened to float64 and added (one
    product and one sum per entry; jit code only): a key-major gradient tile
    added into the float64 partial sums of a broadcast ``dbias``.
    """
    return _make_transpose("accumulate")(typingctx, x, dst, start, stride, row0, col0, scale)
