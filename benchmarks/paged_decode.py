"""Decoding from a paged KV cache (block tables) against the same keys in a contiguous cache, in one process.

Cases: ``B`` sequences of ``--cache`` keys each (8,192), 32 query heads on 8
key/value heads, one query, head dim 128, pages of ``--block-sizes`` keys
(16 and 128) in shuffled order, through `elastic_np.varlen_attention` with
``block_table`` against `elastic_np.attention` on the contiguous
``(B, Hkv, M, D)`` cache. Each round times both (best of ``--repeat``), the
order alternating; printed per case: the median times and contiguous / paged
(above 1: paged is faster), median and range over the rounds, and the peak
of NumPy allocations of one paged call (``tracemalloc``) beside the cache's size.

Usage: ``python benchmarks/paged_decode.py [--rounds R] [--repeat N] [--batch B ...] [--block-sizes S ...]
[--dtype float32 | bfloat16 | int8 | float8_e4m3fn ...] [--per-head]``
"""

import argparse

import ml_dtypes
import numpy as np

import elastic_np as enp
from elastic_np._contract import _validation
from elastic_np.cli import _bench


def _quantized(dtype):
    """Whether ``dtype`` is a quantized cache's (int8, float8)."""
    return dtype.kind in "iu" or "float8" in dtype.name


def make_case(B, M, block_size, dtype, H=32, Hkv=8, D=128, seed=0, per_head=False):
    """``(contiguous, paged)``: two calls over the same keys and values (``per_head``: the pages stored
    ``(num_blocks, Hkv, block_size, D)``, vLLM's CPU order, and given as their ``transpose(0, 2, 1, 3)``); a
    quantized ``dtype`` (int8, float8): `elastic_np.quantize_kv`'s cache and scales, float32 queries."""
    rng = np.random.default_rng(seed)
    scales = {}
    if _quantized(dtype):  # a quantized cache beside float32 queries
        q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
        (k, scales["k_scale"]), (v, scales["v_scale"]) = (
            enp.quantize_kv(rng.standard_normal((B, Hkv, M, D)).astype(np.float32), dtype) for _ in range(2))
    else:
        q = rng.standard_normal((B, H, 1, D)).astype(np.float32).astype(dtype)
        k, v = (rng.standard_normal((B, Hkv, M, D)).astype(np.float32).astype(dtype) for _ in range(2))
    per_sequence = -(-M // block_size)
    table = rng.permutation(B * per_sequence).reshape(B, per_sequence)
    pages = [np.zeros((B * per_sequence, block_size, Hkv, D), dtype=dtype) for _ in range(2)]
    for b in range(B):
        for p in range(per_sequence):
            rows = slice(p * block_size, min((p + 1) * block_size, M))
            for cache, a in zip(pages, (k, v)):
                cache[table[b, p], : rows.stop - rows.start] = a[b, :, rows].transpose(1, 0, 2)
    if per_head:
        pages = [np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for a in pages]
    q_packed = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).reshape(B, H, D)
    cu_q = np.arange(B + 1)
    used = np.full(B, M)

    def contiguous():
        return enp.attention(q, k, v, backend="cpu", **scales)

    def paged():
        return enp.varlen_attention(q_packed, *pages, cu_q, None, block_table=table, seqused_k=used,
                                    backend="cpu", **scales)

    return contiguous, paged, 2 * k.nbytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cache", type=int, default=8192)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--per-head", action="store_true", help="pages stored (num_blocks, Hkv, block_size, D)")
    args = parser.parse_args(argv)
    dtype = _validation.numpy_dtype(args.dtype)
    with _bench.thread_counts(args.threads) as counts:
        cases = {(B, s): make_case(B, args.cache, s, dtype, per_head=args.per_head)
                 for B in args.batch for s in args.block_sizes}
        peaks = {}
        for key, (contiguous, paged, nbytes) in cases.items():
            # B > 1: the paged call keeps each sequence's own key splits, the contiguous one splits the batch's
            rounding = 1e-5 if _quantized(dtype) else max(1e-5, 2 * float(ml_dtypes.finfo(dtype).eps))
            np.testing.assert_allclose(contiguous()[:, :, 0].astype(np.float64), paged().astype(np.float64),
                                       rtol=rounding, atol=rounding / 10)
            peaks[key] = _bench.traced_peak_bytes(paged)
        calls = {key: {"contiguous": contiguous, "paged": paged} for key, (contiguous, paged, _) in cases.items()}
        times = _bench.interleaved(calls, args.rounds, args.repeat)
    print(f"decode 32/8 heads, 1 query, {args.cache} keys of 128, {dtype.name}"
          f"{', pages stored per head' if args.per_head else ''}; {_bench.describe_threads(counts)}; "
          f"{args.rounds} rounds, best of {args.repeat}")
    print(f"{'B':>3} {'block':>6} {'contiguous ms':>14} {'paged ms':>9}  contiguous/paged   paged peak / cache")
    for (B, s), by_label in times.items():
        c, p = by_label["contiguous"], by_label["paged"]
        ratio = np.array(c) / np.array(p)
        nbytes = cases[B, s][2]
        print(f"{B:>3} {s:>6} {np.median(c) * 1e3:>14.2f} {np.median(p) * 1e3:>9.2f}  "
              f"{np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f})   "
              f"{peaks[B, s] / 2**20:.2f} MiB / {nbytes / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
