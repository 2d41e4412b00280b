"""A server's mixed step over a paged cache against the same work on contiguous arrays, in one process.

The step (issue 69's): ``--decodes`` sequences decoding one query over
``--decode-keys`` keys (6 at 8,192) and ``--chunks`` prefill chunks of
``--chunk`` queries over ``--prefix`` keys already cached (2 of 512 over
4,096), causal, 32 query heads on 8 key/value heads, head dim 128, pages of
``--block-sizes`` keys in shuffled order. Paged: one
`elastic_np.varlen_attention` call with ``block_table``. Contiguous: the same
work as `elastic_np.attention` calls on each sequence's contiguous arrays.
The results are checked equal bit for bit first. Each round times both (best of
``--repeat``), the order alternating; printed per case: the median times,
contiguous / paged (above 1: paged is faster), median and range over the
rounds, and the peak of NumPy's allocations during one paged call beyond its
output (``tracemalloc``). Where the CPU has AMX tiles, a bfloat16 chunk runs
on them and gathers its keys first (`elastic_np.cpu.paged_forward`);
``--no-amx`` turns them off.

Usage: ``python benchmarks/mixed_step.py [--rounds R] [--repeat N] [--dtypes float32 bfloat16] [--block-sizes 16 128]
[--no-amx] [--json PATH]``
"""

import argparse
import pathlib
import sys

import numpy as np

import elastic_np as enp
from elastic_np._contract import _validation
from elastic_np.cli import _bench

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import _record  # noqa: E402


def make_step(sequences, block_size, dtype, H=32, Hkv=8, D=128, seed=0):
    """``(contiguous, paged, out_bytes)`` for ``sequences``, ``[(queries, keys), ...]``: the same step two ways."""
    rng = np.random.default_rng(seed)
    per = [-(-m // block_size) for _, m in sequences]
    table = np.zeros((len(sequences), max(per)), dtype=np.int32)
    order = rng.permutation(sum(per))
    pools = [np.zeros((sum(per), block_size, Hkv, D), dtype=dtype) for _ in range(2)]
    keys, queries = [], []
    for s, (n, m) in enumerate(sequences):
        table[s, : per[s]] = order[sum(per[:s]) : sum(per[: s + 1])]
        k, v = (rng.standard_normal((m, Hkv, D)).astype(np.float32).astype(dtype) for _ in range(2))
        for pool, a in zip(pools, (k, v)):
            for p in range(per[s]):
                rows = a[p * block_size : (p + 1) * block_size]
                pool[table[s, p], : len(rows)] = rows
        keys.append((k, v))
        queries.append(rng.standard_normal((n, H, D)).astype(np.float32).astype(dtype))
    q = np.concatenate(queries)
    cu_q = np.concatenate([[0], np.cumsum([n for n, _ in sequences])]).astype(np.int32)
    used = np.array([m for _, m in sequences], dtype=np.int32)

    def paged():
        return enp.varlen_attention(q, *pools, cu_q, None, block_table=table, seqused_k=used, causal=True,
                                    backend="cpu")

    def contiguous():
        return np.concatenate([
            enp.attention(q_s[None], k_s[None], v_s[None], layout="bnhd", causal=True, backend="cpu")[0]
            for q_s, (k_s, v_s) in zip(queries, keys)])

    return contiguous, paged, q.shape[0] * H * D * np.dtype(dtype).itemsize


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--decodes", type=int, default=6)
    parser.add_argument("--decode-keys", type=int, default=8192)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-amx", action="store_true", help="config.AMX = False: bfloat16 on the float32 products")
    parser.add_argument("--json", help="also write the figures to this file (benchmarks/_record.py)")
    args = parser.parse_args(argv)
    if args.no_amx:
        from elastic_np.cpu._runtime import config

        config.AMX = False
    sequences = [(1, args.decode_keys)] * args.decodes + [(args.chunk, args.prefix + args.chunk)] * args.chunks
    with _bench.thread_counts(args.threads) as counts:
        cases = {(name, s): make_step(sequences, s, _validation.numpy_dtype(name))
                 for name in args.dtypes for s in args.block_sizes}
        peaks = {}
        for key, (contiguous, paged, out_bytes) in cases.items():
            a, b = contiguous(), paged()
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{key}: the paged step differs"
            peaks[key] = max(0, _bench.traced_peak_bytes(paged) - out_bytes)
        calls = {key: {"contiguous": c, "paged": p} for key, (c, p, _) in cases.items()}
        times = _bench.interleaved(calls, args.rounds, args.repeat)
    print(f"step: {args.decodes} decodes of 1 query over {args.decode_keys} keys, {args.chunks} chunks of "
          f"{args.chunk} queries over {args.prefix} cached keys; causal, 32/8 heads of 128; "
          f"{_bench.describe_threads(counts)}; {args.rounds} rounds, best of {args.repeat}")
    print(f"{'dtype':>9} {'block':>6} {'contiguous ms':>14} {'paged ms':>9}  contiguous/paged   extra peak")
    figures = {}
    for (name, s), by_label in times.items():
        c, p = np.array(by_label["contiguous"]), np.array(by_label["paged"])
        ratio = c / p
        print(f"{name:>9} {s:>6} {np.median(c) * 1e3:>14.1f} {np.median(p) * 1e3:>9.1f}  "
              f"{np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f})   {peaks[name, s] / 2**20:.2f} MiB")
        figures[f"{name}/block{s}"] = {"contiguous_s": _record.summary(c), "paged_s": _record.summary(p),
                                       "contiguous_over_paged": _record.summary(ratio),
                                       "extra_peak_mib": peaks[name, s] / 2**20}
    if args.json:
        _record.write(args.json, "benchmarks/mixed_step.py", argv if argv is not None else sys.argv[1:], figures,
                      threads=_bench.describe_threads(counts), amx=not args.no_amx)


if __name__ == "__main__":
    main()
