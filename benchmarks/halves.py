"""bfloat16 and float16 in the CPU kernels against float32 and torch's SDPA on the same dtypes, in one process.

Cases (the shapes of issue #43):

- decode: one query, ``B=1``, 32 query heads on 8 key/value heads, a cache
  of ``--cache`` keys (8,192), head dim 128: elastic_np on a bfloat16,
  float16 and float32 cache, torch SDPA on bfloat16 and float32 tensors
  (``enable_gqa``);
- prefill: ``(1, 8, --n, 64)`` forward (2,048; ``--causal`` for the causal
  case): elastic_np and torch SDPA in bfloat16, float16 and float32, and on a
  CPU with AMX tiles elastic_np bfloat16 with the float32 products too
  (``config.AMX`` off).

Every call of a case is timed in each round (best of ``--repeat``), the
order alternating from round to round; printed per case: each call's median
seconds and the ratios that the issue sets goals on, their median and range
over the rounds. Threads: ``--threads`` for the kernels, torch and BLAS
alike (both cores by default).

Usage: ``python benchmarks/halves.py [--rounds R] [--repeat N] [--cache M] [--n N] [--causal] [--threads T]``
"""

import argparse

import ml_dtypes
import numpy as np
import torch

import elastic_np as enp
from elastic_np.cli import _bench

_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_NUMPY = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}


def _tensor(a, name):
    """The float32 array ``a`` as a torch tensor of dtype ``name``."""
    return torch.from_numpy(a).to(_TORCH[name])


def decode_calls(cache):
    """``{label: fn}`` for the decode case."""
    q, k, v = _bench.make_inputs(1, 32, 1, cache, 128, Hkv=8, dtype=np.float32, seed=2)
    calls = {}
    for name in ("bfloat16", "float16", "float32"):
        args = tuple(a.astype(_NUMPY[name]) for a in (q, k, v))
        calls[f"elastic_np {name}"] = lambda a=args: enp.attention(*a, backend="cpu")
    for name in ("bfloat16", "float32"):
        args = tuple(_tensor(a, name) for a in (q, k, v))
        calls[f"torch {name}"] = lambda a=args: torch.nn.functional.scaled_dot_product_attention(*a, enable_gqa=True)
    return calls


def prefill_calls(n, causal):
    """``{label: fn}`` for the prefill forward."""
    q, k, v = _bench.make_inputs(1, 8, n, n, 64, dtype=np.float32)
    calls = {}
    for name in ("bfloat16", "float16", "float32"):
        args = tuple(a.astype(_NUMPY[name]) for a in (q, k, v))
        calls[f"elastic_np {name}"] = lambda a=args: enp.attention(*a, causal=causal, backend="cpu")
        tensors = tuple(_tensor(a, name) for a in (q, k, v))
        calls[f"torch {name}"] = lambda a=tensors: torch.nn.functional.scaled_dot_product_attention(
            *a, is_causal=causal)
    if amx_in_use():
        args = tuple(a.astype(_NUMPY["bfloat16"]) for a in (q, k, v))
        calls[_NO_TILES] = lambda a=args: _without_tiles(enp.attention, *a, causal=causal, backend="cpu")
    return calls


#: The label of the bfloat16 prefill with the float32 products, where the CPU has AMX tiles.
_NO_TILES = "elastic_np bfloat16, no AMX"


def amx_in_use():
    """Whether a bfloat16 prefill runs on AMX tiles here (`elastic_np.cpu._prefill.forward_amx`)."""
    from elastic_np.cpu._runtime import config as _config
    from elastic_np.cpu._tiles import amx as _amx

    return _config.AMX and _amx.permitted()


def _without_tiles(fn, *args, **kwargs):
    from elastic_np.cpu._runtime import config as _config

    _config.AMX = False
    try:
        return fn(*args, **kwargs)
    finally:
        _config.AMX = True


#: The ratios printed per case: (numerator, denominator) seconds, so > 1 means the denominator is faster.
RATIOS = {
    "decode": [("elastic_np float32", "elastic_np bfloat16"), ("torch bfloat16", "elastic_np bfloat16"),
               ("elastic_np float32", "elastic_np float16"), ("torch float32", "elastic_np float32")],
    "prefill": [("torch bfloat16", "elastic_np bfloat16"), ("torch float16", "elastic_np float16"),
                ("torch float32", "elastic_np float32"), ("elastic_np float32", "elastic_np bfloat16")],
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cache", type=int, default=8192)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    with _bench.thread_counts(args.threads) as counts:
        cases = {"decode": decode_calls(args.cache), "prefill": prefill_calls(args.n, args.causal)}
        times = _bench.interleaved(cases, args.rounds, args.repeat)
    print(f"decode (1, 32/8, 1, {args.cache}, 128); prefill forward (1, 8, {args.n}, 64)"
          f"{' causal' if args.causal else ''}; {_bench.describe_threads(counts)}; "
          f"{args.rounds} rounds, best of {args.repeat}; torch {torch.__version__}")
    for case, by_label in times.items():
        print(f"{case}:")
        for label, seconds in by_label.items():
            print(f"  {label:<20} {np.median(seconds) * 1e3:9.3f} ms")
        for num, den in RATIOS[case] + ([(_NO_TILES, "elastic_np bfloat16")] if _NO_TILES in by_label else []):
            ratio = np.array(by_label[num]) / np.array(by_label[den])
            print(f"  {num} / {den}: {np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f})")


if __name__ == "__main__":
    main()
