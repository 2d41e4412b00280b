"""The CPU kernels' float32 error against a naive float32 evaluation's, on extreme logits.

Draws problems whose logits reach the hundreds or thousands (``q`` and ``k``
scaled by up to 100, ``tau`` down to 0.02, ALiBi over long offsets, with
causal masks, sinks and soft-caps at random), evaluates the float64 oracle,
the CPU kernels in float32 and the naive float32 evaluation in four summation
orders (`elastic_np.testing._tolerances.naive_orderings`), and prints, for
each quantity, the distribution of ``kernel error / naive error`` (median,
99th percentile, max) and how many results the conformance kit's rule
(`~elastic_np.testing._tolerances.kit_allowed`) accepts::

    python benchmarks/float32_extremes.py            # 200 problems
    python benchmarks/float32_extremes.py --problems 20 --seed 1
"""

import argparse

import numpy as np

import elastic_np as enp
from elastic_np import reference
from elastic_np.testing import _tolerances
from elastic_np.testing._report import worst_error

QUANTITIES = ("out", "lse", "dq", "dk", "dv", "dtau", "dbeta")


def draw(rng):
    """``(q, k, v, dout, options)``, float32-exact, with extreme logits."""
    B, H, Hkv, N, M, D = 1, 4, 2, int(rng.integers(8, 96)), int(rng.integers(8, 96)), 32
    width = 10 ** rng.uniform(0, 1)  # logits up to about width**2 * sqrt(D) / sqrt(D)
    q = rng.standard_normal((B, H, N, D)) * width
    k = rng.standard_normal((B, Hkv, M, D)) * width
    v, dout = rng.standard_normal((B, Hkv, M, D)), rng.standard_normal((B, H, N, D))
    options = {}
    if rng.random() < 0.5:
        options["causal"] = True
    if rng.random() < 0.5:
        options["tau"] = float(10 ** rng.uniform(np.log10(0.02), np.log10(50)))
    if rng.random() < 0.3:
        options["beta"] = float(10 ** rng.uniform(-2, 2))
    if rng.random() < 0.3:
        options["softcap"] = float(10 ** rng.uniform(np.log10(5), 3))
    if rng.random() < 0.3:
        options["alibi_slopes"] = 2.0 ** -rng.uniform(0, 8, H)
    q, k, v, dout = (a.astype(np.float32).astype(np.float64) for a in (q, k, v, dout))
    return q, k, v, dout, options


def measure(q, k, v, dout, options):
    """``{quantity: (kernel error, naive error, allowed)}`` of one problem."""
    out, lse = reference.attention(q, k, v, **options)
    with np.errstate(all="ignore"):
        grads = reference.attention_backward(dout, q, k, v, out, lse, **options)
        naive = _tolerances.naive_orderings(q, k, v, dout, options, np.float32)
        rounding = _tolerances.rounding_allowance(q, k, v, dout, options)
    args = [a.astype(np.float32) for a in (q, k, v)]
    got_out, got_lse = enp.attention(*args, return_lse=True, backend="cpu", **options)
    got = enp.attention_backward(dout.astype(np.float32), *args, got_out, got_lse, backend="cpu", **options)
    want = {"out": out, "lse": lse, **{n: getattr(grads, n) for n in QUANTITIES[2:]}}
    have = {"out": got_out, "lse": got_lse, **{n: getattr(got, n) for n in QUANTITIES[2:]}}
    result = {}
    for name in QUANTITIES:
        allowed, naive_error = _tolerances.kit_allowed(
            want[name], [n[name] for n in naive], np.float32, rounding.get(name, 0.0))
        result[name] = (worst_error(have[name], want[name])[0], naive_error, allowed)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    rows = {name: [] for name in QUANTITIES}
    for _ in range(args.problems):
        for name, row in measure(*draw(rng)).items():
            rows[name].append(row)
    print(f"{args.problems} problems; kernel error / naive error (naive: worst of four orders)")
    print(f"{'quantity':9s} {'median':>8s} {'p99':>8s} {'max':>8s} {'naive exact':>12s} {'within rule':>12s}")
    for name, values in rows.items():
        values = np.array(values)
        inexact = values[:, 1] > 0
        ratio = values[inexact, 0] / values[inexact, 1]
        stats = np.percentile(ratio, [50, 99, 100]) if ratio.size else [np.nan] * 3
        within = int(np.sum(values[:, 0] <= values[:, 2]))
        print(f"{name:9s} {stats[0]:8.2f} {stats[1]:8.2f} {stats[2]:8.2f} {int(np.sum(~inexact)):12d} "
              f"{within:8d}/{len(values)}")


if __name__ == "__main__":
    main()
