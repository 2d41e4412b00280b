"""One machine's ``enp.attention`` against ``elastic_np.dask`` on a LocalCluster of single-thread workers.

Two measurements:

1. **Overhead**, at a size that fits one process: the CPU kernels called
   directly (on as many Numba threads as the cluster has worker threads)
   against the same attention cut into chunks and run on a
   ``distributed.LocalCluster`` of ``--workers`` single-thread worker
   processes, the inputs already on the workers (persisted) and the result
   gathered back. Timed in one process over interleaved rounds (best of
   ``--repeat`` calls each); the ratio Dask / direct per round, median and range.
2. **Keys beyond a worker's memory limit**: ``K`` and ``V`` generated on the
   workers in key chunks, larger together than ``--memory-limit`` of each
   worker, a few queries attending to all of them; the wall time and each
   worker's peak resident memory (``VmHWM``, Linux, of a fresh cluster).

Usage: ``python benchmarks/dask_scaling.py [--n N] [--heads H] [--dim D] [--chunk C]
[--rounds R] [--keys M] [--memory-limit MIB]``
"""

import argparse
import time
import warnings

import numba
import numpy as np

import elastic_np as enp


def _peak_rss():
    """This process's peak resident memory in bytes: ``VmHWM`` (``ru_maxrss`` of a spawned
    worker also counts the parent's memory at the fork before its ``exec``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _cluster(distributed, workers, memory_limit):
    return distributed.LocalCluster(
        n_workers=workers, threads_per_worker=1, processes=True, memory_limit=memory_limit,
        dashboard_address=None, silence_logs=40,
    )


def overhead(args, distributed, da, enpd):
    """Rounds of (direct, dask) best times; returns the list of ratios."""
    rng = np.random.default_rng(0)
    shape = (1, args.heads, args.n, args.dim)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    opts = dict(causal=True)
    previous = numba.get_num_threads()
    numba.set_num_threads(min(args.workers, numba.config.NUMBA_NUM_THREADS))
    with _cluster(distributed, args.workers, args.memory_limit * 2**20) as cluster, \
            distributed.Client(cluster) as client:
        chunks = (1, max(1, args.heads // args.workers), args.chunk, args.dim)
        with warnings.catch_warnings():  # "Sending large graph": the inputs, once
            warnings.simplefilter("ignore", UserWarning)
            qd, kd, vd = client.persist([da.from_array(a, chunks=chunks) for a in (q, k, v)])
        qt, kt, vt = (da.from_array(a, chunks=chunks) for a in (q, k, v))
        variants = {
            "direct": lambda: enp.attention(q, k, v, backend="cpu", **opts),
            "threads": lambda: enpd.attention(qt, kt, vt, **opts).compute(scheduler="threads"),
            "cluster": lambda: enpd.attention(qd, kd, vd, **opts).compute(),
        }
        want = variants["direct"]()
        error = max(float(np.abs(variants[name]() - want).max()) for name in ("threads", "cluster"))
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, call in variants.items():
                best = np.inf
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    call()
                    best = min(best, time.perf_counter() - t0)
                times[name].append(best)
    numba.set_num_threads(previous)
    threads = min(args.workers, numba.config.NUMBA_NUM_THREADS)
    blocks = (args.n // args.chunk) * (args.n // args.chunk + 1) // 2 * (args.heads // chunks[1])
    print(f"overhead: B=1 H={args.heads} N=M={args.n} D={args.dim} float32 causal; "
          f"chunks of {chunks[1]} heads x {args.chunk} rows/keys ({blocks} block tasks)")
    labels = {
        "direct": f"enp.attention, {threads} Numba threads",
        "threads": f"elastic_np.dask, threaded scheduler ({threads} threads), in this process",
        "cluster": f"elastic_np.dask, LocalCluster {args.workers} workers x 1 thread",
    }
    for name, label in labels.items():
        t = np.array(times[name]) * 1e3
        print(f"  {label:<66} median {np.median(t):8.1f} ms (range {t.min():.1f}-{t.max():.1f})")
    ratios = {}
    for name in ("threads", "cluster"):
        r = np.array(times[name]) / np.array(times["direct"])
        ratios[name] = r
        print(f"  ratio {name} / direct over {args.rounds} rounds: median {np.median(r):.2f} "
              f"(range {r.min():.2f}-{r.max():.2f})")
    print(f"  max |diff| from direct: {error:.1e}")
    return ratios


def beyond_memory(args, distributed, da, enpd):
    """Attention over keys larger than a worker's memory limit; returns each worker's peak RSS."""
    limit = args.memory_limit * 2**20
    chunk = args.key_chunk
    M = args.keys
    with _cluster(distributed, args.workers, limit) as cluster, distributed.Client(cluster) as client:
        rng = da.random.default_rng(0)
        k = rng.standard_normal((1, 1, M, args.dim), chunks=(1, 1, chunk, args.dim), dtype=np.float32)
        v = rng.standard_normal((1, 1, M, args.dim), chunks=(1, 1, chunk, args.dim), dtype=np.float32)
        q = np.random.default_rng(1).standard_normal((1, 1, args.queries, args.dim)).astype(np.float32)
        client.run(lambda: enp.attention(q, q, q, backend="cpu"))  # compile or load the kernels first
        t0 = time.perf_counter()
        out, lse = client.compute(list(enpd.attention(q, k, v, return_lse=True)), sync=True)
        elapsed = time.perf_counter() - t0
        peaks = client.run(_peak_rss)
    kv = (k.nbytes + v.nbytes) / 2**20
    print(f"beyond memory: {args.queries} queries over M={M} keys, D={args.dim} float32: "
          f"K and V {kv:.0f} MiB, {M // chunk} key chunks of {chunk}; memory limit {args.memory_limit} MiB "
          f"per worker")
    print(f"  completed in {elapsed:.2f} s, finite: {bool(np.isfinite(out).all() and np.isfinite(lse).all())}")
    for worker, peak in sorted(peaks.items()):
        print(f"  worker {worker}: peak resident {peak / 2**20:.0f} MiB ({peak / limit:.0%} of its limit)")
    return peaks


def main(argv=None):
    import dask.array as da
    import distributed

    import elastic_np.dask as enpd

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048, help="queries and keys of the overhead case")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=512, help="query and key chunk of the overhead case")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keys", type=int, default=3 * 2**20, help="keys of the beyond-memory case")
    parser.add_argument("--key-chunk", type=int, default=2**17)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--memory-limit", type=int, default=1024, help="MiB per worker")
    args = parser.parse_args(argv)
    overhead(args, distributed, da, enpd)
    beyond_memory(args, distributed, da, enpd)


if __name__ == "__main__":
    main()
