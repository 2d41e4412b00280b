"""Side-by-side CPU attention benchmark: elastic_np's ``cpu`` backend against torch.

Prints, measured in one process with the variants interleaved over several
rounds, GFLOP/s of the CPU kernel, of a naive NumPy evaluation and of
``torch.nn.functional.scaled_dot_product_attention`` (when torch is
installed), the fraction of this machine's matrix-multiply peak, and the
ratios the CPU kernels aim at: torch time / our time (> 1: faster than
torch), float32 and float64, forward and forward + backward; the cost of the
elastic options (nvm + tau + beta) over plain attention; causal speed-up.

With ``--json PATH`` it also writes the ratios (median, min, max over the
rounds) and each case's per-round seconds to a results file
(``benchmarks/_record.py``).

Usage: ``python benchmarks/cpu_vs_torch.py [--rounds R] [--n N] [--heads H] [--json PATH]``
"""

import argparse

import numpy as np

import _record
import elastic_np as enp
try:
    import elastic_np.cli._bench as _bench
except ImportError:  # a tree from before the tools moved to elastic_np.cli
    from elastic_np import _bench


def _ranges(values):
    values = np.asarray(values)
    return f"{values.min():.2f}-{values.max():.2f} (median {np.median(values):.2f})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3, help="best of REPEAT calls per round")
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--no-naive", action="store_true", help="skip the naive NumPy baseline")
    parser.add_argument("--json", metavar="PATH", help="write the ratios and per-round seconds here")
    args = parser.parse_args(argv)

    B, H, N, D = 1, args.heads, args.n, args.dim
    have_torch = _bench.torch_available()
    flops_f = _bench.attention_flops(B, H, N, N, D)
    flops_fb = _bench.attention_flops(B, H, N, N, D, backward=True)
    peak = _bench.matmul_peak_gflops(np.float32)
    print(f"B={B} H={H} N=M={N} D={D}; np.dot float32 peak {peak:.0f} GFLOP/s")

    cases = {}
    for dt in (np.float32, np.float64):
        q, k, v = _bench.make_inputs(B, H, N, N, D, dtype=dt)
        dout = np.random.default_rng(1).standard_normal(q.shape).astype(dt)
        tau = np.full(H, 0.9)
        beta = np.full(H, 0.5)
        name = np.dtype(dt).name

        def fwd(q=q, k=k, v=v, **kw):
            return enp.attention(q, k, v, backend="cpu", **kw)

        def fwd_bwd(q=q, k=k, v=v, dout=dout):
            out, lse = enp.attention(q, k, v, backend="cpu", return_lse=True)
            return enp.attention_backward(dout, q, k, v, out, lse, backend="cpu")

        cases[f"{name} fwd"] = fwd
        cases[f"{name} fwd+bwd"] = fwd_bwd
        if dt is np.float32:
            cases[f"{name} fwd causal"] = lambda fwd=fwd: fwd(causal=True)
            cases[f"{name} fwd nvm+tau+beta"] = lambda fwd=fwd: fwd(nvm=True, tau=tau, beta=beta)
        if have_torch:
            cases[f"{name} torch fwd"] = lambda q=q, k=k, v=v: _bench.torch_sdpa(q, k, v)
            cases[f"{name} torch fwd+bwd"] = lambda q=q, k=k, v=v, dout=dout: _bench.torch_sdpa(
                q, k, v, backward=True, dout=dout
            )
        if dt is np.float32 and not args.no_naive:
            cases[f"{name} naive fwd"] = lambda q=q, k=k, v=v: _bench.naive_attention(q, k, v)

    for fn in cases.values():  # compile / warm up
        fn()
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            times[name].append(_bench.best_time(fn, repeat=args.repeat))
    times = {name: np.array(t) for name, t in times.items()}

    print(f"\n{'case':28s} {'best s':>8s} {'GFLOP/s':>8s} {'% peak':>7s}")
    for name, t in times.items():
        flops = flops_fb if "bwd" in name else flops_f
        if "causal" in name:
            flops = _bench.attention_flops(B, H, N, N, D, causal=True)
        gf = flops / t.min() / 1e9
        print(f"{name:28s} {t.min():8.4f} {gf:8.1f} {100 * gf / peak:6.1f}%")

    ratios = print_ratios(times, args.rounds, have_torch)
    if args.json:
        _record.write(args.json, "benchmarks/cpu_vs_torch.py", argv,
                      {name: _record.summary(r) for name, r in ratios.items()},
                      shape={"B": B, "H": H, "N": N, "M": N, "D": D}, rounds=args.rounds, repeat=args.repeat,
                      seconds={name: t.tolist() for name, t in times.items()})


def print_ratios(times, rounds, have_torch):
    """Print the ratios of ``times`` (case -> per-round seconds) round by round; return them by name."""
    print(f"\nratios over {rounds} interleaved rounds (per round), min-max:")
    ratios = {}
    for dt in ("float32", "float64"):
        if have_torch:
            for part in ("fwd", "fwd+bwd"):
                ratios[f"{dt} {part} torch/ours"] = r = times[f"{dt} torch {part}"] / times[f"{dt} {part}"]
                print(f"  {dt} {part:8s} torch/ours        {_ranges(r)}")
    ratios["float32 fwd full/causal"] = r = times["float32 fwd"] / times["float32 fwd causal"]
    print(f"  float32 causal speed-up full/causal   {_ranges(r)}")
    ratios["float32 fwd nvm+tau+beta/plain"] = r = times["float32 fwd nvm+tau+beta"] / times["float32 fwd"]
    print(f"  float32 nvm+tau+beta overhead         {_ranges(100 * (r - 1.0))} %")
    return ratios

if __name__ == "__main__":
    main()
