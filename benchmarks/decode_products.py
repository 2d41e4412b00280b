"""The decode kernel's two products alone, over one tile of keys kept in cache: by layout and stacked rows.

`elastic_np.cpu._decode.products.key_scores` (``Q K^T``) and
``value_products`` (``P V``) run ``--reps`` times over one tile of
``--keys`` keys (128) of head dim 128 on one thread, the tile's rows
stored as in a ``(M, Hkv, D)`` cache: contiguous (one head, as in
``(B, Hkv, M, D)``), 8 heads apart (as a page or a ``(B, M, Hkv, D)``
cache: 4 KiB for float32, 2 KiB for bfloat16), and 8 heads plus one cache
line apart. Printed: nanoseconds a key and stacked query row, best of
``--repeat``, for ``--rows`` stacked rows (the query heads of a kv head
times the queries). The cache is never read from memory here: what is
left is the arithmetic, and what a layout costs in the L1 and L2 caches.

Usage: ``python benchmarks/decode_products.py [--rows R ...] [--keys K] [--reps N] [--repeat N]``
"""

import argparse
import time

import ml_dtypes
import numpy as np
from numba import njit

from elastic_np.cpu._decode.products import key_scores, value_products
from elastic_np.cpu._tiles.halves import bits

_LINE = 64


@njit(cache=False, fastmath={"contract"})
def _run(qs, whole, col, st, acc, rows, bk, reps, keys):
    """``reps`` calls of one product; the hints name rows past the array (never read)."""
    D = qs.shape[1]
    for _ in range(reps):
        if keys:
            key_scores(qs, (whole, col), (whole, col, whole.shape[0]), st, 0, rows, bk, D)
        else:
            value_products(st, 0, (whole, col), (whole, col, whole.shape[0]), acc, rows, bk, D)


def layouts(dtype, bk, D=128, heads=8, seed=0):
    """``{name: (whole, col)}``: the tile's rows of head 3 in each layout, as the kernels take them."""
    rng = np.random.default_rng(seed)
    pad = _LINE // np.dtype(dtype).itemsize
    apart = heads * D * np.dtype(dtype).itemsize
    made = {"contiguous": (bk, D, 0), f"{apart} B apart": (bk, heads * D, 3 * D),
            f"{apart + _LINE} B apart": (bk, heads * D + pad, 3 * D)}
    return {name: (bits(rng.standard_normal((n, width)).astype(dtype)), col)
            for name, (n, width, col) in made.items()}


def time_products(dtype, rows, bk, reps, repeat, D=128):
    """``{layout: (keys, values)}``: nanoseconds a key and stacked row of each product."""
    rng = np.random.default_rng(1)
    compute = np.float64 if dtype == np.float64 else np.float32
    qs = rng.standard_normal((rows, D)).astype(compute)
    st = (rng.standard_normal((rows, bk)) * 1e-3).astype(compute)
    acc = np.zeros((rows, D), compute)
    result = {}
    for name, (whole, col) in layouts(dtype, bk, D).items():
        seconds = []
        for keys in (True, False):
            _run(qs, whole, col, st.copy(), acc, rows, bk, 1, keys)
            best = np.inf
            for _ in range(repeat):
                scores = st.copy()
                start = time.perf_counter()
                _run(qs, whole, col, scores, acc, rows, bk, reps, keys)
                best = min(best, time.perf_counter() - start)
            seconds.append(best / (reps * bk * rows) * 1e9)
        result[name] = tuple(seconds)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--keys", type=int, default=128)
    parser.add_argument("--reps", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"one thread, one tile of {args.keys} keys of 128 in cache; ns a key and stacked row, best of {args.repeat}")
    for name, dtype in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)):
        for rows in args.rows:
            for layout, (keys, values) in time_products(dtype, rows, args.keys, args.reps, args.repeat).items():
                print(f"{name:9s} rows {rows:3d}  {layout:16s}  Q K^T {keys:6.2f}  P V {values:6.2f}")


if __name__ == "__main__":
    main()
