"""A user's ``score_mod`` and ``mask_mod`` against the built-in options they rewrite, in one process.

Three comparisons, each forward and forward+backward, float32, 8 heads,
head dim 64, interleaved rounds (best of ``--repeat`` per call, the order
reversed every other round), printed as the user variant's time over the
built-in's, median and range:

- ``softcap``: ``30 tanh(s / 30)`` written as a ``score_mod`` against
  ``softcap=30``, ``(1, 8, N, N)`` with ``N = --length`` (2,048);
- ``window``: a causal sliding window of 256 keys as a ``mask_mod`` with
  its block mask against ``window_size=(256, 0)``;
- ``documents``: 8 documents over ``--doc-length`` tokens (8,192) as a
  ``mask_mod`` with its block mask against the same mask as a dense boolean
  ``mask`` (there the ratio is the dense mask's time over the block mask's).

With ``--flex``, torch's compiled FlexAttention on the CPU (forward only,
the one pass it has there) with the same soft-cap ``score_mod``, over
elastic_np's. With ``--compile``, the first forward of a new ``score_mod``
in a fresh process, twice (Numba does not cache a kernel specialised on
a function passed in, so the second process compiles again).

Usage: ``python benchmarks/variants.py [--rounds R] [--repeat N] [--length N] [--doc-length N] [--flex]
[--compile] [--cases softcap window documents] [--threads T]``
"""

import argparse
import math
import subprocess
import sys
import time

import numpy as np

import elastic_np as enp
from elastic_np.cli import _bench

WINDOW = 256
DOCUMENTS = 8


def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * math.tanh(score / 30.0)


def sliding(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx and q_idx - kv_idx <= WINDOW


def same_document(b, h, q_idx, kv_idx, doc):
    return doc[q_idx] == doc[kv_idx]


def _inputs(length, seed):
    """Seeded ``q, k, v, dout``, ``(1, 8, length, 64)`` float32."""
    q, k, v = _bench.make_inputs(1, 8, length, length, 64, dtype=np.float32, seed=seed)
    return q, k, v, np.random.default_rng(seed + 1).standard_normal(q.shape).astype(np.float32)


def _passes(q, k, v, dout, variant, builtin):
    """``{label: fn}``: the forward and forward+backward of the variant and of the built-in."""
    def forward(options):
        return enp.attention(q, k, v, return_lse=True, backend="cpu", **options)

    def both(options):
        out, lse = forward(options)
        return enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", **options)

    return {"fwd user": lambda: forward(variant), "fwd built-in": lambda: forward(builtin),
            "fwd+bwd user": lambda: both(variant), "fwd+bwd built-in": lambda: both(builtin)}


CASES = ("softcap", "window", "documents")


def comparisons(length, doc_length, cases=CASES):
    """``{case: {label: fn}}`` of the comparisons named in ``cases``."""
    q, k, v, dout = _inputs(length, 3)
    made = {}
    if "softcap" in cases:
        made["softcap"] = _passes(q, k, v, dout, dict(score_mod=softcap), dict(softcap=30.0))
    if "window" in cases:
        window = enp.create_block_mask(sliding, None, None, length, length)
        made["window"] = _passes(q, k, v, dout, dict(block_mask=window), dict(causal=True, window_size=(WINDOW, 0)))
    if "documents" in cases:
        doc = np.repeat(np.arange(DOCUMENTS), -(-doc_length // DOCUMENTS))[:doc_length]
        qd, kd, vd, dd = _inputs(doc_length, 4)
        documents = enp.create_block_mask(same_document, None, None, doc_length, doc_length, captures=(doc,))
        made["documents"] = _passes(qd, kd, vd, dd, dict(block_mask=documents, captures=(doc,)),
                                    dict(mask=doc[:, None] == doc[None, :]))
    return made


def flex_calls(length):
    """``{label: fn}``: torch's compiled FlexAttention and elastic_np, the soft-cap ``score_mod``, forward."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = _inputs(length, 3)[:3]
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    compiled = torch.compile(flex_attention)

    def torch_softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def flex():
        with torch.no_grad():
            return compiled(tq, tk, tv, score_mod=torch_softcap)

    return {"flex": flex, "elastic_np": lambda: enp.attention(q, k, v, score_mod=softcap, backend="cpu")}


_FIRST_CALL = """
import math, time, numpy as np, elastic_np as enp
def new_softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * math.tanh(score / 20.0)
q = k = v = np.ones((1, 2, 64, 64), np.float32)
enp.attention(q, k, v, softcap=5.0, backend="cpu")  # the kernels of the built-in options, from the cache
start = time.perf_counter()
enp.attention(q, k, v, score_mod=new_softcap, backend="cpu")
print(time.perf_counter() - start)
"""


def first_forward_seconds():
    """The first forward of a new ``score_mod`` in a fresh process, for two processes one after the other."""
    runs = [subprocess.run([sys.executable, "-W", "ignore", "-c", _FIRST_CALL], capture_output=True, text=True,
                           check=True) for _ in range(2)]
    return [float(run.stdout.split()[-1]) for run in runs]


def _print_ratios(times, pairs):
    for over, under in pairs:
        ratio = np.array(times[over]) / np.array(times[under])
        print(f"  {over} / {under}: {np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f}), "
              f"{np.median(times[over]) * 1e3:.1f} ms / {np.median(times[under]) * 1e3:.1f} ms")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--doc-length", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flex", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES)
    args = parser.parse_args(argv)
    with _bench.thread_counts(args.threads) as counts:
        groups = comparisons(args.length, args.doc_length, args.cases)
        if args.flex:
            groups["flex"] = flex_calls(args.length)
        start = time.perf_counter()
        times = _bench.interleaved(groups, args.rounds, args.repeat)
    print(f"{_bench.describe_threads(counts)}; {args.rounds} rounds, best of {args.repeat} "
          f"({time.perf_counter() - start:.0f} s); float32, 8 heads, head dim 64")
    for case, length in (("softcap", args.length), ("window", args.length), ("documents", args.doc_length)):
        if case not in groups:
            continue
        print(f"{case} (1, 8, {length}, {length}):")
        pairs = [(f"{p} user", f"{p} built-in") for p in ("fwd", "fwd+bwd")]
        _print_ratios(times[case], [(b, a) for a, b in pairs] if case == "documents" else pairs)
    if args.flex:
        print(f"flex (1, 8, {args.length}, {args.length}), soft-cap score_mod, forward:")
        _print_ratios(times["flex"], [("flex", "elastic_np")])
    if args.compile:
        seconds = first_forward_seconds()
        print(f"first forward of a new score_mod: {seconds[0]:.1f} s, in a second process {seconds[1]:.1f} s")


if __name__ == "__main__":
    main()
