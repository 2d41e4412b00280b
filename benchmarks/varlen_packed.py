"""A packed batch (`elastic_np.varlen_attention`) against the same sequences padded to the longest, side by side.

Eight sequences whose padded batch is half padding (``--lengths``, by default
2048, 1536, 1024, 1024, 768, 768, 512, 512 of 2048), 8 heads of 64, float32,
causal: the padded call is ``attention`` on ``(8, 8, 2048, 64)`` with
``kv_lengths`` (the padded keys are never read; the padded queries are
computed), the packed one ``varlen_attention`` on the ``(8192, 8, 64)``
tokens. Forward, and forward + backward, alternate round by round in this
process; printed: each one's median and padded / packed per round (median and
range).

Usage: ``python benchmarks/varlen_packed.py [--lengths L ...] [--rounds R] [--not-causal]``
"""

import argparse
import time

import numpy as np

import elastic_np as enp


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def calls(lengths, heads=8, dim=64, causal=True, seed=0):
    """``{(layout, pass): call}`` for the padded and the packed batch of the same tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    B, N = lengths.size, int(lengths.max())
    cu = np.concatenate([[0], np.cumsum(lengths)])
    q, k, v, dout = (rng.standard_normal((cu[-1], heads, dim)).astype(np.float32) for _ in range(4))

    def padded(a):
        out = np.zeros((B, heads, N, dim), np.float32)
        for s in range(B):
            out[s, :, :lengths[s]] = a[cu[s]:cu[s + 1]].transpose(1, 0, 2)
        return out

    pq, pk, pv, pdout = (padded(a) for a in (q, k, v, dout))
    options = {"causal": causal, "backend": "cpu"}

    def padded_backward():
        out, lse = enp.attention(pq, pk, pv, kv_lengths=lengths, return_lse=True, **options)
        enp.attention_backward(pdout, pq, pk, pv, out, lse, kv_lengths=lengths, **options)

    def packed_backward():
        out, lse = enp.varlen_attention(q, k, v, cu, cu, return_lse=True, **options)
        enp.varlen_attention_backward(dout, q, k, v, out, lse, cu, cu, **options)

    return {
        ("padded", "forward"): lambda: enp.attention(pq, pk, pv, kv_lengths=lengths, **options),
        ("packed", "forward"): lambda: enp.varlen_attention(q, k, v, cu, cu, **options),
        ("padded", "forward+backward"): padded_backward,
        ("packed", "forward+backward"): packed_backward,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 1536, 1024, 1024, 768, 768, 512, 512])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--not-causal", action="store_true")
    args = parser.parse_args(argv)
    cases = calls(args.lengths, causal=not args.not_causal)
    for call in cases.values():
        call()  # compile or load the kernels
    times = {key: [] for key in cases}
    for r in range(args.rounds):
        for key in list(cases)[:: 1 if r % 2 == 0 else -1]:
            times[key].append(_timed(cases[key]))
    padding = 1 - sum(args.lengths) / (len(args.lengths) * max(args.lengths))
    print(f"{len(args.lengths)} sequences {args.lengths}, {padding:.0%} padding, 8 heads x 64, float32, "
          f"{'not ' if args.not_causal else ''}causal, {args.rounds} rounds")
    for what in ("forward", "forward+backward"):
        padded, packed = np.array(times[("padded", what)]), np.array(times[("packed", what)])
        ratio = padded / packed
        print(f"  {what:<17} padded {1e3 * np.median(padded):8.1f} ms  packed {1e3 * np.median(packed):8.1f} ms  "
              f"padded / packed {np.median(ratio):.2f} [{ratio.min():.2f}-{ratio.max():.2f}]")


if __name__ == "__main__":
    main()
