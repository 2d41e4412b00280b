"""Half-precision storage in the CPU kernels: bfloat16 and float16 read as float32, written rounded.

The kernels compute in float32 for both formats
(`elastic_np._contract._validation.compute_dtype`). Numba has
no 16-bit float type on the CPU, so a half array reaches compiled code as
its bits, a view of the same memory (`bits`): bfloat16 as ``uint16``,
float16 as ``int16``. The integer type tells the format at compile time,
so each format is a compiled specialisation of its own, like a dtype.

In compiled code:

`widen(x)`
    a stored element as the number it holds: float32 for a half, a float
    unchanged (a quantized cache's byte as `elastic_np.cpu._tiles.quantized` widens it);
`narrow(x, like)`
    a float as an element of the array ``like``: rounded to the nearest
    even half (through float32) for half storage, ``x`` itself for a float
    array (the assignment rounds it);
`readable(tile, width, scratch)`
    a tile of rows ``(whole, col)`` (`elastic_np.cpu._tiles.operands.head_rows`)
    as rows the tile products read: the tile itself for float storage, its
    ``width`` entries a row converted into ``scratch`` for half storage;
`readable_checked(tile, width, scratch)`
    `readable`'s rows and whether the tile's values are all finite, in one
    pass for half storage;
`copied(tile, width, out)`
    the rows converted (or copied) into ``out``;
`copied_checked(tile, width, out)`
    and checked, in the same pass;
`checked(tile, width)`
    the check alone;
`scratch_for(x, rows, width, dtype)`
    `readable`'s scratch: ``(rows, width)`` for a half ``x``, empty for a float one.

And for code generation, `widened(builder, raw, half)`: `widen` as LLVM IR,
for a half's bits or a vector of them.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from elastic_np._contract._validation import dtype_name
from elastic_np.cpu._runtime.config import FASTMATH
from elastic_np.cpu._tiles import quantized

#: The compiler flags of the overloads' implementations: those of the kernels' tile code (the float
#: checks' sums vectorise only with reassociation; Numba compiles an overload without any by default).
_TILE_CODE = {"fastmath": FASTMATH}

#: The half formats, by the name of their NumPy dtype, and the integer type of their bits.
_BITS = {"bfloat16": np.uint16, "float16": np.int16}


def bits(a):
    """``a`` as compiled code takes it: a half array as the integer view of its bits, a float array itself."""
    if a.dtype.char in "fd":  # the common case, without the name's lookup
        return a
    name = dtype_name(a.dtype)
    return a.view(_BITS[name]) if name in _BITS else quantized.bits(a)


def storage_format(ty):
    """"bfloat16", "float16" or None (a float) for the Numba type of stored elements."""
    return {types.uint16: "bfloat16", types.int16: "float16"}.get(ty)


def widened(builder, raw, half):
    """LLVM IR: the bits ``raw`` of the half ``half`` ("bfloat16" or "float16"), an ``i16`` or a vector of them, as float32.

    bfloat16 is the high half of a float32 (zero-extend and shift); float16
    converts exactly (``fpext``; F16C's ``vcvtph2ps`` on x86). For the
    intrinsics here and the kernels' vector code (`elastic_np.cpu._decode.products`).
    """
    def like(element):  # the type of raw's shape with this element type
        return ir.VectorType(element, raw.type.count) if isinstance(raw.type, ir.VectorType) else element

    if half == "float16":
        return builder.fpext(builder.bitcast(raw, like(ir.HalfType())), like(ir.FloatType()))
    wide = builder.zext(raw, like(ir.IntType(32)))
    sixteen = ir.Constant(like(ir.IntType(32)), [16] * raw.type.count if isinstance(raw.type, ir.VectorType) else 16)
    return builder.bitcast(builder.shl(wide, sixteen), like(ir.FloatType()))


@intrinsic
def _bfloat16_to_float32(typingctx, x):
    def codegen(context, builder, signature, args):
        return widened(builder, args[0], "bfloat16")

    return (types.float32(types.uint16), codegen) if x == types.uint16 else None


@intrinsic
def _float16_to_float32(typingctx, x):
    def codegen(context, builder, signature, args):
        return widened(builder, args[0], "float16")

    return (types.float32(types.int16), codegen) if x == types.int16 else None


@intrinsic
def _float32_to_float16(typingctx, x):
    """IEEE round to nearest even (LLVM's ``fptrunc``; F16C's ``vcvtps2ph`` on x86)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return (types.int16(types.float32), codegen) if x == types.float32 else None


@intrinsic
def float32_bits(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return (types.uint32(types.float32), codegen) if x == types.float32 else None


@njit(inline="always", fastmath=False)
def _float32_to_bfloat16(x):
    """Round to nearest even, as ``ml_dtypes`` and torch do; a NaN stays a (quiet) NaN of its sign."""
    u = np.uint32(float32_bits(x))
    if x != x:
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    odd = (u >> np.uint32(16)) & np.uint32(1)
    return np.uint16((u + np.uint32(0x7FFF) + odd) >> np.uint32(16))


def widen(x):
    """A stored element as the number it holds (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(widen, inline="always")
def _widen(x):
    half = storage_format(x)
    if half == "bfloat16":
        return lambda x: _bfloat16_to_float32(x)
    if half == "float16":
        return lambda x: _float16_to_float32(x)
    if isinstance(x, types.Float):
        return lambda x: x
    if quantized.byte_format(x) is not None:  # a quantized cache's byte (`elastic_np.cpu._tiles.quantized`)
        return lambda x: quantized.widen_byte(x)
    return None


def narrow(x, like):
    """A float as an element of the array ``like`` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(narrow, jit_options=_TILE_CODE)
def _narrow(x, like):
    if not isinstance(like, types.Array):
        return None
    half = storage_format(like.dtype)
    if half == "bfloat16":
        def to_bfloat16(x, like):
            return _float32_to_bfloat16(np.float32(x))
        return to_bfloat16
    if half == "float16":
        def to_float16(x, like):
            return _float32_to_float16(np.float32(x))
        return to_float16

    def unchanged(x, like):
        return x
    return unchanged


def readable(tile, width, scratch):
    """The rows of ``tile`` as float rows (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(readable, inline="always")
def _readable(tile, width, scratch):
    if storage_format(tile.types[0].dtype) is None:
        return lambda tile, width, scratch: tile

    def convert(tile, width, scratch):
        copied(tile, width, scratch)
        return scratch[: tile[0].shape[0]], tile[1] - tile[1]

    return convert


@njit(inline="always", fastmath=False)
def copied(tile, width, out):
    """``out[:n] = `` the ``n`` rows of ``tile`` as floats (converted from a half) (jit code only)."""
    whole, col = tile
    for r in range(whole.shape[0]):
        row = whole[r, col : col + width]
        to = out[r]
        for d in range(width):
            to[d] = widen(row[d])


def copied_checked(tile, width, out):
    """``out[:n] = `` the ``n`` rows of ``tile`` as floats; 0 when their values are finite, NaN otherwise (jit code only).

    For half storage, the check is made on the bits as they are converted
    (an exponent of all ones is an inf or a NaN), in the same pass; for
    float storage it is `checked`'s, a pass of its own.
    """
    raise NotImplementedError("only callable from compiled code")


@overload(copied_checked, jit_options=_TILE_CODE)
def _copied_checked(tile, width, out):
    half = storage_format(tile.types[0].dtype)
    if half is None:  # a float tile is copied only where it spans pages (`elastic_np.cpu._decode.tiles._tiles`)
        def copy_then_check(tile, width, out):
            copied(tile, width, out)
            return checked(tile, width)
        return copy_then_check
    exponent, lowest = _exponent_test(half)
    bits_type = tile.types[0].dtype

    def converted(tile, width, out):
        whole, col = tile
        mask, carry = bits_type(exponent), bits_type(lowest)
        flags = bits_type(0)
        for r in range(whole.shape[0]):
            row = whole[r, col : col + width]
            to = out[r]
            for d in range(width):
                x = row[d]
                flags |= bits_type((x & mask) + carry)
                to[d] = widen(x)
        return _nan_if_flagged(flags)

    return converted


def _exponent_test(half):
    """``(mask, carry)`` of the half's bits: ``(x & mask) + carry`` sets the sign bit only for an all-ones exponent.

    ``mask`` is the exponent's bits, ``carry`` its lowest: an all-ones
    exponent (an inf or a NaN) plus its lowest bit carries into the sign
    bit, which no other exponent reaches.
    """
    exponent = 0x7F80 if half == "bfloat16" else 0x7C00
    return exponent, exponent & -exponent


@njit(inline="always", fastmath=False)
def _nan_if_flagged(flags):
    """0 when no ``(x & mask) + carry`` of `_exponent_test` set the sign bit (all finite), NaN otherwise."""
    return np.float32(0.0) if (np.uint16(flags) & np.uint16(0x8000)) == 0 else np.float32(np.nan)


def checked(tile, width):
    """0 when the values of the rows of ``tile`` are finite, NaN otherwise, in one pass (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(checked, jit_options=_TILE_CODE)
def _checked(tile, width):
    half = storage_format(tile.types[0].dtype)
    if quantized.byte_format(tile.types[0].dtype) is not None:
        return lambda tile, width: quantized.finite_check(tile, width)
    if half is None:
        def float_check(tile, width):
            whole, col = tile
            zero = whole.dtype.type(0.0)
            check = zero
            for r in range(whole.shape[0]):
                row = whole[r, col : col + width]
                for d in range(width):
                    check += row[d] * zero
            return check
        return float_check
    exponent, lowest = _exponent_test(half)
    bits_type = tile.types[0].dtype

    def bits_check(tile, width):
        whole, col = tile
        mask, carry = bits_type(exponent), bits_type(lowest)
        flags = bits_type(0)
        for r in range(whole.shape[0]):
            row = whole[r, col : col + width]
            for d in range(width):
                flags |= bits_type((row[d] & mask) + carry)
        return _nan_if_flagged(flags)

    return bits_check


def readable_checked(tile, width, scratch):
    """`readable`'s rows and a check of the tile's values: 0 when all are finite, NaN otherwise (jit code only).

    Half storage is converted and checked in one pass (`copied_checked`);
    float storage is read in place, the check a pass of its own.
    """
    raise NotImplementedError("only callable from compiled code")


@overload(readable_checked, jit_options=_TILE_CODE)
def _readable_checked(tile, width, scratch):
    if storage_format(tile.types[0].dtype) is None:
        def in_place(tile, width, scratch):
            return tile, checked(tile, width)
        return in_place

    def converted(tile, width, scratch):
        n = tile[0].shape[0]
        check = copied_checked(tile, width, scratch)
        return (scratch[:n], tile[1] - tile[1]), check

    return converted


def scratch_for(x, rows, width, dtype):
    """`readable`'s scratch for the storage array ``x`` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(scratch_for, inline="always")
def _scratch_for(x, rows, width, dtype):
    if storage_format(x.dtype) is None and quantized.byte_format(x.dtype) is None:  # (bytes: dequantized there)
        return lambda x, rows, width, dtype: np.empty((0, width), dtype=dtype)
    return lambda x, rows, width, dtype: np.empty((rows, width), dtype=dtype)
