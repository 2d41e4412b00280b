"""The tensor-core product of one warp, `mma`, and the TF32 split, `split`: inline PTX or, under the simulator, Python.

Imports ``numba.cuda``; imported by the tensor-core kernels. On a GPU (and when
compiling without one) `split` and `mma` are inline PTX (``cvt.rna.tf32.f32``;
``mma.sync`` m16n8k8 TF32, and float64 as m16n8k4 on sm_90, m8n8k4 before),
built with ``numba.cuda.extending.intrinsic`` and chosen by dtype with
``numba.cuda.extending.overload``; the float64 product's shape is chosen as
NVVM compiles for its target (``__nvvm_reflect("__CUDA_ARCH")``). Under the
simulator they are Python stand-ins with the same fragment semantics and the
same TF32 rounding (`_sim_split`, `_sim_mma`).

Fragments (per warp; ``lane = 4 g + t``), as in the PTX ISA's m16n8k8:
``A`` 16 x 8 holds ``(g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)``,
``B`` 8 x 8 holds ``(t, g), (t + 4, g)``, ``C`` and ``D`` 16 x 8 hold
``(g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)``.
"""

import math
import threading

import numpy as np
from numba import config as numba_config
from numba import types as nbt

def split(x):
    """``(big, small)``: ``x`` as a sum of two TF32 values (float32), ``(x, 0)`` for float64.

    ``big`` is ``x`` rounded to TF32 (nearest, ties away from zero), ``small``
    the rest rounded to TF32, 0 where ``big`` is not finite.
    """
    raise NotImplementedError("called only inside a CUDA kernel")


def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``D = A B + C`` of one warp: a 16 x 8 x 8 product (TF32 for float32, float64 for float64).

    Returns the thread's four entries of ``D``; every lane of the warp must call it together.
    """
    raise NotImplementedError("called only inside a CUDA kernel")


def splits(x):
    """Whether a value of ``x``'s dtype is split for the products (float32: True; float64: False, at compile time)."""
    return isinstance(x, np.float32)


def _tf32(x):
    """``x`` (float32) rounded to TF32 as ``cvt.rna.tf32.f32`` does: nearest, ties away from zero."""
    x = np.float32(x)
    if not np.isfinite(x):
        return x
    bits = np.array(x).view(np.uint32)
    return np.array((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000), dtype=np.uint32).view(np.float32)[()]


def _sim_split(x):
    if not isinstance(x, np.float32):
        return x, type(x)(0.0)
    big = _tf32(x)
    small = _tf32(np.float32(x) - big) if np.isfinite(big) else np.float32(0.0)
    return big, small


def _sim_mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """The simulator's `mma`: each lane posts its fragments, then forms its entries of ``D``.

    The lanes of a warp meet at a barrier of their own (a ``threading.Barrier``,
    much cheaper than the simulator's block-wide ``syncthreads``); the posts
    alternate between two tables, so one barrier per product suffices (a lane
    writes a table again only after every lane has passed the next product's
    barrier, i.e. read this one). The first lane past the barrier forms the
    warp's ``A B`` (NumPy, in the fragments' dtype) for all; each adds its ``C``.
    """
    thread = threading.current_thread()
    tid = thread.thread_id
    base = tid - tid % 32
    lanes = min(32, thread._manager._block_dim[0] - base)
    warps = thread._manager.__dict__.setdefault("_elastic_np_mma", {})
    warp = warps.get(base)
    if warp is None:  # the warp's barrier, lock and two tables, made once (setdefault keeps the first)
        warp = warps.setdefault(base, (threading.Barrier(lanes), threading.Lock(), ({}, {})))
    barrier, lock, tables = warp
    calls = getattr(thread, "_elastic_np_mma_calls", 0)
    thread._elastic_np_mma_calls = calls + 1
    table = tables[calls % 2]
    table.pop("D", None)  # the product of two calls ago: every lane has read it
    table[tid] = (a0, a1, a2, a3, b0, b1)
    barrier.wait()
    with lock:
        if "D" not in table:
            table["D"] = _warp_product([table[base + lane] for lane in range(32)])
    lane = tid % 32
    g, t = lane // 4, lane % 4
    product = table["D"]
    dtype = type(c0)
    return (dtype(c0 + product[g, 2 * t]), dtype(c1 + product[g, 2 * t + 1]),
            dtype(c2 + product[g + 8, 2 * t]), dtype(c3 + product[g + 8, 2 * t + 1]))


def _warp_product(posts):
    """``A B`` (16 x 8) from the 32 lanes' posted fragments ``(a0, a1, a2, a3, b0, b1)``, in their dtype."""
    frags = np.array(posts, dtype=type(posts[0][0]))
    a = np.empty((16, 8), dtype=frags.dtype)
    a[:8, :4] = frags[:, 0].reshape(8, 4)  # lane 4 g + t holds (g, t) ...
    a[8:, :4] = frags[:, 1].reshape(8, 4)
    a[:8, 4:] = frags[:, 2].reshape(8, 4)
    a[8:, 4:] = frags[:, 3].reshape(8, 4)
    b = np.empty((8, 8), dtype=frags.dtype)
    b[:4, :] = frags[:, 4].reshape(8, 4).T  # ... and (t, g), (t + 4, g) of B
    b[4:, :] = frags[:, 5].reshape(8, 4).T
    with np.errstate(invalid="ignore", over="ignore"):  # inf and NaN propagate as on the hardware
        return a @ b


_MMA_TF32 = (
    "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
    "{$10, $11, $12, $13};"
)
_MMA_F64_SM90 = (  # two m16n8k4: k = 0..3 from (a0, a1, b0), k = 4..7 from (a2, a3, b1)
    "mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {$0, $1, $2, $3}, {$4, $5}, {$8}, {$10, $11, $12, $13};\n\t"
    "mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {$0, $1, $2, $3}, {$6, $7}, {$9}, {$0, $1, $2, $3};"
)
_MMA_F64_SM80 = (  # four m8n8k4: rows g from a0, a2; rows g + 8 from a1, a3
    "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {$0, $1}, {$4}, {$8}, {$10, $11};\n\t"
    "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {$2, $3}, {$5}, {$8}, {$12, $13};\n\t"
    "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {$0, $1}, {$6}, {$9}, {$0, $1};\n\t"
    "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {$2, $3}, {$7}, {$9}, {$2, $3};"
)


#: Whether the products keep their written order in the kernels (volatile inline assembly). False, the
#: default, lets the compiler interleave independent products: each product is a pure function of its
#: operands, and the sums of the 3xTF32 steps stay in IEEE arithmetic in their order (read when a kernel compiles).
_ORDERED = False


def _declare():
    """`split` and `mma` as inline PTX (``numba.cuda.extending.intrinsic``), chosen by dtype.

    Inline assembly, rather than ``cuda.declare_device`` and a linked ``.cu``:
    NVVM sees each product as one instruction, so the fragment loops unroll
    and the fragments stay in registers (with the linked functions NVVM saw
    opaque calls, left most loops rolled and the fragments in local memory).
    """
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic, overload

    f32, f64 = nbt.float32, nbt.float64

    @intrinsic
    def round_tf32(typingctx, x):
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            cvt = ir.InlineAsm(ir.FunctionType(i32, [ir.FloatType()]), "cvt.rna.tf32.f32 $0, $1;", "=r,f")
            return builder.bitcast(builder.call(cvt, [args[0]]), ir.FloatType())

        return f32(f32), codegen

    def call_asm(builder, real, asm, reg, args):
        """The product as one inline-assembly call: the struct of the four entries of ``D``."""
        operands = list(args)
        kinds = [reg] * 10
        if real == f32:  # A and B go in as the bits of their TF32 values
            operands[:6] = [builder.bitcast(x, ir.IntType(32)) for x in args[:6]]
            kinds[:6] = ["r"] * 6
        lltype = args[6].type
        fnty = ir.FunctionType(ir.LiteralStructType([lltype] * 4), [x.type for x in operands])
        constraints = ",".join([f"={reg}"] * 4 + kinds)
        return builder.call(ir.InlineAsm(fnty, asm, constraints, side_effect=_ORDERED), operands)

    def cuda_arch(builder):
        """``__CUDA_ARCH`` of the compilation (900 for sm_90), which NVVM's reflection folds to a constant."""
        module = builder.module
        name = "__elastic_np_cuda_arch"
        text = bytearray(b"__CUDA_ARCH\0")
        string = module.globals.get(name)
        if string is None:
            string = ir.GlobalVariable(module, ir.ArrayType(ir.IntType(8), len(text)), name, addrspace=4)
            string.initializer = ir.Constant(string.type.pointee, text)
            string.global_constant = True
            string.linkage = "private"
        reflect = cgutils.get_or_insert_function(
            module, ir.FunctionType(ir.IntType(32), [ir.IntType(8).as_pointer()]), "__nvvm_reflect")
        pointer = builder.addrspacecast(string.gep([ir.Constant(ir.IntType(32), 0)] * 2), ir.IntType(8).as_pointer())
        return builder.call(reflect, [pointer])

    @intrinsic
    def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        def codegen(context, builder, sig, args):
            out = call_asm(builder, f32, _MMA_TF32, "f", args)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, n) for n in range(4)])

        return nbt.UniTuple(f32, 4)(*[f32] * 10), codegen

    @intrinsic
    def mma_f64(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        def codegen(context, builder, sig, args):  # m16n8k4 from sm_90, m8n8k4 before: chosen as NVVM compiles
            sm90 = builder.icmp_signed(">=", cuda_arch(builder), ir.Constant(ir.IntType(32), 900))
            with builder.if_else(sm90) as (then, otherwise):
                with then:
                    new = call_asm(builder, f64, _MMA_F64_SM90, "d", args)
                    new_block = builder.block
                with otherwise:
                    old = call_asm(builder, f64, _MMA_F64_SM80, "d", args)
                    old_block = builder.block
            out = builder.phi(new.type)
            out.add_incoming(new, new_block)
            out.add_incoming(old, old_block)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, n) for n in range(4)])

        return nbt.UniTuple(f64, 4)(*[f64] * 10), codegen

    @overload(split, target="cuda")
    def _split(x):
        if x == f32:

            def split_tf32(x):
                big = round_tf32(x)
                small = round_tf32(x - big)
                if not abs(big) < math.inf:  # inf or NaN: x - big is NaN
                    small = nbt.float32(0.0)
                return big, small

            return split_tf32
        if x == f64:
            return lambda x: (x, 0.0)
        return None

    @overload(splits, target="cuda")
    def _splits(x):
        if x == f32:
            return lambda x: True
        return lambda x: False

    @overload(mma, target="cuda")
    def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        if a0 == f32:
            return lambda a0, a1, a2, a3, b0, b1, c0, c1, c2, c3: mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        if a0 == f64:
            return lambda a0, a1, a2, a3, b0, b1, c0, c1, c2, c3: mma_f64(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        return None


if getattr(numba_config, "ENABLE_CUDASIM", 0):
    split = _sim_split  # noqa: F811
    mma = _sim_mma  # noqa: F811
else:
    _declare()
