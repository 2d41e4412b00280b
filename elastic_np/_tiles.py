"""Single-threaded tile primitives for the Numba CPU attention kernels.

Small dense building blocks that the kernels of `elastic_np.cpu` call once
per tile, inside a task that one thread runs. They use no
BLAS (so they never start threads of their own): the products are register-
blocked micro-kernels written as LLVM vector code (AVX-512, AVX2 or SSE,
whichever the host has, with fused multiply-adds), the rest are loops that
LLVM vectorises:

``matmul_nn(a, b, c, m, n, k, accumulate)``
    ``c[:m, :n] (+)= a[:m, :k] @ b[:k, :n]``
``matmul_tn(a, b, c, m, n, k, accumulate)``
    ``c[:m, :n] (+)= a[:k, :m].T @ b[:k, :n]``
``matmul_nn_max(a, b, c, m, n, k, col_max, nonneg, accumulate)``
    ``c[:m, :n] (+)= a[:m, :k] @ b[:k, :n]`` and ``col_max[:n]`` raised to the
    column maxima of the new ``c[:m, :n]`` (of its entries ``>= 0``), in one pass
``exp_inplace(x, m, n)``
    ``x[:m, :n] = exp(x[:m, :n])``, with ``exp(-inf) = 0``
``exp_shift_sum(x, m, n, shift, nvm, sums)``
    ``x[:m, :n] = exp(x[:m, :n] - shift[:n])`` (0 where NVM removes the
    entry) and ``sums[:n] += x[:m, :n].sum(axis=0)``, in one pass

All arrays are 2-D, C-contiguous and of one dtype (float32 or float64); they may
be larger than the block used, which is always the top-left corner (the row
length of the array is its leading dimension). Each function is compiled for
explicit signatures, one per dtype, when `compile_for` is first called for that
dtype (or loaded from the cache): a float32 caller never waits for the float64
versions. Sizes and ``accumulate`` are runtime arguments, the factors
``a`` and ``b`` may be read-only, and any other layout (a column slice, for
instance) is a typing error rather than a slower extra specialisation.

The vectors run along the rows of ``b``, ``c`` and ``x`` (contiguous), so the
tiles are fastest with ``n`` a multiple of the SIMD width (16 float32 or 8
float64 elements with AVX-512) and ``n >= 64``; ``a`` is read one element at a
time (broadcast) and may be in either layout at no extra cost.
"""

import math
import platform
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.np import numpy_support
from numba.extending import intrinsic, overload

__all__ = [
    "compile_for", "matmul_nn", "matmul_tn", "matmul_nn_max", "exp_inplace", "exp_shift_sum", "tanh_inplace",
    "tanh_any", "prefetch", "transpose_add", "transpose_load", "transpose_store",
    "transpose_stream", "stream_fence", "transpose_accumulate", "transpose_width", "stream_width",
]

# Only contraction of a*b+c into fused multiply-adds is allowed: IEEE inf/NaN
# semantics and the written order of every sum are kept (full fastmath=True
# measured no faster for the matmuls, and would let LLVM reorder the exponential's
# Cody-Waite reduction).
_OPTIONS = dict(cache=True, fastmath={"contract"}, boundscheck=False, error_model="numpy")

# Explicit signatures: exactly one compiled version per dtype, whatever the
# caller passes (literal True/False or sizes, int32 sizes, read-only factors),
# and a clear typing error for anything that is not a 2-D C-contiguous array.
_DTYPES = (types.float32, types.float64)


def _matrix(dtype, readonly=False):
    return types.Array(dtype, 2, "C", readonly=readonly)


def _matmul_signature(dtype, *flags):
    ro, rw = _matrix(dtype, readonly=True), _matrix(dtype)
    return types.void(ro, ro, rw, types.intp, types.intp, types.intp, *flags)


#: The functions with explicit signatures: (dispatcher, signatures, typed callees); see `compile_for`.
_TYPED = []
_COMPILED = set()  # (dtype, dispatcher)
_READY = set()  # (dtype, functions) of the compile_for calls done
_COMPILE_LOCK = threading.Lock()


def _typed(signatures, needs=(), **options):
    """``njit(signatures, **options)``, each dtype's signatures compiled by `compile_for`.

    ``needs``: the typed functions it calls, compiled before it. After its
    first `compile_for` the dispatcher compiles nothing else: a call with
    other types is a typing error, as with eager signatures.
    """

    def wrap(fn):
        dispatcher = njit(**options)(fn)
        _TYPED.append((dispatcher, list(signatures), tuple(needs)))
        return dispatcher

    return wrap


def compile_for(dtype, functions=None):
    """Compile (or load from the cache) the signatures of ``dtype`` of the tile functions.

    ``functions``: a tuple of the typed tile functions a caller uses (what they call
    comes with them); all of them by default. Call it before the first
    compiled caller of that dtype is typed (the CPU backend's entry points
    do, each for what its kernels call); cheap once done.
    """
    key = (np.dtype(dtype), functions)
    if key in _READY:
        return
    dtype = key[0]
    wanted = {d for d, _, _ in _TYPED} if functions is None else set(functions)
    element = numpy_support.from_dtype(dtype)
    with _COMPILE_LOCK:
        for dispatcher, signatures, needs in reversed(_TYPED):  # what a function needs is defined before it
            if dispatcher in wanted:
                wanted.update(needs)
        for dispatcher, signatures, _ in _TYPED:  # in definition order: callees first
            if dispatcher not in wanted or (dtype, dispatcher) in _COMPILED:
                continue
            mine = [s for s in signatures if s.args[0].dtype == element]
            if mine:
                dispatcher.disable_compile(False)
                try:
                    for signature in mine:
                        dispatcher.compile(signature)
                finally:
                    dispatcher.disable_compile()
            _COMPILED.add((dtype, dispatcher))
        _READY.add(key)


_MATMUL_SIGNATURES = [_matmul_signature(dtype, types.boolean) for dtype in _DTYPES]
_EXP_SIGNATURES = {dtype: types.void(_matrix(dtype), types.intp, types.intp) for dtype in _DTYPES}


# ---------------------------------------------------------------------------
# Matrix products
# ---------------------------------------------------------------------------


@njit(inline="always")
def _a_at(a, row, col, transposed):
    """``a[row, col]``, or ``a[col, row]`` when ``a`` holds the transpose."""
    return a[col, row] if transposed else a[row, col]


def _target_features():
    """The CPU features LLVM compiles for: ``{"avx512f", "avx2", "fma", ...}``."""
    from numba.core import config
    from llvmlite import binding

    if config.CPU_NAME is not None:  # a portable cache: only the features named
        return {f[1:] for f in (config.CPU_FEATURES or "").split(",") if f.startswith("+")}
    return {name for name, on in binding.get_host_cpu_features().items() if on}


def _vector_bytes(features):
    """Bytes of the widest SIMD register LLVM targets (64, 32 or 16)."""
    if "avx512f" in features:
        return 64
    return 32 if "avx2" in features or "avx" in features else 16


_FEATURES = _target_features()
#: Whether products and sums fuse into one rounding (the exp and tanh error bounds depend on it).
HAS_FMA = "fma" in _FEATURES
#: SIMD register width in bytes and the register count that sizes the blocks.
_VECTOR_BYTES = _vector_bytes(_FEATURES)
_REGISTERS = 32 if _VECTOR_BYTES == 64 else 16
#: Micro-kernel block: rows of c by vectors of c kept in registers over the k loop.
#: With 16 registers, 6 x 2 accumulators (the usual AVX2 shape) leave 4 for
#: the b vectors and the broadcast, as AVX2 matrix-multiply kernels do.
_MR = 4 if _REGISTERS == 32 else 6
_NR = 4 if _REGISTERS == 32 else 2


def _make_block(rows, vectors, transposed, with_max=False, nonneg=False):
    """Intrinsic ``c[i:i+rows, j:j+vectors*W] += A[i:i+rows, :k] @ b[:k, j:j+vectors*W]``.

    ``W`` is the number of elements of the dtype in a SIMD register and ``A``
    is ``a`` or ``a.T`` (``transposed``). The ``rows * vectors`` vectors of
    ``c`` are loaded once, updated by fused multiply-adds in registers over
    the whole ``k`` loop (one broadcast element of ``A`` per row and one
    vector of ``b`` per column chunk at each step) and stored once.
    ``with_max`` adds an argument ``col_max`` (1-D) after ``k``: each column's
    ``col_max[j']`` is then replaced by ``c[i', j']`` wherever that is
    greater (and, with ``nonneg``, ``>= 0``), over the block's rows in order,
    from the registers.
    """

    def codegen(context, builder, signature, args):
        a_ty, b_ty, c_ty = signature.args[:3]
        a_val, b_val, c_val, i_val, j_val, k_val = args[:6]
        ir_float = context.get_value_type(a_ty.dtype)
        width = _VECTOR_BYTES // context.get_abi_sizeof(ir_float)
        vec_ty = ir.VectorType(ir_float, width)
        align = context.get_abi_sizeof(ir_float)
        intp = context.get_value_type(types.intp)
        flags = ("contract",)

        def data_and_lead(ty, val):
            arr = context.make_array(ty)(context, builder, val)
            shape = cgutils.unpack_tuple(builder, arr.shape, 2)
            return arr.data, shape[1]

        a_ptr, a_lead = data_and_lead(a_ty, a_val)
        b_ptr, b_lead = data_and_lead(b_ty, b_val)
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
            max_arr = context.make_array(signature.args[6])(context, builder, args[6])
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

    if with_max:

        @intrinsic
        def block(typingctx, a, b, c, i, j, k, col_max):
            return types.void(a, b, c, types.intp, types.intp, types.intp, col_max), codegen

    else:

        @intrinsic
        def block(typingctx, a, b, c, i, j, k):
            return types.void(a, b, c, types.intp, types.intp, types.intp), codegen

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
        width = _VECTOR_BYTES * 8 // x.dtype.bitwidth
        return lambda x: width
    return None


# One signature per dtype for the body the three products share: called with
# the constants True, False and 0, it would compile once for each.
_MATMUL_BODY_SIGNATURES = [
    _matmul_signature(dtype, types.boolean, types.boolean, types.Array(dtype, 1, "C"), types.intp)
    for dtype in _DTYPES
]


@_typed(_MATMUL_BODY_SIGNATURES, **_OPTIONS)
def _matmul(a, b, c, m, n, k, accumulate, transposed, col_max, max_mode):
    """``c[:m, :n] (+)= A @ b[:k, :n]`` with ``A = a[:m, :k]`` or ``a[:k, :m].T``.

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
                _block_tn(a, b, c, i, j, k)
            elif max_mode == 1:
                _block_nn_max(a, b, c, i, j, k, col_max)
            elif max_mode == 2:
                _block_nn_max_nonneg(a, b, c, i, j, k, col_max)
            else:
                _block_nn(a, b, c, i, j, k)
        i = m_block
        if _MR > 4 and i + 4 <= m:
            if transposed:
                _block_tn_r4(a, b, c, i, j, k)
            else:
                _block_nn_r4(a, b, c, i, j, k)
            i += 4
        if i + 2 <= m:
            if transposed:
                _block_tn_r2(a, b, c, i, j, k)
            else:
                _block_nn_r2(a, b, c, i, j, k)
            i += 2
        for i in range(i, m):
            if transposed:
                _block_tn_r1(a, b, c, i, j, k)
            else:
                _block_nn_r1(a, b, c, i, j, k)
    for jv in range(n_panel, n_vec):
        j = jv * width
        for i in range(0, m_block, _MR):
            if transposed:
                _block_tn_v1(a, b, c, i, j, k)
            else:
                _block_nn_v1(a, b, c, i, j, k)
        for i in range(m_block, m):
            if transposed:
                _block_tn_r1_v1(a, b, c, i, j, k)
            else:
                _block_nn_r1_v1(a, b, c, i, j, k)
    j_tail = n_vec * width
    if j_tail < n:
        for i in range(m):
            ci = c[i]
            for p in range(k):
                aip = _a_at(a, i, p, transposed)
                bp = b[p]
                for j in range(j_tail, n):
                    ci[j] += aip * bp[j]
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


@_typed(_MATMUL_SIGNATURES, cache=True, needs=(_matmul,))
def matmul_nn(a, b, c, m, n, k, accumulate):
    """Tile product ``c[:m, :n] (+)= a[:m, :k] @ b[:k, :n]``.

    Parameters
    ----------
    a : ndarray, shape (>= m, >= k)
        Left factor.
    b : ndarray, shape (>= k, >= n)
        Right factor.
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
    float64). Single-threaded. Each element of ``c`` is ``c + a_0 b_0 + a_1 b_1
    + ...`` in the order of ``k`` (fused multiply-adds where the CPU has them),
    whatever its position in the block, so the result matches
    ``a @ b`` within the usual ``k * eps`` bound (not bit for bit) and depends
    on the inputs only: repeated calls give identical bits.

    See Also
    --------
    matmul_tn
    """
    _matmul(a, b, c, m, n, k, accumulate, False, c.reshape(c.size), 0)


@_typed(_MATMUL_SIGNATURES, cache=True, needs=(_matmul,))
def matmul_tn(a, b, c, m, n, k, accumulate):
    """Tile product ``c[:m, :n] (+)= a[:k, :m].T @ b[:k, :n]``.

    Parameters
    ----------
    a : ndarray, shape (>= k, >= m)
        Left factor, stored transposed.
    b : ndarray, shape (>= k, >= n)
        Right factor.
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
    _matmul(a, b, c, m, n, k, accumulate, True, c.reshape(c.size), 0)


_MATMUL_MAX_SIGNATURES = [
    types.void(
        _matrix(dtype, readonly=True), _matrix(dtype, readonly=True), _matrix(dtype),
        types.intp, types.intp, types.intp, types.Array(dtype, 1, "C"), types.boolean,
        types.boolean,
    )
    for dtype in _DTYPES
]


@_typed(_MATMUL_MAX_SIGNATURES, cache=True, needs=(_matmul,))
def matmul_nn_max(a, b, c, m, n, k, col_max, nonneg, accumulate):
    """Tile product ``c[:m, :n] (+)= a[:m, :k] @ b[:k, :n]`` and its column maxima.

    Parameters
    ----------
    a, b, c, m, n, k, accumulate
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
    _matmul(a, b, c, m, n, k, accumulate, False, col_max, 2 if nonneg else 1)


# ---------------------------------------------------------------------------
# Exponential
# ---------------------------------------------------------------------------


@intrinsic
def _float_from_bits(typingctx, bits):
    """Reinterpret the bits of an int64 (int32) as a float64 (float32)."""
    if bits == types.int64:
        sig, llvm_type = types.float64(types.int64), ir.DoubleType()
    elif bits == types.int32:
        sig, llvm_type = types.float32(types.int32), ir.FloatType()
    else:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_type)

    return sig, codegen


@intrinsic
def _float_bits(typingctx, x):
    """The bits of a float64 (float32) as an int64 (int32): the inverse of `_float_from_bits`."""
    if x == types.float64:
        sig, llvm_type = types.int64(types.float64), ir.IntType(64)
    elif x == types.float32:
        sig, llvm_type = types.int32(types.float32), ir.IntType(32)
    else:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_type)

    return sig, codegen


@intrinsic
def _ldexp(typingctx, x, n):
    """``x * 2**n`` rounded once (``llvm.ldexp``), float32 or float64 ``x``, int32 ``n``."""
    if x not in (types.float32, types.float64) or n != types.int32:
        return None
    sig = x(x, types.int32)

    def codegen(context, builder, signature, args):
        llvm_type = context.get_value_type(signature.args[0])
        name = "llvm.ldexp.f32.i32" if signature.args[0] == types.float32 else "llvm.ldexp.f64.i32"
        fnty = ir.FunctionType(llvm_type, [llvm_type, ir.IntType(32)])
        return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)

    return sig, codegen


#: ``llvm.ldexp`` compiles to one vectorised instruction (vscalefps/pd) with
#: AVX-512; elsewhere it may become a library call per element, so the
#: exponential builds its power of two from exponent fields instead.
_HAS_VECTOR_LDEXP = _VECTOR_BYTES == 64


@njit(**_OPTIONS)
def _pow2_fields_f64(p, t):
    """``p * 2**t`` (float64 ``p`` near 1, integral float ``t`` in [-1100, 1100]), rounded once.

    2**t = 2**t1 * 2**t2, each factor a normal number built in its exponent
    field: p * 2**t1 is exact, and subnormal or overflowing results round
    once, in the last product.
    """
    t1 = np.floor(t * 0.5)
    return p * _pow2_f64(t1) * _pow2_f64(t - t1)


#: 1.5 * 2**52: adding it to an integral float64 n, |n| < 2**51, leaves n in
#: the low bits of the sum (two's complement, in the bits below the exponent).
_ROUND_F64 = 6755399441055744.0


@njit(**_OPTIONS)
def _pow2_f64(n):
    """``2**n`` for an integral float64 ``n`` in [-1022, 1023], built in its exponent field.

    Without a float-to-int64 conversion, which AVX2 lacks (LLVM did it
    element by element, a large share of an exp or tanh).
    """
    return _float_from_bits((_float_bits(n + _ROUND_F64) + 1023) << 52)


@njit(**_OPTIONS)
def _pow2_fields_f32(p, t):
    """``p * 2**t`` (float32 ``p`` near 1, integral float ``t`` in [-160, 160]), rounded once."""
    e = np.int32(t)
    e1 = e >> 1
    e2 = e - e1
    s1 = _float_from_bits(np.int32((e1 + 127) << 23))
    s2 = _float_from_bits(np.int32((e2 + 127) << 23))
    return p * s1 * s2


@njit(**_OPTIONS)
def _pow2_scale_f64(p, t):
    """``p * 2**t`` rounded once: ``ldexp`` where it vectorises, else `_pow2_fields_f64`."""
    if _HAS_VECTOR_LDEXP:
        return _ldexp(p, np.int32(t))
    return _pow2_fields_f64(p, t)


@njit(**_OPTIONS)
def _pow2_scale_f32(p, t):
    """``p * 2**t`` rounded once: ``ldexp`` where it vectorises, else `_pow2_fields_f32`."""
    if _HAS_VECTOR_LDEXP:
        return _ldexp(p, np.int32(t))
    return _pow2_fields_f32(p, t)


# float64: Cody-Waite split of ln 2 (fdlibm): LN2_HI has 32 significant bits,
# so t * LN2_HI is exact for |t| < 2**21.
_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
# q(r) = (exp(r) - 1 - r) / r**2 on |r| <= 1.0005 ln(2)/2: coefficients (highest
# degree first) of its Chebyshev interpolant of degree 9 (mpmath.chebyfit, 50
# digits), rounded to float64. Relative error of 1 + r + r**2 q(r) with the
# rounded coefficients, evaluated exactly: 1.6e-17.
_EXP_Q_F64 = (
    2.5100424157005067e-08,
    2.7620138719733994e-07,
    2.7557268378684192e-06,
    2.480152119021773e-05,
    0.00019841269863105968,
    0.0013888888917281794,
    0.008333333333330051,
    0.04166666666662399,
    0.16666666666666669,
    0.5000000000000001,
)


@njit(**_OPTIONS)
def _exp_q_f64(r):
    """``q(r)`` of `_EXP_Q_F64`: ``c9 + r t(r)``, ``t`` by Estrin's scheme.

    The terms of ``t`` in pairs, then pairs of pairs with ``r**2`` and
    ``r**4``: five multiply-adds deep rather than Horner's nine. The
    exponential is one long chain of dependent operations per entry, and
    the out-of-order window rather than the FMA ports bounds how many
    entries are in flight, so a shallower chain keeps more of them going.
    The last step is Horner's, so that ``q`` rounds once at the size of its
    leading term, as before; ``t``'s extra roundings are scaled by
    ``|r| <= 0.35``.
    """
    c = _EXP_Q_F64
    r2 = r * r
    r4 = r2 * r2
    p0 = c[7] * r + c[8]
    p1 = c[5] * r + c[6]
    p2 = c[3] * r + c[4]
    p3 = c[1] * r + c[2]
    d0 = p1 * r2 + p0
    d1 = p3 * r2 + p2
    t = (c[0] * r4 + d1) * r4 + d0
    return t * r + c[9]


@njit(**_OPTIONS)
def _exp_f64_scalar(v):
    """Vectorisable ``exp(v)``, float64 (see `exp_inplace`)."""
    # exp(-746) < 2**-1075 rounds to 0; exp(710) overflows to inf. Arguments
    # below -746 (masked entries are -inf) give 0 by a final select, not by an
    # underflowing product (see _exp_f32_scalar).
    x = v
    if x < -746.0:
        x = -1.0
    if x > 710.0:
        x = 710.0
    t = np.floor(x * _LOG2E + 0.5)
    r = (x - t * _LN2_HI) - t * _LN2_LO
    # 1 + r + r**2 q(r), q a degree-9 Chebyshev fit (see exp_inplace)
    q = _exp_q_f64(r)
    p = (q * r + 1.0) * r + 1.0
    y = _pow2_scale_f64(p, t)
    if v < -746.0:
        y = 0.0
    return y


def _exp_any(v):
    """``exp(v)`` of the dtype of ``v`` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_exp_any)
def _exp_any_overload(v):
    if v == types.float64:
        return lambda v: _exp_f64_scalar(v)
    if v == types.float32:
        return lambda v: _exp_f32_scalar(v)
    return None


@njit(inline="always", **_OPTIONS)
def _exp_rows(x, m, n):
    """``exp`` of ``x[:m, :n]`` in place, four rows at a time (see `exp_shift_sum`)."""
    m4 = m - m % 4
    for i in range(0, m4, 4):
        r0, r1, r2, r3 = x[i, :n], x[i + 1, :n], x[i + 2, :n], x[i + 3, :n]
        for j in range(n):
            e0, e1, e2, e3 = _exp_any(r0[j]), _exp_any(r1[j]), _exp_any(r2[j]), _exp_any(r3[j])
            r0[j], r1[j], r2[j], r3[j] = e0, e1, e2, e3
    for i in range(m4, m):
        row = x[i, :n]
        for j in range(n):
            row[j] = _exp_any(row[j])


@_typed([_EXP_SIGNATURES[types.float64]], **_OPTIONS)
def _exp_f64(x, m, n):
    """Vectorisable ``exp`` of ``x[:m, :n]`` in place, float64 (see `exp_inplace`)."""
    _exp_rows(x, m, n)


# float32: Cody-Waite split of ln 2 (Cephes): LN2_HI has 9 significant bits,
# so t * LN2_HI is exact for |t| < 2**15.
_LOG2E_F32 = np.float32(1.4426950408889634)
_LN2_HI_F32 = np.float32(0.693359375)
_LN2_LO_F32 = np.float32(-2.12194440e-4)
_HALF_F32 = np.float32(0.5)
_ONE_F32 = np.float32(1.0)
_LO_F32 = np.float32(-104.0)
_HI_F32 = np.float32(89.0)
_ZERO_ARG_F32 = np.float32(-1.0)
_ZERO_F32 = np.float32(0.0)
# As _EXP_Q_F64, degree 4, rounded to float32: relative error 1.1e-8.
_EXP_Q_F32 = (
    np.float32(0.0013926213141530752),
    np.float32(0.008363203145563602),
    np.float32(0.041666556149721146),
    np.float32(0.16666576266288757),
    np.float32(0.5),
)


@njit(**_OPTIONS)
def _exp_q_f32(r, r2):
    """``q(r)`` of `_EXP_Q_F32` (``r2 = r * r``): the upper terms in a pair, then Horner (see `_exp_q_f64`)."""
    c = _EXP_Q_F32
    return ((c[0] * r + c[1]) * r2 + (c[2] * r + c[3])) * r + c[4]


@njit(**_OPTIONS)
def _exp_f32_scalar(v):
    """Vectorisable ``exp(v)``, float32 (see `exp_inplace`)."""
    # exp(-104) < 2**-150 rounds to 0; exp(89) overflows to inf. Arguments
    # below -104 (masked entries are -inf) give 0 by a final select, not by an
    # underflowing product: the polynomial runs on a harmless stand-in, since
    # underflow costs a microcode assist per element on some CPUs.
    x = v
    if x < _LO_F32:
        x = _ZERO_ARG_F32
    if x > _HI_F32:
        x = _HI_F32
    t = np.floor(x * _LOG2E_F32 + _HALF_F32)
    r = (x - t * _LN2_HI_F32) - t * _LN2_LO_F32
    # 1 + r + r**2 q(r), q a degree-4 Chebyshev fit (see exp_inplace)
    q = _exp_q_f32(r, r * r)
    p = (q * r + _ONE_F32) * r + _ONE_F32
    y = _pow2_scale_f32(p, t)
    if v < _LO_F32:
        y = _ZERO_F32
    return y


@_typed([_EXP_SIGNATURES[types.float32]], **_OPTIONS)
def _exp_f32(x, m, n):
    """Vectorisable ``exp`` of ``x[:m, :n]`` in place, float32 (see `exp_inplace`)."""
    _exp_rows(x, m, n)


def _exp_block(x, m, n):
    """Dispatch to the exponential of the dtype of ``x`` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_exp_block)
def _exp_block_overload(x, m, n):
    if isinstance(x, types.Array) and x.dtype == types.float64:
        return lambda x, m, n: _exp_f64(x, m, n)
    if isinstance(x, types.Array) and x.dtype == types.float32:
        return lambda x, m, n: _exp_f32(x, m, n)
    return None


def _neg_inf(x):
    """``-inf`` in the dtype of the array ``x`` (jit code only)."""
    raise NotImplementedError("only callable from compiled code")


@overload(_neg_inf, inline="always")
def _neg_inf_overload(x):
    if isinstance(x, types.Array) and x.dtype == types.float64:
        return lambda x: np.float64(-np.inf)
    if isinstance(x, types.Array) and x.dtype == types.float32:
        return lambda x: np.float32(-np.inf)
    return None


@_typed(list(_EXP_SIGNATURES.values()), needs=(_exp_f64, _exp_f32), cache=True)
def exp_inplace(x, m, n):
    r"""Exponential of the block ``x[:m, :n]``, in place.

    Parameters
    ----------
    x : ndarray, float32 or float64, shape (>= m, >= n)
        2-D C-contiguous array; only the block ``x[:m, :n]`` is changed.
    m, n : int
        Block sizes.

    Notes
    -----
    A vectorisable replacement for ``math.exp``, which LLVM calls one element
    at a time. With :math:`t = \operatorname{round}(x / \ln 2)` and

    .. math:: r = (x - t\,c_{hi}) - t\,c_{lo}, \qquad c_{hi} + c_{lo} \approx \ln 2,

    (Cody-Waite reduction: :math:`c_{hi}` has few significant bits so that
    :math:`t\,c_{hi}` is exact), :math:`|r| \le \ln(2)/2` and

    .. math:: e^x = 2^t\, e^r, \qquad e^r \approx 1 + r + r^2 q(r),

    where :math:`q` is the Chebyshev interpolant of :math:`(e^r - 1 - r)/r^2`,
    of degree 9 in float64 and 4 in float32 (a polynomial of degree 11 or 6 in
    all, evaluated with fused multiply-adds; near-minimax, two degrees fewer
    than the Taylor polynomial of the same accuracy). The last steps follow
    Horner's rule; the higher terms of :math:`q` go in pairs (Estrin's
    scheme), which shortens the chain of dependent operations per entry,
    the bound on how many entries are in flight (see `_exp_q_f64`). With its
    coefficients rounded to the working precision the polynomial is within
    :math:`1.6 \cdot 10^{-17}` (float64, 0.15 ulp) and :math:`1.1 \cdot 10^{-8}`
    (float32, 0.2 ulp) relative of :math:`e^r`.
    The power :math:`2^t` is applied with one rounding, so that results in the
    subnormal range and overflow round once: by ``ldexp`` (one ``vscalef``
    instruction) with AVX-512, elsewhere by writing it into the exponent
    fields of two floats :math:`2^{t_1} 2^{t_2}`, :math:`t_1 = \lfloor t/2 \rfloor`,
    both normal, and multiplying (the same bits). The rest of the error is the
    rounding of the evaluation: in all, at most 1 ulp where the CPU
    fuses multiply-adds (`HAS_FMA`; measured: 0.91 ulp in float32, 0.93 ulp
    in float64) and 1.25 ulp where each step rounds twice (without
    FMA, as in a portable cache built with ``NUMBA_CPU_NAME=generic``;
    measured: 1.15 and 1.23 ulp), asserted by the tests against a long double
    reference over the whole finite range.

    Special values: ``exp(-inf) = 0``; arguments below -746 (float64) or
    -104 (float32) give 0 and those above 710 (float64) or 89 (float32) give
    ``+inf``, as does ``+inf``, like `numpy.exp` (without its warnings);
    ``nan`` gives ``nan``. The attention kernels only pass arguments ``<= 0``.

    See Also
    --------
    numpy.exp
    """
    _exp_block(x, m, n)


@njit(inline="always", **_OPTIONS)
def _shifted_exp(v, shift, nvm, neg_inf):
    """One entry of `exp_shift_sum`."""
    return _exp_any(v - shift if (v >= 0 or not nvm) else neg_inf)


@njit(inline="always", **_OPTIONS)
def _exp_shift_sum_rows(x, m, n, shift, nvm, sums):
    """`exp_shift_sum` four rows at a time; inlined where ``nvm`` is a constant."""
    neg_inf = _neg_inf(x)
    m4 = m - m % 4
    for i in range(0, m4, 4):
        r0, r1, r2, r3 = x[i, :n], x[i + 1, :n], x[i + 2, :n], x[i + 3, :n]
        for j in range(n):
            e0 = _shifted_exp(r0[j], shift[j], nvm, neg_inf)
            e1 = _shifted_exp(r1[j], shift[j], nvm, neg_inf)
            e2 = _shifted_exp(r2[j], shift[j], nvm, neg_inf)
            e3 = _shifted_exp(r3[j], shift[j], nvm, neg_inf)
            r0[j], r1[j], r2[j], r3[j] = e0, e1, e2, e3
            sums[j] = (((sums[j] + e0) + e1) + e2) + e3
    for i in range(m4, m):
        row = x[i, :n]
        for j in range(n):
            e = _shifted_exp(row[j], shift[j], nvm, neg_inf)
            row[j] = e
            sums[j] += e


_EXP_SHIFT_SUM_SIGNATURES = [
    types.void(
        _matrix(dtype), types.intp, types.intp, types.Array(dtype, 1, "C", readonly=True),
        types.boolean, types.Array(dtype, 1, "C"),
    )
    for dtype in _DTYPES
]


@_typed(_EXP_SHIFT_SUM_SIGNATURES, **_OPTIONS)
def exp_shift_sum(x, m, n, shift, nvm, sums):
    r"""Shifted exponential of the block ``x[:m, :n]`` in place, with its column sums.

    ``x[i, j] = exp(x[i, j] - shift[j])`` and ``sums[j] += x[i, j]`` (over
    ``i`` in order), in one pass over the block; with ``nvm``, entries with
    ``x[i, j] < 0`` (or NaN) become 0 instead.

    Parameters
    ----------
    x : ndarray, float32 or float64, shape (>= m, >= n)
        2-D C-contiguous array; only the block ``x[:m, :n]`` is changed.
    m, n : int
        Block sizes.
    shift : ndarray, shape (>= n,)
        Subtracted from every row of the block.
    nvm : bool
        Zero the entries that are negative before the shift.
    sums : ndarray, shape (>= n,)
        Column sums of the exponentials are added to ``sums[:n]``.

    Notes
    -----
    The exponential is the one of `exp_inplace` (same bits); the sums run
    over the rows in order, so they match a separate pass exactly. This is
    the softmax step of the forward tiles (scores stored transposed, one
    column per query): subtracting the running maximum, exponentiating and
    summing together saves two passes over the tile. Rows go four at a
    time: the exponential is one long chain of dependent operations per
    entry, and four independent ones in flight hide more of its latency.

    See Also
    --------
    exp_inplace
    """
    if nvm:
        _exp_shift_sum_rows(x, m, n, shift, True, sums)
    else:
        _exp_shift_sum_rows(x, m, n, shift, False, sums)


# ---------------------------------------------------------------------------
# Hyperbolic tangent
# ---------------------------------------------------------------------------


#: Below -64 = -2|v| (|v| > 32) tanh rounds to +-1 in float64 (1 - tanh|v| < 2**-90).
_TANH_LO_F64 = -64.0


@njit(**_OPTIONS)
def _tanh_f64_scalar(v):
    """Vectorisable ``tanh(v)``, float64 (see `tanh_inplace`)."""
    # u = expm1(-2|v|) from the reduction of _exp_f64_scalar: -2|v| = t ln 2 + r,
    # expm1 = (2**t - 1) + 2**t (r + r**2 q(r)), both terms exact or accurate
    # relative to themselves, without the cancellation of exp(.) - 1.
    x = -2.0 * abs(v)
    if x < _TANH_LO_F64:
        x = _TANH_LO_F64  # and no NaN from -inf
    t = np.floor(x * _LOG2E + 0.5)
    r = (x - t * _LN2_HI) - t * _LN2_LO
    q = _exp_q_f64(r)
    em1_r = q * r * r + r
    two_t = _pow2_f64(t)  # t in [-93, 0]
    u = (two_t - 1.0) + two_t * em1_r
    return math.copysign(abs(u) / (2.0 + u), v)


_TWO_F32 = np.float32(2.0)
_NEG_TWO_F32 = np.float32(-2.0)
#: Below -20 = -2|v| (|v| > 10) tanh rounds to +-1 in float32 (1 - tanh|v| < 5e-9).
_TANH_LO_F32 = np.float32(-20.0)
#: 1.5 * 2**23 + 127: adding it to a float y with |y| < 2**21 rounds y to an
#: integer n and leaves n + 127, the biased exponent of 2**n, in the low bits.
_ROUND_F32 = np.float32(12582912.0 + 127.0)


@njit(**_OPTIONS)
def _tanh_f32_scalar(v):
    """Vectorisable ``tanh(v)``, float32 (see `tanh_inplace`)."""
    x = _NEG_TWO_F32 * abs(v)
    if x < _TANH_LO_F32:
        x = _TANH_LO_F32
    # t = round(x / ln 2) in [-29, 0], and 2**t straight from the bits of k
    k = x * _LOG2E_F32 + _ROUND_F32
    t = k - _ROUND_F32
    r = (x - t * _LN2_HI_F32) - t * _LN2_LO_F32
    r2 = r * r
    q = _exp_q_f32(r, r2)
    em1_r = q * r2 + r
    two_t = _float_from_bits(np.int32(_float_bits(k) << 23))
    u = (two_t - _ONE_F32) + two_t * em1_r
    # |u| / (2 + u) with the sign of v (copysign takes only the magnitude of u)
    return math.copysign(u / (_TWO_F32 + u), v)


def tanh_any(v):
    """``tanh(v)`` of the dtype of the float ``v``, vectorisable (jit code only).

    The scalar behind `tanh_inplace`, for kernels that fuse it into loops of
    their own.
    """
    raise NotImplementedError("only callable from compiled code")


@overload(tanh_any)
def _tanh_any_overload(v):
    if v == types.float64:
        return lambda v: _tanh_f64_scalar(v)
    if v == types.float32:
        return lambda v: _tanh_f32_scalar(v)
    return None


_FOUR_F32 = np.float32(4.0)


@njit(**_OPTIONS)
def _sech2_f64_scalar(v):
    """Vectorisable ``1 - tanh(v)**2``, float64 (see `sech2_any`)."""
    e = _exp_f64_scalar(-2.0 * abs(v))
    d = 1.0 + e
    return 4.0 * e / (d * d)


@njit(**_OPTIONS)
def _sech2_f32_scalar(v):
    """Vectorisable ``1 - tanh(v)**2``, float32 (see `sech2_any`)."""
    e = _exp_f32_scalar(_NEG_TWO_F32 * abs(v))
    d = _ONE_F32 + e
    return _FOUR_F32 * e / (d * d)


def sech2_any(v):
    """``1 - tanh(v)**2`` of the dtype of the float ``v``, vectorisable (jit code only).

    Evaluated as ``4 e / (1 + e)**2`` with ``e = exp(-2|v|)``: accurate to a
    few units in the last place for every ``v``, where ``1 - tanh(v)**2``
    cancels to nothing once ``tanh(v)`` rounds to 1 (``|v|`` above about 9 in
    float32, 19 in float64).
    """
    raise NotImplementedError("only callable from compiled code")


@overload(sech2_any)
def _sech2_any_overload(v):
    if v == types.float64:
        return lambda v: _sech2_f64_scalar(v)
    if v == types.float32:
        return lambda v: _sech2_f32_scalar(v)
    return None


@_typed(list(_EXP_SIGNATURES.values()), **_OPTIONS)
def tanh_inplace(x, m, n):
    r"""Hyperbolic tangent of the block ``x[:m, :n]``, in place.

    Parameters
    ----------
    x : ndarray, float32 or float64, shape (>= m, >= n)
        2-D C-contiguous array; only the block ``x[:m, :n]`` is changed.
    m, n : int
        Block sizes.

    Notes
    -----
    A vectorisable replacement for ``math.tanh`` (a scalar library call),
    built on the reduction and polynomial of `exp_inplace`:

    .. math:: \tanh|x| = \frac{-u}{2 + u}, \qquad u = e^{-2|x|} - 1 \in (-1, 0],

    with the sign of ``x`` restored. ``u`` is formed without cancellation:
    with :math:`-2|x| = t \ln 2 + r`,
    :math:`u = (2^t - 1) + 2^t (r + r^2 q(r))`, where :math:`2^t - 1` is
    exact and :math:`r + r^2 q(r)` is accurate relative to itself, so that
    small arguments keep full relative accuracy (``tanh(x) = x`` for tiny
    ``x``) and the quotient adds a few roundings. The tests bound the error
    at 4 ulp against mpmath (a scan of every float32 in
    :math:`[2^{-126}, 12]` measured 2.50 ulp at most) and check that the
    result never decreases from one float to the next: the forward kernel
    caps a tile's raw maxima rather than taking the maxima of the capped
    tile, which is the same only for a non-decreasing tangent.
    ``tanh(+-inf) = +-1``; ``nan`` gives ``nan``.

    See Also
    --------
    exp_inplace, numpy.tanh
    """
    for i in range(m):
        row = x[i]
        for j in range(n):
            row[j] = tanh_any(row[j])


# ---------------------------------------------------------------------------
# Prefetch
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Transposed add of a block
# ---------------------------------------------------------------------------

#: Entries per side of the square blocks the transposes move, at least: with
#: AVX2, 8 x 8 float32 blocks (a register per row) beat 16 x 16 ones (two
#: registers per row, and spills), and 8 x 8 float64 blocks beat 4 x 4 ones.
_MIN_TRANSPOSE_WIDTH = 8


def _constant_in_jit_code(width_of):
    """Give ``width_of(array)`` to jit code too, as a compile-time constant of the array's dtype."""

    @overload(width_of, inline="always")
    def _width_overload(x):
        if isinstance(x, types.Array):
            width = width_of(numpy_support.as_dtype(x.dtype))
            return lambda x: width
        return None

    return width_of


@_constant_in_jit_code
def transpose_width(x):
    """Entries per side ``W`` of the square blocks `transpose_add` and co. move.

    A SIMD register of the dtype per row, or 8 entries where that is fewer
    (two or more registers per row). ``x`` is a dtype or an array (an array
    in jit code, where the width is a compile-time constant).
    """
    dtype = x.dtype if isinstance(x, np.ndarray) else np.dtype(x)
    return max(_VECTOR_BYTES // dtype.itemsize, _MIN_TRANSPOSE_WIDTH)


def _transpose_in_registers(builder, rows):
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


#: Bytes of a cache line, the unit in which `transpose_stream` writes.
_LINE_BYTES = 64


@_constant_in_jit_code
def stream_width(x):
    """Entries per run ``L`` of `transpose_stream`: whole cache lines, at least ``W``.

    ``x`` is a dtype or an array (an array in jit code, where the width is a
    compile-time constant).
    """
    dtype = x.dtype if isinstance(x, np.ndarray) else np.dtype(x)
    return max(_LINE_BYTES // dtype.itemsize, transpose_width(dtype))


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
    """``transpose_add``, ``transpose_load``, ``transpose_store``, ``transpose_stream`` or ``transpose_accumulate``.

    (``mode`` "add", "load", "store", "stream" or "accumulate".)
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
                _transpose_in_registers(
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
                    out = builder.store(builder.fmul(run, run_splat), ptr, align=_LINE_BYTES)
                    out.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(i32, 1)]))
                else:
                    builder.store(builder.fmul(run, splat), flat_run(r), align=itemsize)
            return context.get_dummy_value()
        rows = [builder.load(flat_run(r), align=itemsize) for r in range(width)]
        # the runs' NaN and +inf entries (unordered or >= inf), before scaling
        inf = ir.Constant(vec, [float("inf")] * width)
        flagged = builder.fcmp_unordered(">=", rows[0], inf)
        for row in rows[1:]:
            flagged = builder.or_(flagged, builder.fcmp_unordered(">=", row, inf))
        flagged = builder.bitcast(flagged, ir.IntType(width))
        for c, row in enumerate(_transpose_in_registers(builder, rows)):
            ptr = x_row(c)
            total = builder.fmul(row, splat)
            if mode == "add":
                total = builder.fadd(builder.load(ptr, align=itemsize), total)
            builder.store(total, ptr, align=itemsize)
        return builder.zext(builder.icmp_unsigned("!=", flagged, ir.Constant(ir.IntType(width), 0)), intp)

    def typer(typingctx, x, flat, start, stride, row0, col0, scale):
        if not (isinstance(x, types.Array) and isinstance(flat, types.Array)):
            return None
        if x.ndim != 2 or flat.ndim != 1 or scale != flat.dtype:
            return None
        if flat.dtype != (types.float64 if mode == "accumulate" else x.dtype):
            return None
        if store and not flat.mutable:
            return None
        result = types.void if store else types.intp
        sig = result(x, flat, types.intp, types.intp, types.intp, types.intp, scale)
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
    to a key-major score tile without a scalar gather or scatter. Returns 1
    when one of the loaded entries of ``src`` is NaN or ``+inf``, else 0 (a
    bias checked as it is read).
    """
    return _make_transpose("add")(typingctx, x, src, start, stride, row0, col0, scale)


@intrinsic
def transpose_load(typingctx, x, src, start, stride, row0, col0, scale):
    """``x[row0 + c, col0 + r] = scale * src[start + r * stride + c]`` for ``r, c < W``.

    As `transpose_add`, overwriting the block of ``x`` instead of adding to
    it (jit code only): a bias tile stored into a score tile that a product
    then accumulates onto. Returns 1 when a loaded entry is NaN or ``+inf``.
    """
    return _make_transpose("load")(typingctx, x, src, start, stride, row0, col0, scale)


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
