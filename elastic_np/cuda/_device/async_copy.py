"""Asynchronous copies from global to shared memory (``cp.async``, sm_80 on): inline PTX or simulator stand-ins.

Imports ``numba.cuda``; imported by the kernel modules. `copy_vector`
copies 16 bytes (four float32 or two float64) of a row of a two-dimensional
global array into a shared-memory tile, `copy_element` one element; both
write zeros instead where ``valid`` is False (``cp.async``'s source size
0), so the padding of a tile costs no branch. A thread's copies since its
last `commit` form a group; `wait_all` waits for all its groups, `wait_prior`
for all but the last one (the tile being prefetched); a ``syncthreads``
then makes every thread's copies visible to the block. `copy_tile` copies
a tile with the block's threads, element by element or 16 bytes at a time.

On a GPU (and when compiling without one) they are inline PTX built with
``numba.cuda.extending.intrinsic``; under the simulator, Python stand-ins
that copy at once (`_sim_copy_vector`, ...), with the same results.
"""

from numba import config as numba_config
from numba import cuda
from numba import types as nbt

from elastic_np.cuda._device.basics import inline_device, unsigned


def copy_vector(dst, dst_index, src, row, col, valid):
    """Copy 16 bytes from ``src[row, col:]`` to ``dst[dst_index:]`` (zeros where not ``valid``), asynchronously."""
    raise NotImplementedError("called only inside a CUDA kernel")


def copy_element(dst, dst_index, src, row, col, valid):
    """Copy ``src[row, col]`` to ``dst[dst_index]`` (zero where not ``valid``), asynchronously."""
    raise NotImplementedError("called only inside a CUDA kernel")


def commit():
    """Close the thread's group of copies."""
    raise NotImplementedError("called only inside a CUDA kernel")


def wait_all():
    """Wait for all the thread's groups of copies."""
    raise NotImplementedError("called only inside a CUDA kernel")


def wait_prior():
    """Wait for all the thread's groups of copies but the last."""
    raise NotImplementedError("called only inside a CUDA kernel")


@inline_device
def copy_tile(src, rows, cols, dst, stride, tile_rows, width, unit):
    """Start copying ``src[r, c]`` to ``dst[r stride + c]`` for a ``tile_rows x width`` tile, zeros past ``rows``, ``cols``.

    ``src`` is two-dimensional (a (batch, head)'s rows from the tile's first);
    ``unit`` is 1 (element copies) or the elements of 16 bytes (vector copies:
    ``cols``, ``width`` and the rows' starts are then multiples of it). Thread
    ``t`` of the block takes units ``t, t + threads, ...`` in row order,
    stepping through them without a division. The copies are asynchronous.
    """
    t = cuda.threadIdx.x
    threads = cuda.blockDim.x
    per_row = width // unit  # at least 1
    r = t // per_row
    c = t - r * per_row
    step_r = threads // per_row
    step_c = threads - step_r * per_row
    while r < tile_rows:
        col = c * unit
        valid = r < rows and col < cols
        at = unsigned(r * stride + col)
        if unit == 1:
            copy_element(dst, at, src, unsigned(r if valid else 0), unsigned(col if valid else 0), valid)
        else:
            copy_vector(dst, at, src, unsigned(r if valid else 0), unsigned(col if valid else 0), valid)
        r += step_r
        c += step_c
        if c >= per_row:
            c -= per_row
            r += 1


def _sim_copy(count):
    def copy(dst, dst_index, src, row, col, valid):
        for offset in range(count):
            dst[int(dst_index) + offset] = src[int(row), int(col) + offset] if valid else 0

    return copy


def _sim_nothing():
    return None


def _declare():
    """The copies as inline PTX (``numba.cuda.extending.intrinsic``)."""
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def make_copy(vector):
        @intrinsic
        def copy(typingctx, dst, dst_index, src, row, col, valid):
            def codegen(context, builder, sig, args):
                dst_ty, _, src_ty, _, _, _ = sig.args
                dst_arr = context.make_array(dst_ty)(context, builder, args[0])
                src_arr = context.make_array(src_ty)(context, builder, args[2])
                to = cgutils.get_item_pointer(context, builder, dst_ty, dst_arr, [args[1]])
                at = cgutils.get_item_pointer(context, builder, src_ty, src_arr, [args[3], args[4]])
                i64 = ir.IntType(64)
                i32 = ir.IntType(32)
                size = 16 if vector else src_ty.dtype.bitwidth // 8
                cache = "cg" if vector else "ca"
                bytes_ = builder.select(args[5], ir.Constant(i32, size), ir.Constant(i32, 0))
                asm = ("{ .reg .u64 s64, g64; .reg .u32 s32; cvta.to.shared.u64 s64, $0; cvt.u32.u64 s32, s64; "
                       f"cvta.to.global.u64 g64, $1; cp.async.{cache}.shared.global [s32], [g64], {size}, $2; }}")
                fnty = ir.FunctionType(ir.VoidType(), [i64, i64, i32])
                builder.call(ir.InlineAsm(fnty, asm, "l,l,r", side_effect=True),
                             [builder.ptrtoint(to, i64), builder.ptrtoint(at, i64), bytes_])
                return context.get_dummy_value()

            return nbt.none(dst, dst_index, src, row, col, valid), codegen

        return copy

    def make_plain(asm):
        @intrinsic
        def plain(typingctx):
            def codegen(context, builder, sig, args):
                builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), asm, "", side_effect=True), [])
                return context.get_dummy_value()

            return nbt.none(), codegen

        return plain

    return (make_copy(True), make_copy(False), make_plain("cp.async.commit_group;"),
            make_plain("cp.async.wait_group 0;"), make_plain("cp.async.wait_group 1;"))


def _sim_copy_vector(dst, dst_index, src, row, col, valid):
    _sim_copy(16 // src.dtype.itemsize)(dst, dst_index, src, row, col, valid)


# the functions above document the names; these are what the kernels call
if getattr(numba_config, "ENABLE_CUDASIM", 0):
    copy_vector, copy_element = _sim_copy_vector, _sim_copy(1)  # noqa: F811
    commit = wait_all = wait_prior = _sim_nothing  # noqa: F811
else:
    copy_vector, copy_element, commit, wait_all, wait_prior = _declare()  # noqa: F811
