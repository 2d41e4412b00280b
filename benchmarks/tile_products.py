"""GFLOP/s of the single-threaded tile products of the CPU kernels against ``np.dot``.

Times `elastic_np.cpu._tiles.products.matmul_nn` / `matmul_tn` called in a loop on the
shapes the attention kernels use (query and key tiles of 128, head dimension
64), next to ``np.dot`` on the same shapes with BLAS limited to one thread
(set ``OPENBLAS_NUM_THREADS=1``/``OMP_NUM_THREADS=1`` before NumPy loads; this
script does so unless they are set already).

Usage: ``python benchmarks/tile_products.py [--rounds R] [--dtype float32]``
"""

import argparse
import os
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np   # noqa: E402
from numba import njit   # noqa: E402

from elastic_np.cpu._tiles.products import matmul_nn, matmul_nn_max, matmul_tn  # noqa: E402
from elastic_np.cpu._tiles.simd import compile_for  # noqa: E402

for _dtype in (np.float32, np.float64):
    compile_for(_dtype)

# (label, kind, m, n, k): the products of the forward and backward tiles
SHAPES = [
    ("fwd S^T = K Q^T", "nn", 128, 128, 64),
    ("fwd S^T, with col max", "nn_max", 128, 128, 64),
    ("fwd O += P V", "tn", 128, 64, 128),
    ("bwd dV += P dO", "nn", 256, 64, 128),
    ("bwd dq share = dS^T K", "tn", 128, 64, 256),
]


@njit  # not cached: the cache would not see changes to the tile primitives
def _loop_nn(a, b, c, m, n, k, reps):
    for _ in range(reps):
        matmul_nn(a, 0, b, 0, c, m, n, k, True)


@njit  # not cached: the cache would not see changes to the tile primitives
def _loop_tn(a, b, c, m, n, k, reps):
    for _ in range(reps):
        matmul_tn(a, 0, b, 0, c, m, n, k, True)


@njit  # not cached: the cache would not see changes to the tile primitives
def _loop_nn_max(a, b, c, m, n, k, reps):
    col_max = np.empty(n, c.dtype)
    for _ in range(reps):
        col_max[:] = -np.inf
        matmul_nn_max(a, 0, b, 0, c, m, n, k, col_max, False, False)


_LOOPS = {"nn": _loop_nn, "tn": _loop_tn, "nn_max": _loop_nn_max}


def _best(fn, rounds):
    best = np.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=200, help="products per timed call")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args(argv)
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(0)
    print(f"{'product':26s} {'m,n,k':>12s} {'ours GF/s':>10s} {'np.dot GF/s':>12s} {'ratio':>6s}")
    for label, kind, m, n, k in SHAPES:
        transposed = kind == "tn"
        a = rng.standard_normal((k, m) if transposed else (m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
        c = np.zeros((m, n), dtype)
        loop = _LOOPS[kind]
        loop(a, b, c, m, n, k, 1)
        a_op = a.T if transposed else a
        reps = args.reps

        def ours():
            loop(a, b, c, m, n, k, reps)

        def blas():
            for _ in range(reps):
                np.dot(a_op, b, out=c)

        flops = 2.0 * m * n * k * reps
        t_ours = _best(ours, args.rounds)
        t_blas = _best(blas, args.rounds)
        g_ours, g_blas = flops / t_ours / 1e9, flops / t_blas / 1e9
        print(f"{label:26s} {f'{m},{n},{k}':>12s} {g_ours:10.1f} {g_blas:12.1f} {g_ours / g_blas:6.2f}")


if __name__ == "__main__":
    main()
