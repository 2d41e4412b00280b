"""Cost of the score modifiers (softcap, ALiBi, bias) on the CPU kernels.

Measured in one process, the variants interleaved over several rounds (best
of ``--repeat`` calls per round): the time of each variant over plain
attention, forward and forward + backward, as a ratio per round (range and
median over the rounds, with a bootstrap 95% interval of the median). For a
bias, the extra time over plain is set beside the memory work it cannot
avoid, timed in the same rounds: the forward reads the bias once, the
backward reads it again and writes ``dbias``. The goal is a bias that costs
no more than that.

A broadcast bias is read by the kernel once per (batch, head) it is
broadcast over, so a read is timed on the whole broadcast ``(B, H, N, M)``
view (its sum); ``dbias`` has the bias's own shape (filling a fresh array
times writing one). Both share their rows out over Numba's threads, as many
as the kernels use: the kernels' extra time is set beside memory work done
with the same threads.

Usage: ``python benchmarks/score_modifiers.py [--rounds R] [--n N] [--heads H] [--dtype float32] [--threads T]``
"""

import argparse

import numba
import numpy as np

import elastic_np as enp
try:
    import elastic_np.cli._bench as _bench
except ImportError:  # a tree from before the tools moved to elastic_np.cli
    from elastic_np import _bench


def median_interval(values, level=0.95, draws=4000, seed=0):
    """Percentile-bootstrap interval of the median over rounds: ``(low, high)``.

    The rounds are resampled with replacement (fixed seed, so a rerun on the
    same figures prints the same interval). On a noisy machine this is what
    tells "at the goal" from "within the noise of it".
    """
    values = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(values, size=(draws, values.size)), axis=1)
    low, high = np.quantile(medians, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def _ranges(values, fmt="{:.3f}"):
    values = np.asarray(values)
    low, high = median_interval(values)
    return (
        f"{fmt.format(values.min())}-{fmt.format(values.max())} "
        f"(median {fmt.format(np.median(values))}, 95% {fmt.format(low)}-{fmt.format(high)})"
    )


@numba.njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True)
def _read_broadcast(bias4, B, H, N):
    """The sum of ``bias4`` (4-D, C order) broadcast to ``(B, H, N, M)``, row by row over the threads."""
    total = 0.0
    for t in numba.prange(B * H * N):
        b = min(t // (H * N), bias4.shape[0] - 1)
        h = min(t // N % H, bias4.shape[1] - 1)
        row = bias4[b, h, min(t % N, bias4.shape[2] - 1)]
        partial = 0.0
        for j in range(row.shape[0]):
            partial += row[j]
        total += partial
    return total


@numba.njit(parallel=True, cache=True)
def _fill_rows(rows):
    """``rows[:] = 1`` (2-D, C order), row by row over the threads."""
    for t in numba.prange(rows.shape[0]):
        rows[t, :] = 1.0


def read_bias(bias, B, H, N):
    """Read ``bias`` as the kernels do: its broadcast ``(B, H, N, M)`` view, once.

    A bias laid out along the queries (``.mT`` of a C-order array, as the
    kernels read it without a copy) is read in its memory order: its
    transpose, ``M`` rows per head.
    """
    bias4 = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    rows = N
    if not bias4.flags.c_contiguous and bias4.mT.flags.c_contiguous:
        bias4 = bias4.mT
        rows = bias4.shape[2]
    return _read_broadcast(np.ascontiguousarray(bias4), B, H, rows)


def write_like(bias):
    """Write a fresh array of the bias's shape, as the backward writes ``dbias`` (C order)."""
    out = np.empty(bias.shape, dtype=bias.dtype)
    _fill_rows(out.reshape(-1, out.shape[-1]))
    return out


def make_cases(n=2048, heads=8, dim=64, dtype="float32", backward=True):
    """The timed cases: ``(variants, biases, cases)``, ``cases[(name, pass)]`` a callable.

    Every input comes from fixed seeds, so separate processes (for instance
    two versions of the package, see ``compare_trees.py``) time the same work.
    """
    B, H, N, D = 1, heads, n, dim
    dt = np.dtype(dtype)
    q, k, v = _bench.make_inputs(B, H, N, N, D, dtype=dt)
    dout = np.random.default_rng(1).standard_normal(q.shape).astype(dt)
    rng = np.random.default_rng(2)
    slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)  # the ALiBi paper's slopes
    biases = {
        "bias (B,H,N,M)": rng.standard_normal((B, H, N, N)).astype(dt),
        # the same shape laid out along the queries: added without a transpose
        "bias mT(B,H,N,M)": np.ascontiguousarray(rng.standard_normal((B, H, N, N)).astype(dt).mT).mT,
        "bias (N,M)": rng.standard_normal((N, N)).astype(dt),
        "bias (B,1,1,M)": np.where(rng.random((B, 1, 1, N)) < 0.1, -np.inf, 0.0).astype(dt),
    }
    variants = {
        "plain": {},
        "softcap": {"softcap": 5.0},
        "alibi": {"alibi_slopes": slopes},
        "softcap+alibi": {"softcap": 5.0, "alibi_slopes": slopes},
    }
    variants.update({name: {"bias": bias} for name, bias in biases.items()})

    def fwd(options):
        return lambda: enp.attention(q, k, v, backend="cpu", **options)

    def fwd_bwd(options):
        def run():
            out, lse = enp.attention(q, k, v, backend="cpu", return_lse=True, **options)
            return enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", **options)

        return run

    cases = {}
    for name, options in variants.items():
        cases[(name, "fwd")] = fwd(options)
        if backward:
            cases[(name, "fwd+bwd")] = fwd_bwd(options)
    for name, bias in biases.items():
        # what the kernels must read (the broadcast view, once per pass) and
        # write (dbias in the bias's own shape, a fresh array)
        cases[(name, "read")] = lambda bias=bias: read_bias(bias, B, H, N)
        cases[(name, "write")] = lambda bias=bias: write_like(bias)
    return variants, biases, cases


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=2, help="best of REPEAT calls per round")
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--threads", type=int, default=None, help="Numba threads (default: all)")
    args = parser.parse_args(argv)
    if args.threads:
        numba.set_num_threads(args.threads)

    variants, biases, cases = make_cases(
        args.n, args.heads, args.dim, args.dtype, backward=not args.no_backward
    )
    print(
        f"B=1 H={args.heads} N=M={args.n} D={args.dim} {args.dtype}, {args.rounds} rounds, "
        f"best of {args.repeat}, {numba.get_num_threads()} threads"
    )
    for fn in cases.values():  # compile and warm up
        fn()

    times = {key: [] for key in cases}
    for _ in range(args.rounds):
        for key, fn in cases.items():
            times[key].append(_bench.best_time(fn, repeat=args.repeat))
    times = {key: np.array(t) for key, t in times.items()}

    print(f"\n{'variant':<16} {'pass':<8} {'time s (median)':>16}  ratio to plain, per round")
    for name in variants:
        for kind in ("fwd", "fwd+bwd"):
            if (name, kind) not in times:
                continue
            t = times[(name, kind)]
            ratio = t / times[("plain", kind)]
            best = t.min() / times[("plain", kind)].min()
            print(f"{name:<16} {kind:<8} {np.median(t):>16.4f}  {_ranges(ratio)}; of the best rounds {best:.3f}")

    print(
        f"\n{'bias':<16} {'pass':<8} {'extra over plain s':<58}  {'memory s':>8}  "
        "extra / memory, per round"
    )
    for name in biases:
        read, write = times[(name, "read")], times[(name, "write")]
        # the forward reads the bias once; the backward reads it again and writes dbias
        memory = {"fwd": read, "fwd+bwd": 2 * read + write}
        for kind in ("fwd", "fwd+bwd"):
            if (name, kind) not in times:
                continue
            extra = times[(name, kind)] - times[("plain", kind)]
            # as "of the best rounds" above: the least disturbed time of each
            best = (times[(name, kind)].min() - times[("plain", kind)].min()) / memory[kind].min()
            print(
                f"{name:<16} {kind:<8} {_ranges(extra, '{:+.4f}'):<58}  {np.median(memory[kind]):>8.4f}  "
                f"{_ranges(extra / memory[kind], '{:+.2f}')}; of the best rounds {best:+.2f}"
            )
    print(
        "\nmemory: the time to read the bias once (the sum of its broadcast (B, H, N, M) view)"
        "\nfor fwd; for fwd+bwd twice that plus writing a fresh array of the bias's shape once,"
        "\nthe dbias the backward returns. Read and write use the kernels' threads and are timed"
        "\nin the same rounds."
        "\nOf the best rounds: the fastest round's extra over the fastest plain, over the fastest memory."
    )

if __name__ == "__main__":
    main()
