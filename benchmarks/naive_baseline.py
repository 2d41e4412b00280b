"""The naive evaluations of the conformance kit and of `_bench`, dumped and compared across a change.

The float32 naive evaluation sets every float32 tolerance (twice its error
against the float64 oracle), so a change to the oracle's code or to the naive
evaluation must show what it does to them::

    git stash; python benchmarks/naive_baseline.py dump /tmp/before.npz; git stash pop
    python benchmarks/naive_baseline.py dump /tmp/after.npz
    python benchmarks/naive_baseline.py compare /tmp/before.npz /tmp/after.npz

``dump`` stores, for every case of the kit (quick and full sizes, float32
and float64 inputs), the oracle's outputs and gradients, the naive evaluation
in each summation order of ``naive_orderings``, the rounding allowance
(``summation_allowance`` in trees from before it was renamed), and
`_bench.naive_attention`/`naive_attention_backward` where the case has only
``causal``/``scale``. ``compare`` prints how many arrays are bitwise
identical, the largest change of each kind relative to its largest value, and
the ratio after/before of the naive baseline errors ``max |naive - oracle|``.
"""

import sys

import numpy as np

from elastic_np import reference
from elastic_np.testing import _cases, _tolerances

try:
    import elastic_np.cli._bench as _bench
except ImportError:  # a tree from before the tools moved to elastic_np.cli
    from elastic_np import _bench
from elastic_np.testing._report import worst_error


def dump(path):
    out = {}
    for dtype in (np.float32, np.float64):
        dn = np.dtype(dtype).name
        for case in _cases.CASES:
            for quick in (True, False):
                q, k, v, dout, options = _cases.draw_inputs(case, dtype, quick=quick)
                o, l = reference.attention(q, k, v, **options)
                with np.errstate(invalid="ignore", divide="ignore"):
                    g = reference.attention_backward(dout, q, k, v, o, l, **options)
                for name, val in dict(out=o, lse=l, dq=g.dq, dk=g.dk, dv=g.dv, dtau=g.dtau, dbeta=g.dbeta,
                                      dsigma=g.dsigma, dbias=g.dbias).items():
                    if val is not None:
                        out[f"oracle|{dn}|{case.name}|{quick}|{name}"] = np.asarray(val)
                allowance = getattr(_tolerances, "rounding_allowance", None) or _tolerances.summation_allowance
                for name, val in allowance(q, k, v, dout, options).items():
                    out[f"allowance|{dn}|{case.name}|{quick}|{name}"] = np.asarray(val)
                for n, res in enumerate(_tolerances.naive_orderings(q, k, v, dout, options, dtype)):
                    for name, val in res.items():
                        out[f"kit|{dn}|{case.name}|{quick}|{n}|{name}"] = np.asarray(val)
                if set(options) <= {"causal", "scale"}:
                    args = [a.astype(dtype) for a in (q, k, v, dout)]
                    causal = options.get("causal", False)
                    scale = options.get("scale")
                    out[f"bench|{dn}|{case.name}|{quick}|out"] = _bench.naive_attention(*args[:3], causal=causal, scale=scale)
                    for name, val in zip(("out", "dq", "dk", "dv"), _bench.naive_attention_backward(*args, causal=causal, scale=scale)):
                        out[f"bench|{dn}|{case.name}|{quick}|bwd_{name}"] = val
    np.savez(path, **out)
    print(len(out), "arrays")


def _baselines(d, dtype):
    res = {}
    for key in d.files:
        parts = key.split("|")
        if parts[0] != "kit" or parts[1] != dtype:
            continue
        _, dn, case, quick, n, name = parts
        want = d[f"oracle|{dn}|{case}|{quick}|{name}"]
        err = worst_error(d[key], want)[0]
        k = (case, quick, name)
        res[k] = max(res.get(k, 0.0), err)
    return res


def compare(path_a, path_b):
    a, b = np.load(path_a), np.load(path_b)
    assert set(a.files) == set(b.files), set(a.files) ^ set(b.files)
    same = 0
    worst = {}
    nonfinite = []
    for key in sorted(a.files):
        x, y = a[key], b[key]
        if np.array_equal(x, y, equal_nan=True):
            same += 1
            continue
        fin = np.isfinite(x) & np.isfinite(y)
        if not np.array_equal(np.isfinite(x), np.isfinite(y)):
            nonfinite.append(key)
        scale = max(float(np.max(np.abs(x[fin]), initial=0.0)), 1e-300)
        rel = float(np.max(np.abs(x[fin].astype(np.float64) - y[fin]), initial=0.0) / scale)
        parts = key.split("|")
        group = f"{parts[0]}|{parts[1]}|{parts[-1]}"
        worst[group] = max(worst.get(group, 0.0), rel)
    print(f"{same}/{len(a.files)} arrays bitwise identical")
    for g, r in sorted(worst.items()):
        print(f"  changed: {g}: max |change| / max |value| = {r:.3e}")
    print("  finite/non-finite pattern differs:", nonfinite)
    for dtype in ("float32", "float64"):
        ba, bb = _baselines(a, dtype), _baselines(b, dtype)
        ratios = {k: (bb[k] / ba[k] if ba[k] > 0 else (1.0 if bb[k] == 0 else np.inf)) for k in ba}
        unchanged = sum(ba[k] == bb[k] for k in ba)
        lo, hi = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
        print(f"{dtype} baseline errors: {unchanged}/{len(ba)} identical; ratio after/before "
              f"min {ratios[lo]:.4f} {lo}, max {ratios[hi]:.4f} {hi}; "
              f"median {np.median(list(ratios.values())):.4f}")
        big = sorted(((abs(np.log(r)), k, r) for k, r in ratios.items() if np.isfinite(r)), reverse=True)[:8]
        for _, k, r in big:
            print(f"    {k}: before {ba[k]:.3e} after {bb[k]:.3e} ratio {r:.3f}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
