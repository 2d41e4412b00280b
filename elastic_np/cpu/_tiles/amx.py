"""bfloat16 tile products on the AMX units of Intel Xeons (Sapphire Rapids and later), for the prefill forward.

A ``TDPBF16PS`` multiplies a tile of 16 rows of 32 bfloat16 by a tile of 16
rows of 16 bfloat16 pairs (``B[k // 2, 2 n + k % 2] = B[k, n]``, the pairs of
consecutive ``k`` of one column ``n`` in a 32-bit lane) into a tile of
16 x 16 float32 sums: one instruction does 8,192 multiply-adds of exact
products (a bfloat16 product fits in a float32) with float32 sums; the
unit reads inputs below the smallest normal float32 as zero and writes such
sums as zero (DAZ and FTZ). Every tile here has 16 rows of 64 bytes.

Compiled code reaches the unit through LLVM's intrinsics (``llvm.x86.tileloadd64``
and the rest, each naming its tile register): `load`, `store`, `zero`, `dot`,
and `configure` / `release` around each function that uses them. Linux gives
a process the unit's registers only once it asks (`permitted`,
``arch_prctl(ARCH_REQ_XCOMP_PERM)``). `AVAILABLE` says whether LLVM
compiles for a CPU that has the unit: where it does not, nothing here is
compiled into a kernel.
"""

import ctypes
import platform
import sys
import threading

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from elastic_np.cpu._tiles.simd import _FEATURES

#: Whether LLVM compiles for a CPU with AMX tiles and their bfloat16 products.
AVAILABLE = {"amx-tile", "amx-bf16"} <= _FEATURES and sys.platform.startswith("linux") \
    and platform.machine() in ("x86_64", "AMD64")

#: Rows of every tile and bytes of each row.
ROWS, ROW_BYTES = 16, 64

_I8, _I64 = ir.IntType(8), ir.IntType(64)
_PTR = ir.IntType(8).as_pointer()

_PERMISSION = []  # [bool], once asked
_PERMISSION_LOCK = threading.Lock()


def permitted():
    """Whether this process may use the tiles: asks Linux once (``ARCH_REQ_XCOMP_PERM`` for ``XTILEDATA``)."""
    if not AVAILABLE:
        return False
    with _PERMISSION_LOCK:
        if not _PERMISSION:
            sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                _PERMISSION.append(libc.syscall(sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0)
            except (OSError, AttributeError):
                _PERMISSION.append(False)
    return _PERMISSION[0]


def _call(builder, name, args):
    fnty = ir.FunctionType(ir.VoidType(), [a.type for a in args])
    builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def _tile(number):
    return ir.Constant(_I8, number)


@intrinsic
def configure(typingctx):
    """Load the tile configuration: palette 1, tiles 0-7 each `ROWS` rows of `ROW_BYTES` bytes."""

    def codegen(context, builder, signature, args):
        config = cgutils.alloca_once(builder, ir.ArrayType(_I8, 64))
        builder.store(ir.Constant(ir.ArrayType(_I8, 64), None), config)
        base = builder.bitcast(config, _PTR)
        builder.store(ir.Constant(_I8, 1), base)  # palette
        for tile in range(8):
            colsb = builder.bitcast(builder.gep(base, [ir.Constant(_I64, 16 + 2 * tile)]), ir.IntType(16).as_pointer())
            builder.store(ir.Constant(ir.IntType(16), ROW_BYTES), colsb)
            builder.store(ir.Constant(_I8, ROWS), builder.gep(base, [ir.Constant(_I64, 48 + tile)]))
        _call(builder, "llvm.x86.ldtilecfg", [base])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def release(typingctx):
    """Release the tiles (their state is then the processor's initial one again)."""

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tilerelease", [])
        return context.get_dummy_value()

    return types.void(), codegen


def _address(context, builder, ty, array, index):
    """``&array.flat[index]`` of a C-contiguous array, as an ``i8*``."""
    data = context.make_array(ty)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [index]), _PTR)


def _row_bytes(context, builder, ty, stride):
    """``stride`` entries of ``ty`` (an array type) in bytes."""
    return builder.mul(stride, ir.Constant(stride.type, context.get_abi_sizeof(context.get_value_type(ty.dtype))))


def _contiguous(ty):
    return isinstance(ty, types.Array) and ty.layout == "C"


def _literal(ty):
    """The value of an integer literal type, else None (a tile register is named by a constant)."""
    return ty.literal_value if isinstance(ty, types.IntegerLiteral) else None


def _memory(name, doc):
    """The intrinsic ``op(tile, array, index, stride)`` that moves tile register ``tile`` by LLVM's ``name``."""

    def typer(typingctx, tile, array, index, stride):
        number = _literal(tile)
        if number is None or not _contiguous(array):
            return None

        def codegen(context, builder, signature, args):
            ptr = _address(context, builder, signature.args[1], args[1], args[2])
            _call(builder, name, [_tile(number), ptr, _row_bytes(context, builder, array, args[3])])
            return context.get_dummy_value()

        return types.void(tile, array, types.intp, types.intp), codegen

    typer.__doc__ = doc
    return intrinsic(prefer_literal=True)(typer)


load = _memory("llvm.x86.tileloadd64", "Tile register ``tile`` (a constant) = `ROWS` rows of `ROW_BYTES` bytes "
                                       "from ``array.flat[index]``, ``stride`` entries apart.")
store = _memory("llvm.x86.tilestored64", "Tile register ``tile`` into ``array.flat[index]`` on, its rows ``stride`` "
                                         "entries apart.")


@intrinsic(prefer_literal=True)
def zero(typingctx, tile):
    """Tile register ``tile`` = 0."""
    number = _literal(tile)
    if number is None:
        return None

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tilezero", [_tile(number)])
        return context.get_dummy_value()

    return types.void(tile), codegen


@intrinsic(prefer_literal=True)
def dot(typingctx, c, a, b):
    """Tile ``c`` += tile ``a`` (rows of bfloat16) times tile ``b`` (rows of bfloat16 pairs); all three constants."""
    numbers = [_literal(t) for t in (c, a, b)]
    if None in numbers:
        return None

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tdpbf16ps", [_tile(n) for n in numbers])
        return context.get_dummy_value()

    return types.void(c, a, b), codegen


# A 2 x 2 block of float32 sums in tiles 0-3 (rows by columns of 16), by rows in tiles 4, 5 and pairs in 6, 7.


@njit(inline="always", fastmath=False)
def load_block(array, first, lead):
    """Tiles 0-3 = the 32 x 32 float32 block of ``array`` (rows ``lead`` entries apart) from ``array.flat[first]``."""
    load(0, array, first, lead)
    load(1, array, first + ROWS, lead)
    load(2, array, first + ROWS * lead, lead)
    load(3, array, first + ROWS * lead + ROWS, lead)


@njit(inline="always", fastmath=False)
def store_block(array, first, lead):
    """Tiles 0-3 into the 32 x 32 float32 block of ``array`` at ``array.flat[first]`` (`load_block`'s)."""
    store(0, array, first, lead)
    store(1, array, first + ROWS, lead)
    store(2, array, first + ROWS * lead, lead)
    store(3, array, first + ROWS * lead + ROWS, lead)


@njit(inline="always", fastmath=False)
def zero_block():
    """Tiles 0-3 = 0."""
    zero(0)
    zero(1)
    zero(2)
    zero(3)


@njit(inline="always", fastmath=False)
def dot_block():
    """Tiles 0-3 += tiles 4, 5 (rows) times tiles 6, 7 (pairs): tile ``2 i + j`` takes rows ``4 + i`` and pairs ``6 + j``."""
    dot(0, 4, 6)
    dot(1, 4, 7)
    dot(2, 5, 6)
    dot(3, 5, 7)
