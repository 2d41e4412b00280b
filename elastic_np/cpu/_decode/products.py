"""The stacked-rows decode kernel's two products, reading the cache's rows where and as they are stored.

``key_scores(qs, k_tile, ahead, st, s_col, rows, bk, D)``
    ``st[r, s_col + c] = qs[r, :D] . K[c, :D]`` for ``r < rows``, ``c < bk``;
``value_products(st, s_col, v_tile, ahead, acc, rows, bk, Dv)``
    ``acc[r, :Dv] += st[r, s_col:s_col + bk] @ V[:bk, :Dv]``;

where ``K`` and ``V`` are rows of the cache, ``(whole, col)``
(`elastic_np.cpu._tiles.operands.head_rows`), stored as floats of the compute
dtype or as the bits of a half (`elastic_np.cpu._tiles.halves`), widened in
registers as they are loaded: a half cache is never converted into
scratch, and no key tile is transposed into memory. ``key_scores`` loads
``W x W`` blocks of key rows and transposes them in registers
(`elastic_np.cpu._tiles.transpose.transpose_width`), so that ``W`` keys' dot
products run along the SIMD lanes, one broadcast query entry a step.

As they read row ``c``, both hint row ``row + c`` of ``ahead = (whole, col,
row)`` into the L2 cache, one hint per cache line: the caller names there
the keys some way on (in a paged cache, on another page). A decode call reads
each key and value once, from memory, and the hints keep that read going
while the products compute (the hardware prefetchers do not follow the
key blocks' 16 interleaved rows, nor the pages).

The bits are those of the tile products (`elastic_np.cpu._tiles.products`):
every entry is ``c + a_0 b_0 + a_1 b_1 + ...`` in the order of the sum's
index with fused multiply-adds, ``st`` from 0 (`matmul_nn` of ``qs`` and the
transposed keys) and ``acc`` from its value (``matmul_nn(st, V, acc,
accumulate=True)``), whichever path computes it.
"""

import contextlib

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np import numpy_support

from elastic_np.cpu._runtime.numba_private import inner
from elastic_np.cpu._tiles.halves import storage_format, widen, widened
from elastic_np.cpu._tiles.quantized import HIDDEN_NAN, any_lane, byte_format, nan_bytes, widened as widened_bytes
from elastic_np.cpu._tiles.simd import LINE_BYTES, REGISTERS, constant_in_jit_code
from elastic_np.cpu._tiles.transpose import transpose_in_registers, transpose_width

#: The hints' cache level (``llvm.prefetch``'s locality; 2: L2).
_LOCALITY = 2

#: Rows whose sums `_key_chunk` interleaves, so that its fused multiply-adds do not wait on one another.
_KEY_ROWS = 4

#: Keys a block of `value_products` takes, so that its value rows stay in L1 over the row blocks.
_VALUE_KEYS = 16

#: Rows by vectors of ``acc`` a block of `value_products` keeps in registers (as the tile products' blocks).
_VALUE_ROWS = 4 if REGISTERS == 32 else 6
_VALUE_VECTORS = 4 if REGISTERS == 32 else 2

#: The sums may not be reordered: products and sums contract into fused multiply-adds, nothing else.
_CONTRACT = ("contract",)


@constant_in_jit_code
def line_entries(x):
    """Entries of dtype ``x`` (in jit code, of an array) in a cache line."""
    return LINE_BYTES // np.dtype(x).itemsize


def chunk_entries(x):
    """Entries of a key a `_key_chunk` multiplies: ``W``, or ``2 W`` for the bits of a half (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(chunk_entries, inline="always")
def _chunk_entries(x):
    if byte_format(x.dtype):  # a quantized cache: four bytes a 32-bit lane
        entries = 4 * transpose_width(np.float32)
    else:
        entries = 2 * transpose_width(np.float32) if storage_format(x.dtype) else transpose_width(
            numpy_support.as_dtype(x.dtype))
    return lambda x: entries


#: Entries a row of `key_scores`' queries must hold: ``D`` rounded up to the widest chunk (``4 W`` bytes).
_QUERY_ROUND = 4 * transpose_width(np.float32)


@inner(fastmath=False)
def query_width(D):
    """The row length of `key_scores`' ``qs`` for head dim ``D``, so that a row's tail is a masked chunk."""
    return -(-D // _QUERY_ROUND) * _QUERY_ROUND


@constant_in_jit_code
def key_block(x):
    """Keys (and entries of a key) in a block of `_key_chunk`, for compute dtype ``x`` (in jit code, an array)."""
    return transpose_width(x)


def _vector_type(context, dtype):
    """``(float size, vector type, width)`` of the compute dtype ``dtype`` (a Numba float type)."""
    flt = context.get_value_type(dtype)
    width = transpose_width(numpy_support.as_dtype(dtype))
    return context.get_abi_sizeof(flt), ir.VectorType(flt, width), width


def _first(builder, entries, n):
    """The mask of the first ``entries`` (a runtime ``intp``) of ``n`` lanes."""
    index_ty = ir.VectorType(entries.type, n)
    return builder.icmp_unsigned("<", ir.Constant(index_ty, list(range(n))), _splat(builder, entries, index_ty))


def _masked(builder, operation, vec_ty, entries):
    """``llvm.masked.load`` or ``.store`` of ``vec_ty`` and the mask of its first ``entries`` lanes."""
    element = {ir.IntType(8): "i8", ir.IntType(16): "i16", ir.FloatType(): "f32", ir.DoubleType(): "f64"}[vec_ty.element]
    mask = _first(builder, entries, vec_ty.count)
    ptr_ty, i32 = vec_ty.as_pointer(), ir.IntType(32)
    fnty = ir.FunctionType(vec_ty, [ptr_ty, i32, mask.type, vec_ty]) if operation == "load" else \
        ir.FunctionType(ir.VoidType(), [vec_ty, ptr_ty, i32, mask.type])
    return cgutils.get_or_insert_function(builder.module, fnty, f"llvm.masked.{operation}.v{vec_ty.count}{element}.p0"), mask


def _load_row(builder, ptr, vec_ty, align, entries=None):
    """The ``vec_ty`` at element pointer ``ptr``; with ``entries`` (a runtime ``intp``) its first ``entries`` lanes, zeros after (a masked load: nothing past them is read)."""
    vec_ptr = builder.bitcast(ptr, vec_ty.as_pointer())
    if entries is None:
        return builder.load(vec_ptr, align=align)
    fn, mask = _masked(builder, "load", vec_ty, entries)
    return builder.call(fn, [vec_ptr, ir.Constant(ir.IntType(32), align), mask, ir.Constant(vec_ty, None)])


def _store_row(builder, value, ptr, align, entries=None):
    """Store ``value`` at element pointer ``ptr``; with ``entries`` its first ``entries`` lanes only (nothing past them is written)."""
    vec_ptr = builder.bitcast(ptr, value.type.as_pointer())
    if entries is None:
        builder.store(value, vec_ptr, align=align)
        return
    fn, mask = _masked(builder, "store", value.type, entries)
    builder.call(fn, [value, vec_ptr, ir.Constant(ir.IntType(32), align), mask])


def _load_widened(builder, ptr, stored, vec_ty, align, entries=None, nan=True):
    """The ``vec_ty.count`` stored entries at element pointer ``ptr`` as a vector of ``vec_ty`` (``entries``: `_load_row`'s).

    ``stored``: the Numba type of the stored entries (a float of ``vec_ty``'s,
    or a half's bits, `storage_format`, or a quantized cache's bytes,
    `byte_format`; ``nan``: `widened_bytes`'); ``align`` the float's size.
    """
    half, byte = storage_format(stored), byte_format(stored)
    if byte is not None:
        return widened_bytes(builder, _load_row(builder, ptr, ir.VectorType(ir.IntType(8), vec_ty.count), 1, entries),
                             byte, nan)
    if half is None:
        return _load_row(builder, ptr, vec_ty, align, entries)
    return widened(builder, _load_row(builder, ptr, ir.VectorType(ir.IntType(16), vec_ty.count), 2, entries), half)


def _pair_widened(builder, pairs, stored):
    """The vectors of the low and of the high halves of ``pairs`` (32-bit lanes, each two stored halves), widened."""
    i32 = pairs.type
    sixteen = ir.Constant(i32, [16] * i32.count)
    half = storage_format(stored)
    if half == "float16":
        i16 = ir.VectorType(ir.IntType(16), i32.count)
        return [widened(builder, builder.trunc(x, i16), half) for x in (pairs, builder.lshr(pairs, sixteen))]
    # bfloat16: the high half of a float32, so each half moved there (the low one) or left there (the high one)
    low, high = builder.shl(pairs, sixteen), builder.and_(pairs, ir.Constant(i32, [-65536] * i32.count))
    return [builder.bitcast(x, ir.VectorType(ir.FloatType(), i32.count)) for x in (low, high)]


def _bytes_widened(builder, packs, fmt, nan):
    """The four vectors of the bytes of ``packs`` (32-bit lanes, each four stored bytes, lowest first), widened
    (``nan``: `widened_bytes`')."""
    i8 = ir.VectorType(ir.IntType(8), packs.type.count)
    return [widened_bytes(builder, builder.trunc(builder.lshr(packs, ir.Constant(packs.type, [8 * b] * packs.type.count)),
                                                 i8), fmt, nan) for b in range(4)]


def _matrices(*arrays):
    """Whether the arrays are 2-D and C-contiguous: the intrinsics address them from pointer and row length."""
    return all(isinstance(a, types.Array) and a.layout == "C" and a.ndim == 2 for a in arrays)


class _Matrix:
    """A 2-D C-contiguous array in codegen: its data pointer (from column ``col``) and row length."""

    def __init__(self, context, builder, ty, value, col=None):
        arr = context.make_array(ty)(context, builder, value)
        self.builder = builder
        self.data = arr.data if col is None else builder.gep(arr.data, [col], inbounds=True)
        self.lead = cgutils.unpack_tuple(builder, arr.shape, 2)[1]
        self.itemsize = context.get_abi_sizeof(context.get_data_type(ty.dtype))  # a record's data, not a pointer

    def at(self, row, col, inbounds=True):
        """The element pointer of ``[row, col]`` (``inbounds=False``: it may lie past the array, for a hint)."""
        index = self.builder.add(self.builder.mul(row, self.lead), col)
        return self.builder.gep(self.data, [index], inbounds=inbounds)

    def hint(self, row, col, entries):
        """Hint the lines of ``[row, col : col + entries]`` into the cache (``llvm.prefetch``: never faults)."""
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32])
        fn = cgutils.get_or_insert_function(self.builder.module, fnty, "llvm.prefetch.p0")
        start = self.at(row, col, inbounds=False)
        for offset in range(0, entries * self.itemsize, LINE_BYTES):
            ptr = self.builder.gep(start, [ir.Constant(row.type, offset // self.itemsize)])
            address = self.builder.bitcast(ptr, ir.IntType(8).as_pointer())
            # a read (0), into the cache level of _LOCALITY, data (1)
            self.builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, _LOCALITY), ir.Constant(i32, 1)])


def _splat(builder, value, vec_ty):
    undef = ir.Constant(vec_ty, ir.Undefined)
    first = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    lanes = ir.Constant(ir.VectorType(ir.IntType(32), vec_ty.count), [0] * vec_ty.count)
    return builder.shuffle_vector(first, undef, lanes)


def _constant(value, n):
    return ir.Constant(value.type, n)


def _make_key_chunk(masked):
    """Intrinsic ``S[r, c0 + i] += sum_j qs[r, p0 + j] K[c0 + i, p0 + j]`` for ``i < W``, ``j < E``, ``r < rows``, ``j`` in order.

    Its arguments are ``(qs, k, k_col, c0, p0, st, s_col, rows, a, a_col,
    a_row, hint)``, and with ``masked`` then ``entries``: ``K = k[:,
    k_col:]`` as stored, widened, and ``S = st[:, s_col:]``; the ``W`` key
    rows are loaded once and transposed in registers; with ``hint``, the
    lines of ``a[a_row + c0 + i, a_col + p0:]`` are hinted into the cache.
    ``E = chunk_entries(k)``: ``W`` entries of a float, ``2 W`` of a half,
    whose rows are transposed as pairs of halves (32-bit lanes, half the
    shuffles an entry) and widened after: the low half of each lane is entry
    ``p0 + 2 j``, the high half ``p0 + 2 j + 1``; ``4 W`` of a quantized
    cache's bytes, transposed as packs of four (a quarter of the shuffles),
    byte ``b`` of lane ``j`` entry ``p0 + 4 j + b``. ``masked``: only the first
    ``entries < E`` of each row are read and added (the tail of a row whose
    length is not a whole number of chunks), ``qs`` read to ``p0 + E``.
    """

    def codegen(context, builder, signature, args):
        qs_ty, k_ty, _, _, _, st_ty, _, _, a_ty = signature.args[:9]
        qs_v, k_v, k_col_v, c0_v, p0_v, st_v, s_col_v, rows_v, a_v, a_col_v, a_row_v, hint_v = args[:12]
        entries = args[12] if masked else None
        align, vec_ty, width = _vector_type(context, qs_ty.dtype)
        keys = _Matrix(context, builder, k_ty, k_v, k_col_v)
        ahead = _Matrix(context, builder, a_ty, a_v, a_col_v)
        queries = _Matrix(context, builder, qs_ty, qs_v)
        scores = _Matrix(context, builder, st_ty, st_v, s_col_v)
        byte = byte_format(k_ty.dtype)
        packed = 4 if byte else 2 if storage_format(k_ty.dtype) else 1  # stored entries a 32-bit lane
        lanes_ty = ir.VectorType(ir.IntType(32), width) if packed > 1 else vec_ty
        stored_ty = ir.VectorType(ir.IntType(32 // packed), packed * width) if packed > 1 else vec_ty
        loaded, ptr, nans = [], keys.at(c0_v, p0_v), None
        for _ in range(width):  # row after row, a step of the row length each: no address kept per row
            row = _load_row(builder, ptr, stored_ty, 4 // packed if packed > 1 else align, entries)
            if byte in HIDDEN_NAN:  # a NaN byte widens to a number: found on the whole row (a sum made NaN)
                found = nan_bytes(builder, row, byte)
                nans = found if nans is None else builder.or_(nans, found)
            loaded.append(builder.bitcast(row, lanes_ty))
            ptr = builder.gep(ptr, [keys.lead], inbounds=True)
        nan_found = None if nans is None else any_lane(builder, nans)
        with builder.if_then(hint_v):
            first = builder.add(a_row_v, c0_v)
            for i in range(width):
                ahead.hint(builder.add(first, _constant(first, i)), p0_v, packed * width)
        lanes = transpose_in_registers(builder, loaded)  # lanes[j][i]: K[c0 + i, p0 + j], or the pack from p0 + 2 j
        if byte:
            columns = [column for j in lanes for column in _bytes_widened(builder, j, byte, nan_found is None)]
        else:
            columns = [column for j in lanes for column in _pair_widened(builder, j, k_ty.dtype)] \
                if packed > 1 else lanes

        def rows_from(first, count):  # rows first .. first + count - 1, their sums' steps interleaved
            ptrs = [builder.bitcast(scores.at(builder.add(first, _constant(first, r)), c0_v), vec_ty.as_pointer())
                    for r in range(count)]
            totals = [cgutils.alloca_once(builder, vec_ty) for _ in range(count)]
            for ptr, total in zip(ptrs, totals):
                builder.store(builder.load(ptr, align=align), total)
            for j in range(len(columns)):
                entry = builder.add(p0_v, _constant(p0_v, j))
                # masked: no product past `entries` (even a zero one: 0 q added to -0 is +0)
                with builder.if_then(builder.icmp_signed("<", _constant(p0_v, j), entries)) if masked \
                        else contextlib.nullcontext():
                    for r in range(count):
                        q = builder.load(queries.at(builder.add(first, _constant(first, r)), entry))
                        product = builder.fmul(_splat(builder, q, vec_ty), columns[j], flags=_CONTRACT)
                        builder.store(builder.fadd(builder.load(totals[r]), product, flags=_CONTRACT), totals[r])
            for ptr, total in zip(ptrs, totals):
                total = builder.load(total)
                if nan_found is not None:
                    total = builder.select(nan_found, ir.Constant(vec_ty, [float("nan")] * width), total)
                builder.store(total, ptr, align=align)

        groups = builder.udiv(rows_v, _constant(rows_v, _KEY_ROWS))
        with cgutils.for_range(builder, groups) as loop:
            rows_from(builder.mul(loop.index, _constant(rows_v, _KEY_ROWS)), _KEY_ROWS)
        start = builder.mul(groups, _constant(rows_v, _KEY_ROWS))
        with cgutils.for_range_slice(builder, start, rows_v, _constant(rows_v, 1)) as (index, _):
            rows_from(index, 1)
        return context.get_dummy_value()

    intp = types.intp

    if masked:
        @intrinsic
        def chunk(typingctx, qs, k, k_col, c0, p0, st, s_col, rows, a, a_col, a_row, hint, entries):
            if not _matrices(qs, k, st, a):
                return None
            return types.void(qs, k, intp, intp, intp, st, intp, intp, a, intp, intp, types.boolean, intp), codegen
    else:
        @intrinsic
        def chunk(typingctx, qs, k, k_col, c0, p0, st, s_col, rows, a, a_col, a_row, hint):
            if not _matrices(qs, k, st, a):
                return None
            return types.void(qs, k, intp, intp, intp, st, intp, intp, a, intp, intp, types.boolean), codegen

    return chunk


_key_chunk = _make_key_chunk(False)
_key_tail = _make_key_chunk(True)


def _make_value_block(rows, vectors, masked=False):
    """Intrinsic ``acc[r0 + r, d0 + t W ...] += sum_c st[r0 + r, c0 + c] V[c0 + c, d0 + t W ...]`` for ``c < n``, in order.

    Its arguments are ``(st, s_col, v, v_col, acc, r0, c0, n, d0, a, a_col,
    a_row, hint)``, and with ``masked`` then ``entries``; ``st`` stands for
    ``st[:, s_col:]`` and ``V`` for ``v[:, v_col:]``, as stored, widened;
    ``rows x vectors`` vectors of ``acc`` stay in registers over the keys.
    With ``hint``, the lines of ``a[a_row + c0 + c, a_col + d0:]`` are
    hinted into the cache as value row ``c0 + c`` is read. ``masked`` (one
    vector): only the first ``entries < W`` columns of ``V`` and ``acc`` are
    read and written (a row's tail past its last whole vector).
    """

    def codegen(context, builder, signature, args):
        st_ty, _, v_ty, _, acc_ty, _, _, _, _, a_ty = signature.args[:10]
        st_v, s_col_v, v_v, v_col_v, acc_v, r0_v, c0_v, n_v, d0_v, a_v, a_col_v, a_row_v, hint_v = args[:13]
        entries = args[13] if masked else None
        align, vec_ty, width = _vector_type(context, st_ty.dtype)
        values = _Matrix(context, builder, v_ty, v_v, v_col_v)
        ahead = _Matrix(context, builder, a_ty, a_v, a_col_v)
        probs = _Matrix(context, builder, st_ty, st_v, s_col_v)
        out = _Matrix(context, builder, acc_ty, acc_v)

        def row(r):
            return builder.add(r0_v, _constant(r0_v, r))

        def column(t):
            return builder.add(d0_v, _constant(d0_v, t * width))

        def out_ptr(r, t):
            return out.at(row(r), column(t))

        accs = [[cgutils.alloca_once(builder, vec_ty) for _ in range(vectors)] for _ in range(rows)]
        for r in range(rows):
            for t in range(vectors):
                builder.store(_load_row(builder, out_ptr(r, t), vec_ty, align, entries), accs[r][t])
        byte = byte_format(v_ty.dtype)
        hidden = byte in HIDDEN_NAN  # a NaN byte widens to a number: found on the row's bytes, its sums made NaN
        wide_ty = ir.VectorType(ir.IntType(8), vectors * width)
        nans = cgutils.alloca_once_value(builder, ir.Constant(ir.VectorType(ir.IntType(1), vectors * width), None)) \
            if hidden else None
        with cgutils.for_range(builder, n_v) as loop:
            key = builder.add(c0_v, loop.index)
            loaded = [_load_widened(builder, values.at(key, column(t)), v_ty.dtype, vec_ty, align, entries, not hidden)
                      for t in range(vectors)]
            if hidden:
                found = nan_bytes(builder, _load_row(builder, values.at(key, column(0)), wide_ty, 1, entries), byte)
                builder.store(builder.or_(builder.load(nans), found), nans)
            with builder.if_then(hint_v):
                ahead.hint(builder.add(a_row_v, key), d0_v, vectors * width)
            for r in range(rows):
                p = _splat(builder, builder.load(probs.at(row(r), key)), vec_ty)
                for t in range(vectors):
                    product = builder.fmul(p, loaded[t], flags=_CONTRACT)
                    builder.store(builder.fadd(builder.load(accs[r][t]), product, flags=_CONTRACT), accs[r][t])
        nan_found = any_lane(builder, builder.load(nans)) if hidden else None
        for r in range(rows):
            for t in range(vectors):
                total = builder.load(accs[r][t])
                if hidden:
                    total = builder.select(nan_found, ir.Constant(vec_ty, [float("nan")] * width), total)
                _store_row(builder, total, out_ptr(r, t), align, entries)
        return context.get_dummy_value()

    intp = types.intp
    assert vectors == 1 or not masked

    if masked:
        @intrinsic
        def block(typingctx, st, s_col, v, v_col, acc, r0, c0, n, d0, a, a_col, a_row, hint, entries):
            if not _matrices(st, v, acc, a):
                return None
            return types.void(st, intp, v, intp, acc, intp, intp, intp, intp, a, intp, intp, types.boolean,
                              intp), codegen
    else:
        @intrinsic
        def block(typingctx, st, s_col, v, v_col, acc, r0, c0, n, d0, a, a_col, a_row, hint):
            if not _matrices(st, v, acc, a):
                return None
            return types.void(st, intp, v, intp, acc, intp, intp, intp, intp, a, intp, intp, types.boolean), codegen

    return block


_value_block = _make_value_block(_VALUE_ROWS, _VALUE_VECTORS)
_value_four = _make_value_block(4, _VALUE_VECTORS)
_value_two = _make_value_block(2, _VALUE_VECTORS)
_value_row = _make_value_block(1, _VALUE_VECTORS)
_value_vector = _make_value_block(_VALUE_ROWS, 1)
_value_one = _make_value_block(1, 1)
_value_tail = _make_value_block(_VALUE_ROWS, 1, masked=True)
_value_tail_one = _make_value_block(1, 1, masked=True)


@inner(fastmath={"contract"})
def key_scores(qs, k_tile, ahead, st, s_col, rows, bk, D):
    """``st[r, s_col + c] = qs[r, :D] . K[c, :D]`` for ``r < rows``, ``c < bk``, with ``K`` the rows of ``k_tile``.

    ``k_tile = (whole, col)``: ``K[c, d] = whole[c, col + d]``
    (`elastic_np.cpu._tiles.operands.head_rows`); ``ahead = (whole, col, row)``:
    the rows to hint (the module's docstring). Whole ``W x W`` blocks go
    through `_key_chunk` (the one that starts a cache line hinting), a row's
    entries past its last whole chunk through `_key_tail` when ``qs`` rows
    are `query_width` long (zeros past ``D``), else one at a time; the keys
    past the last whole block one at a time; each sum in the same order.
    """
    whole, col = k_tile
    a, a_col, a_row = ahead
    width = key_block(st)
    entries = chunk_entries(whole)
    bk_w = bk - bk % width
    d_w = D - D % entries
    tail = D - d_w
    line = line_entries(whole)
    # a row's tail as a masked chunk, if qs holds a chunk's entries there (zeros past D, `query_width`)
    vector_tail = tail > 0 and qs.shape[1] >= d_w + entries
    for r in range(rows):
        st[r, s_col : s_col + bk] = 0.0  # a slice: ``st[r, s_col + c]`` tests each index for wraparound
    for c0 in range(0, bk_w, width):
        for p0 in range(0, d_w, entries):
            _key_chunk(qs, whole, col, c0, p0, st, s_col, rows, a, a_col, a_row, p0 % line < entries)
        if vector_tail:
            _key_tail(qs, whole, col, c0, d_w, st, s_col, rows, a, a_col, a_row, d_w % line < entries, tail)
    for c in range(bk):
        key = whole[c, col : col + D]
        for p in range(0 if c >= bk_w else (D if vector_tail else d_w), D):
            x = widen(key[p])
            for r in range(rows):
                st[r, s_col + c] += qs[r, p] * x


@njit(inline="always", fastmath={"contract"})  # a call per block of keys and panel would cost more than it
def _value_panel(st, s_col, whole, col, acc, rows, keys, ahead):
    """`value_products`' block of keys ``keys = (c0, n, d0)`` over one panel of `_VALUE_VECTORS` vectors from
    column ``d0``, for every row: blocks of `_VALUE_ROWS` rows, then of 4 and 2 rows, then one, so that a few
    rows (4, the stacked rows of a common grouped-query decode) keep several sums in flight; the first block
    hints. Every sum is the same whichever block computes it.
    """
    c0, n, d0 = keys
    a, a_col, a_row = ahead
    rows_b = rows - rows % _VALUE_ROWS
    for r0 in range(0, rows_b, _VALUE_ROWS):
        _value_block(st, s_col, whole, col, acc, r0, c0, n, d0, a, a_col, a_row, r0 == 0)
    r = rows_b
    if _VALUE_ROWS > 4 and rows - r >= 4:
        _value_four(st, s_col, whole, col, acc, r, c0, n, d0, a, a_col, a_row, r == 0)
        r += 4
    if rows - r >= 2:
        _value_two(st, s_col, whole, col, acc, r, c0, n, d0, a, a_col, a_row, r == 0)
        r += 2
    if r < rows:
        _value_row(st, s_col, whole, col, acc, r, c0, n, d0, a, a_col, a_row, r == 0)


@inner(fastmath={"contract"})
def value_products(st, s_col, v_tile, ahead, acc, rows, bk, Dv):
    """``acc[r, :Dv] += st[r, s_col:s_col + bk] @ V[:bk, :Dv]`` for ``r < rows``, with ``V`` the rows of ``v_tile``.

    ``ahead``: the rows to hint, as `key_scores`'. Blocks of `_VALUE_KEYS`
    keys, each read from memory once for all the row blocks and column
    panels that use it (`_value_panel`); the columns past the last whole
    vector as one masked vector.
    """
    whole, col = v_tile
    a, a_col, a_row = ahead
    width = key_block(st)
    n_vec = Dv // width
    n_panel = n_vec - n_vec % _VALUE_VECTORS
    rows_b = rows - rows % _VALUE_ROWS
    for c0 in range(0, bk, _VALUE_KEYS):
        n = min(_VALUE_KEYS, bk - c0)
        for t0 in range(0, n_panel, _VALUE_VECTORS):
            _value_panel(st, s_col, whole, col, acc, rows, (c0, n, t0 * width), ahead)
        for t in range(n_panel, n_vec):
            d0 = t * width
            for r0 in range(0, rows_b, _VALUE_ROWS):
                _value_vector(st, s_col, whole, col, acc, r0, c0, n, d0, a, a_col, a_row, r0 == 0)
            for r in range(rows_b, rows):
                _value_one(st, s_col, whole, col, acc, r, c0, n, d0, a, a_col, a_row, r == 0)
        tail = Dv - n_vec * width
        if tail > 0:  # the columns past the last whole vector: one masked vector
            d0 = n_vec * width
            for r0 in range(0, rows_b, _VALUE_ROWS):
                _value_tail(st, s_col, whole, col, acc, r0, c0, n, d0, a, a_col, a_row, r0 == 0, tail)
            for r in range(rows_b, rows):
                _value_tail_one(st, s_col, whole, col, acc, r, c0, n, d0, a, a_col, a_row, r == 0, tail)
