"""Register-blocked matrix products of tiles, written as LLVM vector code.

``matmul_nn(a, a_col, b, b_col, c, m, n, k, accumulate)``
    ``c[:m, :n] (+)= A[:m, :k] @ B[:k, :n]``
``matmul_tn(a, a_col, b, b_col, c, m, n, k, accumulate)``
    ``c[:m, :n] (+)= A[:k, :m].T @ B[:k, :n]``
``matmul_nn_max(a, a_col, b, b_col, c, m, n, k, col_max, nonneg, accumulate)``
    ``c[:m, :n] (+)= A[:m, :k] @ B[:k, :n]`` and ``col_max[:n]`` raised to the
    column maxima of the new ``c[:m, :n]`` (of its entries ``>= 0``), in one pass

where ``A = a[:, a_col:]`` and ``B = b[:, b_col:]``: a factor is a block of
rows of a C-contiguous array starting at a column, its leading dimension
the array's row length (BLAS's ``lda``). So a tile of one head's rows of a
``(B, N, H, D)`` array, ``H * D`` entries apart, is read in place
(`elastic_np.cpu._tiles.operands`); a strided view is a typing error.

No BLAS (so no threads of their own): the micro-kernels keep a block of
``c`` in SIMD registers (AVX-512, AVX2 or SSE, whichever the host has, with
fused multiply-adds) over the ``k`` loop. The vectors run along the rows of
``b`` and ``c``; ``a`` is read one element at a time (broadcast) and may be
in either layout at no extra cost.
"""

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from elastic_np.cpu._tiles.simd import _DTYPES, _OPTIONS, REGISTERS, VECTOR_BYTES, _matrix, _typed


def _matmul_signature(dtype, *flags):
    ro, rw, intp = _matrix(dtype, readonly=True), _matrix(dtype), types.intp
    return types.void(ro, intp, ro, intp, rw, intp, intp, intp, *flags)


_MATMUL_SIGNATURES = [_matmul_signature(dtype, types.boolean) for dtype in _DTYPES]


@njit(inline="always")
def _a_at(a, a_col, row, col, transposed):
    """``A[row, col]`` with ``A = a[:, a_col:]``, or ``A[col, row]`` when ``a`` holds the transpose."""
    return a[col, a_col + row] if transposed else a[row, a_col + col]


#: Micro-kernel block: rows of c by vectors of c kept in registers over the k loop.
#: With 16 registers, 6 x 2 accumulators (the usual AVX2 shape) leave 4 for
#: the b vectors and the broadcast, as AVX2 matrix-multiply kernels do.
_MR = 4 if REGISTERS == 32 else 6


_NR = 4 if REGISTERS == 32 else 2


def _make_block(rows, vectors, transposed, with_max=False, nonneg=False):
    """Intrinsic ``c[i:i+rows, j:j+vectors*W] += A[i:i+rows, :k] @ B[:k, j:j+vectors*W]``.

    Its arguments are ``(a, a_col, b, b_col, c, i, j, k)``: ``A`` is
    ``a[:, a_col:]`` or its transpose (``transposed``), ``B = b[:, b_col:]``,
    each read with its array's row length as the leading dimension; ``W`` is
    the number of elements of the dtype in a SIMD register. The ``rows * vectors`` vectors of
    ``c`` are loaded once, updated by fused multiply-adds in registers over
    the whole ``k`` loop (one broadcast element of ``A`` per row and one
    vector of ``b`` per column chunk at each step) and stored once.
    ``with_max`` adds an argument ``col_max`` (1-D) after ``k``: each column's
    ``col_max[j']`` is then replaced by ``c[i', j']`` wherever that is
    greater (and, with ``nonneg``, ``>= 0``), over the block's rows in order,
    from the registers.
    """

    def codegen(context, builder, signature, args):
        a_ty, b_ty, c_ty = signature.args[0], signature.args[2], signature.args[4]
        a_val, a_col, b_val, b_col, c_val, i_val, j_val, k_val = args[:8]
        ir_float = context.get_value_type(a_ty.dtype)
        width = VECTOR_BYTES // context.get_abi_sizeof(ir_float)
        vec_ty = ir.VectorType(ir_float, width)
        align = context.get_abi_sizeof(ir_float)
        intp = context.get_value_type(types.intp)
        flags = ("contract",)

        def data_and_lead(ty, val, col=None):
            arr = context.make_array(ty)(context, builder, val)
            shape = cgutils.unpack_tuple(builder, arr.shape, 2)
            data = arr.data if col is None else builder.gep(arr.data, [col], inbounds=True)
            return data, shape[1]

        a_ptr, a_lead = data_and_lead(a_ty, a_val, a_col)
        b_ptr, b_lead = data_and_lead(b_ty, b_val, b_col)
        c_ptr, c_lead = data_and_lead(c_ty, c_val)

        def element_ptr(ptr, lead, row, col):
            index = builder.add(builder.mul(row, lead), col)
            return builder.gep(ptr, [index], inbounds=True)

        def vector_ptr(ptr, lead, row, col):
            return builder.bitcast(element_ptr(ptr, lead, row, col), vec_ty.as_pointer())

        def column(t):
            return builder.add(j_val, ir.Constant(intp, t * width))

        def row(r):
            return builder.add(i_val, ir.Constant(intp, r))

        accs = [
            [cgutils.alloca_once(builder, vec_ty) for _ in range(vectors)] for _ in range(rows)
        ]
        for r in range(rows):
            for t in range(vectors):
                value = builder.load(vector_ptr(c_ptr, c_lead, row(r), column(t)), align=align)
                builder.store(value, accs[r][t])
        zero_vec = ir.Constant(vec_ty, ir.Undefined)
        zero_idx = ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width)
        with cgutils.for_range(builder, k_val) as loop:
            p = loop.index
            b_vecs = [
                builder.load(vector_ptr(b_ptr, b_lead, p, column(t)), align=align)
                for t in range(vectors)
            ]
            for r in range(rows):
                if transposed:
                    a_elem = builder.load(element_ptr(a_ptr, a_lead, p, row(r)))
                else:
                    a_elem = builder.load(element_ptr(a_ptr, a_lead, row(r), p))
                splat = builder.shuffle_vector(
                    builder.insert_element(zero_vec, a_elem, ir.Constant(ir.IntType(32), 0)),
                    zero_vec, zero_idx,
                )
                for t in range(vectors):
                    acc = builder.load(accs[r][t])
                    product = builder.fmul(splat, b_vecs[t], flags=flags)
                    builder.store(builder.fadd(acc, product, flags=flags), accs[r][t])
        for r in range(rows):
            for t in range(vectors):
                ptr = vector_ptr(c_ptr, c_lead, row(r), column(t))
                builder.store(builder.load(accs[r][t]), ptr, align=align)
        if with_max:
            max_arr = context.make_array(signature.args[8])(context, builder, args[8])
            for t in range(vectors):
                ptr = builder.bitcast(
                    builder.gep(max_arr.data, [column(t)], inbounds=True), vec_ty.as_pointer()
                )
                current = builder.load(ptr, align=align)
                for r in range(rows):
                    value = builder.load(accs[r][t])
                    greater = builder.fcmp_ordered(">", value, current)
                    if nonneg:
                        zero = ir.Constant(vec_ty, [0.0] * width)
                        greater = builder.and_(greater, builder.fcmp_ordered(">=", value, zero))
                    current = builder.select(greater, value, current)
                builder.store(current, ptr, align=align)
        return context.get_dummy_value()

    intp = types.intp
    if with_max:

        @intrinsic
        def block(typingctx, a, a_col, b, b_col, c, i, j, k, col_max):
            return types.void(a, intp, b, intp, c, intp, intp, intp, col_max), codegen

    else:

        @intrinsic
        def block(typingctx, a, a_col, b, b_col, c, i, j, k):
            return types.void(a, intp, b, intp, c, intp, intp, intp), codegen

    return block


_BLOCKS = {
    (rows, vectors, transposed): _make_block(rows, vectors, transposed)
    for rows in (_MR, 1)
    for vectors in (_NR, 1)
    for transposed in (False, True)
}


# Leftover rows of c in blocks of 4 and 2 (of 1, each block's k loop would be
# one chain of dependent fused multiply-adds per vector: latency-bound).
_block_nn_r4 = _make_block(4, _NR, False)


_block_nn_r2 = _make_block(2, _NR, False)


_block_tn_r4 = _make_block(4, _NR, True)


_block_tn_r2 = _make_block(2, _NR, True)


_block_nn = _BLOCKS[_MR, _NR, False]


_block_nn_r1 = _BLOCKS[1, _NR, False]


_block_nn_v1 = _BLOCKS[_MR, 1, False]


_block_nn_r1_v1 = _BLOCKS[1, 1, False]


_block_tn = _BLOCKS[_MR, _NR, True]


_block_tn_r1 = _BLOCKS[1, _NR, True]


_block_tn_v1 = _BLOCKS[_MR, 1, True]


_block_tn_r1_v1 = _BLOCKS[1, 1, True]


_block_nn_max = _make_block(_MR, _NR, False, with_max=True)


_block_nn_max_nonneg = _make_block(_MR, _NR, False, with_max=True, nonneg=True)


def _vector_width(x):
    """Elements of the dtype of the array ``x`` in one SIMD register (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_vector_width, inline="always")
def _vector_width_overload(x):
    if isinstance(x, types.Array):
        width = VECTOR_BYTES * 8 // x.dtype.bitwidth
        return lambda x: width
    return None


# One signature per dtype for the body the three products share: called with
# the constants True, False and 0, it would compile once for each.
_MATMUL_BODY_SIGNATURES = [
    _matmul_signature(dtype, types.boolean, types.boolean, types.Array(dtype, 1, "C"), types.intp)
    for dtype in _DTYPES
]


@_typed(_MATMUL_BODY_SIGNATURES, **_OPTIONS)
def _matmul(a, a_col, b, b_col, c, m, n, k, accumulate, transposed, col_max, max_mode):
    """``c[:m, :n] (+)= A @ B[:k, :n]`` with ``A = a[:m, a_col:a_col + k]`` or ``a[:k, a_col:a_col + m].T``,
    ``B = b[:, b_col:]``.

    With ``max_mode`` 1 (2) and not ``transposed``, also ``col_max[j] = c[i, j]``
    wherever that is greater (and ``>= 0``), over ``i`` in order (see
    `matmul_nn_max`); 0: no maxima.

    Register blocking: blocks of ``_MR`` rows by ``_NR`` SIMD vectors of ``c``
    stay in registers over the whole ``k`` loop (see `_make_block`), with
    column panels outermost so that the panel of ``b`` stays in cache while
    the rows of ``A`` stream past. Leftover rows use blocks of 4, 2 and 1
    rows, leftover vectors blocks of one vector; the columns past the last
    whole vector, a scalar loop.
    Every element is ``c + a_0 b_0 + a_1 b_1 + ...`` in the order of ``k``,
    with fused multiply-adds, whichever path computes it.
    """
    if not accumulate:
        for i in range(m):
            ci = c[i]
            for j in range(n):
                ci[j] = 0.0
    width = _vector_width(c)
    n_vec = n // width
    n_panel = n_vec - n_vec % _NR
    m_block = m - m % _MR
    for jv in range(0, n_panel, _NR):
        j = jv * width
        for i in range(0, m_block, _MR):
            if transposed:
                _block_tn(a, a_col, b, b_col, c, i, j, k)
            elif max_mode == 1:
                _block_nn_max(a, a_col, b, b_col, c, i, j, k, col_max)
            elif max_mode == 2:
                _block_nn_max_nonneg(a, a_col, b, b_col, c, i, j, k, col_max)
            else:
                _block_nn(a, a_col, b, b_col, c, i, j, k)
        i = m_block
        if _MR > 4 and i + 4 <= m:
            if transposed:
                _block_tn_r4(a, a_col, b, b_col, c, i, j, k)
            else:
                _block_nn_r4(a, a_col, b, b_col, c, i, j, k)
            i += 4
        if i + 2 <= m:
            if transposed:
                _block_tn_r2(a, a_col, b, b_col, c, i, j, k)
            else:
                _block_nn_r2(a, a_col, b, b_col, c, i, j, k)
            i += 2
        for i in range(i, m):
            if transposed:
                _block_tn_r1(a, a_col, b, b_col, c, i, j, k)
            else:
                _block_nn_r1(a, a_col, b, b_col, c, i, j, k)
    for jv in range(n_panel, n_vec):
        j = jv * width
        for i in range(0, m_block, _MR):
            if transposed:
                _block_tn_v1(a, a_col, b, b_col, c, i, j, k)
            else:
                _block_nn_v1(a, a_col, b, b_col, c, i, j, k)
        for i in range(m_block, m):
            if transposed:
                _block_tn_r1_v1(a, a_col, b, b_col, c, i, j, k)
            else:
                _block_nn_r1_v1(a, a_col, b, b_col, c, i, j, k)
    j_tail = n_vec * width
    if j_tail < n:
        for i in range(m):
            ci = c[i]
            for p in range(k):
                aip = _a_at(a, a_col, i, p, transposed)
                for j in range(j_tail, n):
                    ci[j] += aip * b[p, b_col + j]
    if max_mode != 0:
        # what the register blocks left: their columns' leftover rows, then
        # every row of the other columns
        nonneg = max_mode == 2
        j_panel = n_panel * width
        for i in range(m_block, m):
            ci = c[i]
            for j in range(j_panel):
                x = ci[j]
                col_max[j] = x if (x > col_max[j] and (x >= 0 or not nonneg)) else col_max[j]
        for i in range(m):
            ci = c[i]
            for j in range(j_panel, n):
                x = ci[j]
                col_max[j] = x if (x > col_max[j] and (x >= 0 or not nonneg)) else col_max[j]


@_typed(_MATMUL_SIGNATURES, cache=True, fastmath=False, needs=(_matmul,))
def matmul_nn(a, a_col, b, b_col, c, m, n, k, accumulate):
    """Tile product ``c[:m, :n] (+)= a[:m, a_col:a_col + k] @ b[:k, b_col:b_col + n]``.

    Parameters
    ----------
    a : ndarray, shape (>= m, >= a_col + k)
        Left factor.
    a_col : int
        Column of ``a`` where the factor starts.
    b : ndarray, shape (>= k, >= b_col + n)
        Right factor.
    b_col : int
        Column of ``b`` where the factor starts.
    c : ndarray, shape (>= m, >= n)
        Output block, written in place; the rest of ``c`` is left alone.
        Must not overlap ``a`` or ``b``.
    m, n, k : int
        Block sizes (``k = 0`` gives a zero product).
    accumulate : bool
        Add the product to ``c[:m, :n]`` if true, overwrite it otherwise.

    Notes
    -----
    ``a``, ``b``, ``c`` are 2-D C-contiguous arrays of one dtype (float32 or
    float64); a factor's rows are its array's rows, whatever its column
    (the leading dimension is the array's row length). Single-threaded.
    Each element of ``c`` is ``c + a_0 b_0 + a_1 b_1 + ...`` in the order of
    ``k`` (fused multiply-adds where the CPU has them), whatever its position
    in the block or the factors' columns, so the result matches ``a @ b``
    within the usual ``k * eps`` bound (not bit for bit) and depends on the
    factors' values only: repeated calls give identical bits.

    See Also
    --------
    matmul_tn
    """
    _matmul(a, a_col, b, b_col, c, m, n, k, accumulate, False, c.reshape(c.size), 0)


@_typed(_MATMUL_SIGNATURES, cache=True, fastmath=False, needs=(_matmul,))
def matmul_tn(a, a_col, b, b_col, c, m, n, k, accumulate):
    """Tile product ``c[:m, :n] (+)= a[:k, a_col:a_col + m].T @ b[:k, b_col:b_col + n]``.

    Parameters
    ----------
    a : ndarray, shape (>= k, >= a_col + m)
        Left factor, stored transposed.
    a_col : int
        Column of ``a`` where the factor starts.
    b : ndarray, shape (>= k, >= b_col + n)
        Right factor.
    b_col : int
        Column of ``b`` where the factor starts.
    c : ndarray, shape (>= m, >= n)
        Output block, written in place; the rest of ``c`` is left alone.
        Must not overlap ``a`` or ``b``.
    m, n, k : int
        Block sizes (``k = 0`` gives a zero product).
    accumulate : bool
        Add the product to ``c[:m, :n]`` if true, overwrite it otherwise.

    Notes
    -----
    As `matmul_nn`, and just as fast: ``a`` is only read element by element
    outside the vectorised loop. This is the product of the backward pass
    (``dV += P^T dO``, ``dK += dS^T Q``) without transposing ``P`` or ``dS``.

    See Also
    --------
    matmul_nn
    """
    _matmul(a, a_col, b, b_col, c, m, n, k, accumulate, True, c.reshape(c.size), 0)


_MATMUL_MAX_SIGNATURES = [
    _matmul_signature(dtype, types.Array(dtype, 1, "C"), types.boolean, types.boolean) for dtype in _DTYPES
]


@_typed(_MATMUL_MAX_SIGNATURES, cache=True, fastmath=False, needs=(_matmul,))
def matmul_nn_max(a, a_col, b, b_col, c, m, n, k, col_max, nonneg, accumulate):
    """Tile product ``c[:m, :n] (+)= a[:m, a_col:a_col + k] @ b[:k, b_col:b_col + n]`` and its column maxima.

    Parameters
    ----------
    a, a_col, b, b_col, c, m, n, k, accumulate
        As in `matmul_nn`.
    col_max : ndarray, shape (>= n,)
        ``col_max[j]`` is replaced by ``c[i, j]`` wherever that is greater,
        for ``i`` from 0 to ``m - 1`` in order; NaN entries of ``c`` are
        passed over.
    nonneg : bool
        Only entries ``>= 0`` count (the maxima of the logits under NVM,
        which removes negative scores).

    Notes
    -----
    ``c`` has the bits of `matmul_nn` and ``col_max`` those of the loop
    ``col_max[j] = x if x > col_max[j] else col_max[j]`` (``x > col_max[j]
    and x >= 0`` with ``nonneg``) over the rows of the
    product afterwards; most of the maxima are taken while the block is still
    in registers, which saves that pass over ``c`` (the scores of a forward
    tile, whose column maxima are the new running maxima).

    See Also
    --------
    matmul_nn
    """
    _matmul(a, a_col, b, b_col, c, m, n, k, accumulate, False, col_max, 2 if nonneg else 1)
