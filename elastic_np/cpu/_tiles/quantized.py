"""Quantized storage in the CPU kernels: int8 and float8 caches read in place, widened to float32 in registers.

A quantized ``k`` or ``v`` (`elastic_np._contract._quantized`) reaches
compiled code as one byte an entry (`bits`): int8 as itself, a float8
format as a one-field record of ``uint8`` named after it, so that each
format is a Numba type, and a compiled specialisation, of its own (as
`elastic_np.cpu._tiles.halves` tells bfloat16 from float16 by the integer
type of their bits).

`widened(builder, raw, fmt)` turns the bytes ``raw`` (an ``i8`` or a vector
of them) into float32 in LLVM IR, exactly, times `UNIT` ``[fmt]``:

- int8: a signed conversion;
- float8_e5m2: the high byte of a float16, converted (``vcvtph2ps``);
- float8_e4m3fn: sign and magnitude moved into a float16 whose exponent
  field holds the format's (no rebias: a subnormal stays one), converted,
  so the number comes out ``2**-8`` times too small (`UNIT`), a factor the
  kernels fold into the cache's scale; a NaN (magnitude ``0x7F``; the
  format has no inf) becomes a NaN.

`finite_check(tile, width)` (jit code): 0 when a tile's rows hold no NaN or
inf, NaN otherwise (always 0 for int8). `scaled_bytes` dequantizes a run
of a row's bytes, a vector of them at a time, for the kernels that read a
quantized tile from scratch.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from elastic_np._contract._validation import dtype_name
from elastic_np.cpu._runtime.config import FASTMATH
from elastic_np.cpu._tiles.simd import VECTOR_BYTES

#: The record dtype of each float8 format's bytes (the field named after the format).
_RECORDS = {name: np.dtype([(name, np.uint8)]) for name in ("float8_e4m3fn", "float8_e5m2")}
#: What `widened` multiplies each format's numbers by: the kernels divide the cache's scale by it.
UNIT = {"int8": 1.0, "float8_e4m3fn": 2.0 ** -8, "float8_e5m2": 1.0}


def bits(a):
    """``a`` as compiled code takes it: a float8 array as the record view of its bytes, any other array itself."""
    record = _RECORDS.get(dtype_name(a.dtype))
    return a if record is None else a.view(record)


def byte_format(ty):
    """"int8", "float8_e4m3fn", "float8_e5m2" or None for the Numba type of stored elements."""
    if ty == types.int8:
        return "int8"
    if isinstance(ty, types.Record) and len(ty.fields) == 1:
        name = next(iter(ty.fields))
        return name if name in _RECORDS else None
    return None


def widened(builder, raw, fmt, nan=True):
    """LLVM IR: the bytes ``raw`` of format ``fmt``, an ``i8`` or a vector of them, as float32 times ``UNIT[fmt]``.

    ``nan=False``: a float8_e4m3fn NaN byte may widen to a finite number (the
    caller finds it with `nan_bytes`, on many bytes at once).
    """
    vector = isinstance(raw.type, ir.VectorType)

    def like(element):
        return ir.VectorType(element, raw.type.count) if vector else element

    def const(ty, value):
        return ir.Constant(like(ty), [value] * raw.type.count if vector else value)

    f32, i16 = ir.FloatType(), ir.IntType(16)
    if fmt == "int8":
        return builder.sitofp(raw, like(f32))
    if fmt == "float8_e5m2":
        half = builder.shl(builder.zext(raw, like(i16)), const(i16, 8))
    else:  # the sign extended to bits 15 and 14, the magnitude to 13 .. 7: bit 14 cleared
        half = builder.and_(builder.shl(builder.sext(raw, like(i16)), const(i16, 7)), const(i16, 0xBF80))
        if nan:
            found = builder.icmp_unsigned("==", builder.and_(half, const(i16, 0x3F80)), const(i16, 0x3F80))
            half = builder.select(found, const(i16, 0x7E00), half)
    return builder.fpext(builder.bitcast(half, like(ir.HalfType())), like(f32))


#: The formats whose NaN `widened` finds only when asked (``nan=True``), and the NaN's bits but the sign.
HIDDEN_NAN = {"float8_e4m3fn": 0x7F}


def nan_bytes(builder, raw, fmt):
    """LLVM IR: the ``i1`` lanes of the bytes ``raw`` (a vector of ``i8``) that are NaNs of ``fmt`` (`HIDDEN_NAN`)."""
    mask = ir.Constant(raw.type, [HIDDEN_NAN[fmt]] * raw.type.count)
    return builder.icmp_unsigned("==", builder.and_(raw, mask), mask)


def any_lane(builder, lanes):
    """LLVM IR: whether any lane of the ``i1`` vector ``lanes`` is set."""
    packed = builder.bitcast(lanes, ir.IntType(lanes.type.count))
    return builder.icmp_unsigned("!=", packed, ir.Constant(packed.type, 0))


def _make_scalar(fmt):
    @intrinsic
    def to_float32(typingctx, x):
        def codegen(context, builder, signature, args):
            return widened(builder, args[0], fmt)

        wanted = types.int8 if fmt == "int8" else types.uint8
        return (types.float32(wanted), codegen) if x == wanted else None

    return to_float32


_int8_to_float32 = _make_scalar("int8")
_e4m3fn_to_float32 = _make_scalar("float8_e4m3fn")
_e5m2_to_float32 = _make_scalar("float8_e5m2")


def widen_byte(x):
    """A stored byte as float32 times `UNIT` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(widen_byte, inline="always")
def _widen_byte(x):
    fmt = byte_format(x)
    if fmt == "int8":
        return lambda x: _int8_to_float32(x)
    if fmt == "float8_e4m3fn":
        return lambda x: _e4m3fn_to_float32(x.float8_e4m3fn)
    if fmt == "float8_e5m2":
        return lambda x: _e5m2_to_float32(x.float8_e5m2)
    return None


def finite_check(tile, width):
    """0 when the rows of ``tile = (whole, col)`` hold no NaN or inf, NaN otherwise (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(finite_check, jit_options={"fastmath": False})
def _finite_check(tile, width):
    fmt = byte_format(tile.types[0].dtype)
    if fmt == "int8":
        return lambda tile, width: np.float32(0.0)
    if fmt is None:
        return None

    def check(tile, width):
        whole, col = tile
        zero = np.float32(0.0)
        total = zero
        for r in range(whole.shape[0]):
            row = whole[r, col : col + width]
            for d in range(width):
                total += widen_byte(row[d]) * zero
        return total

    return check


#: float32 lanes of a vector: the entries `scaled_bytes` widens at once.
_LANES = VECTOR_BYTES // 4


@intrinsic
def _scaled_vector(typingctx, src, at, dst, factor):
    """``dst[at : at + _LANES] = `` the bytes ``src[at : at + _LANES]`` widened, times ``factor`` (float32)."""
    fmt = byte_format(getattr(src, "dtype", None))
    one_dim = all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in (src, dst))
    if fmt is None or not one_dim or dst.dtype != types.float32 or factor != types.float32:
        return None

    def codegen(context, builder, signature, args):
        source = context.make_array(signature.args[0])(context, builder, args[0])
        target = context.make_array(signature.args[2])(context, builder, args[2])
        bytes_ty, floats_ty = ir.VectorType(ir.IntType(8), _LANES), ir.VectorType(ir.FloatType(), _LANES)
        start = builder.gep(source.data, [args[1]], inbounds=True)
        raw = builder.load(builder.bitcast(start, bytes_ty.as_pointer()), align=1)
        splat = builder.insert_element(ir.Constant(floats_ty, None), args[3], ir.Constant(ir.IntType(32), 0))
        splat = builder.shuffle_vector(splat, ir.Constant(floats_ty, None), ir.Constant(ir.VectorType(
            ir.IntType(32), _LANES), [0] * _LANES))
        value = builder.fmul(widened(builder, raw, fmt), splat)
        builder.store(value, builder.bitcast(builder.gep(target.data, [args[1]], inbounds=True),
                                             floats_ty.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(src, at, dst, factor), codegen


@njit(inline="always", fastmath=FASTMATH)
def scaled_bytes(src, dst, start, stop, factor):
    """``dst[d] = `` the byte ``src[d]`` widened (times `UNIT`), times the float32 ``factor``, for ``start <= d <
    stop``: whole vectors at once, the rest one at a time (jit code only; 1-D C-contiguous arrays)."""
    d = start
    while d + _LANES <= stop:
        _scaled_vector(src, d, dst, factor)
        d += _LANES
    while d < stop:
        dst[d] = widen_byte(src[d]) * factor
        d += 1
