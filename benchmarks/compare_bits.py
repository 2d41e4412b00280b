"""The kernels' bits on two source trees of elastic_np: the same calls, compared byte for byte.

For a change that must not move a bit (a restructuring): each tree's
``elastic_np`` runs, in a process of its own (``PYTHONPATH=TREE``), every
conformance-kit case (`elastic_np.testing`'s battery, quick shapes, seeded)
in float32, float64, bfloat16 and float16 through `attention`,
`attention_backward` and, in float32 and float64, `attention_double_backward`;
then decoding (1 and 16 queries over a long grouped cache, every dtype),
packed and paged `varlen_attention` with their backward. The driver compares
every array of the two runs bit for bit and prints the ones that differ.

Usage: ``python benchmarks/compare_bits.py BEFORE_TREE AFTER_TREE [--backend cpu|cuda] [--cases SUBSTRING ...]``
(the trees are directories holding the ``elastic_np`` package; ``cuda`` on a
GPU, or in the simulator under ``NUMBA_ENABLE_CUDASIM=1``, where a few small
cases are enough: ``--cases plain decode``; ``decode`` and ``varlen`` select
those parts). What a backend refuses (an error it raises) is recorded as a
refusal and compared too. Exit status 1 when any array differs.
"""

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile

import numpy as np

DTYPES = ("float32", "float64", "bfloat16", "float16")


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _refusals():
    """The errors a backend gives for what it does not take: recorded as a refusal, the same on both trees."""
    import elastic_np as enp

    return (ValueError, TypeError, NotImplementedError, enp.BackendUnavailableError)


def _refused(results, key, exc):
    results[f"{key}.refused"] = np.frombuffer(type(exc).__name__.encode(), np.uint8)


def _store(results, key, value):
    """Every array of ``value`` (an array; a tuple, list, dict or dataclass of them, nested) under ``key``."""
    if value is None:
        return
    if dataclasses.is_dataclass(value):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        for name, item in value.items():
            _store(results, f"{key}.{name}", item)
        return
    if isinstance(value, (tuple, list)):
        fields = getattr(value, "_fields", None) or range(len(value))
        for name, item in zip(fields, value):
            _store(results, f"{key}.{name}", item)
        return
    array = np.asarray(value)
    if array.dtype == object:
        raise TypeError(f"{key}: not an array of numbers ({type(value).__name__})")
    results[key] = array.view(np.uint8) if array.dtype.kind == "V" or array.dtype.itemsize == 2 else array


def _battery(results, backend, selected):
    import elastic_np as enp
    from elastic_np.testing._cases import CASES, draw_inputs

    for case in CASES:
        if selected and not any(s in case.name for s in selected):
            continue
        for name in DTYPES:
            dtype = _dtype(name)
            q, k, v, dout, options = draw_inputs(case, dtype, seed=1)
            q, k, v, dout = (a.astype(dtype) for a in (q, k, v, dout))
            if "bias" in options:
                options["bias"] = options["bias"].astype(dtype)
            key = f"{case.name}.{name}"
            try:
                out, lse = enp.attention(q, k, v, return_lse=True, backend=backend, **options)
                grads = enp.attention_backward(dout, q, k, v, out, lse, backend=backend, **options)
            except _refusals() as exc:
                _refused(results, key, exc)
                continue
            _store(results, f"{key}.forward", (out, lse))
            _store(results, f"{key}.backward", grads)
            if name in ("float32", "float64"):
                rng = np.random.default_rng(2)
                dd = [rng.standard_normal(a.shape).astype(dtype) for a in (q, k, v)]
                try:
                    second = enp.attention_double_backward(*dd, dout, q, k, v, out, lse, backend=backend, **options)
                except _refusals() as exc:
                    _refused(results, f"{key}.double", exc)
                    continue
                _store(results, f"{key}.double", second)


def _decode(results, backend, selected):
    import elastic_np as enp

    if selected and not any(s in "decode" for s in selected):
        return
    rng = np.random.default_rng(3)
    for name in DTYPES:
        dtype = _dtype(name)
        k, v = (rng.standard_normal((2, 2, 1500, 64)).astype(dtype) for _ in range(2))
        for n in (1, 16):
            q = rng.standard_normal((2, 8, n, 64)).astype(dtype)
            for options in ({}, {"causal": True, "kv_lengths": np.array([700, 1500])},
                            {"nvm": True, "tau": 0.7, "beta": 0.3, "softcap": 20.0}):
                key = f"decode.{name}.{n}.{sorted(options)}"
                try:
                    _store(results, key, enp.attention(q, k, v, return_lse=True, backend=backend, **options))
                except _refusals() as exc:
                    _refused(results, key, exc)


def _varlen(results, backend, selected):
    if selected and not any(s in "varlen" for s in selected):
        return
    rng = np.random.default_rng(4)
    lengths_q, lengths_k = np.array([1, 7, 30, 1]), np.array([40, 7, 90, 300])
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    for name in ("float32", "float64", "bfloat16"):
        try:
            _packed_and_paged(results, backend, name, rng, lengths_q, lengths_k, cu_q, cu_k)
        except _refusals() as exc:
            _refused(results, f"varlen.{name}", exc)


def _packed_and_paged(results, backend, name, rng, lengths_q, lengths_k, cu_q, cu_k):
    import elastic_np as enp

    dtype = _dtype(name)
    q = rng.standard_normal((cu_q[-1], 4, 32)).astype(dtype)
    k, v = (rng.standard_normal((cu_k[-1], 2, 32)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    opts = dict(causal=True, beta=0.2)
    out, lse = enp.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, backend=backend, **opts)
    _store(results, f"varlen.{name}.forward", (out, lse))
    _store(results, f"varlen.{name}.backward",
           enp.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, backend=backend, **opts))
    # the same keys in shuffled pages of 16
    block = 16
    blocks = [int(np.ceil(n / block)) for n in lengths_k]
    order = rng.permutation(sum(blocks))
    pages_k = np.full((len(order), block, 2, 32), np.nan, dtype)
    pages_v = pages_k.copy()
    table = np.zeros((len(blocks), max(blocks)), np.int32)
    page = 0
    for s, n in enumerate(lengths_k):
        for b in range(blocks[s]):
            lo, hi = cu_k[s] + b * block, min(cu_k[s] + (b + 1) * block, cu_k[s + 1])
            pages_k[order[page], :hi - lo], pages_v[order[page], :hi - lo] = k[lo:hi], v[lo:hi]
            table[s, b] = order[page]
            page += 1
    decode_q = rng.standard_normal((len(lengths_k), 4, 32)).astype(dtype)
    _store(results, f"paged.{name}", enp.varlen_attention(
        decode_q, pages_k, pages_v, np.arange(len(lengths_k) + 1, dtype=np.int32), None, block_table=table,
        seqused_k=lengths_k.astype(np.int32), return_lse=True, backend=backend, **opts))


def run_worker(path, backend, selected):
    """In a tree's process: every case's arrays into the ``.npz`` at ``path``."""
    results = {}
    for part in (_battery, _decode, _varlen):
        part(results, backend, selected)
    np.savez(path, **results)


def _run_tree(tree, path, args):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    command = [sys.executable, os.path.abspath(__file__), "--worker", path, "--backend", args.backend,
               "--cases", *args.cases]
    subprocess.run(command, env=env, check=True)
    return np.load(path)


def compare(before, after):
    """The keys whose arrays differ (or exist in one run only), with a line each."""
    lines = []
    for key in sorted(set(before.files) | set(after.files)):
        if key not in before.files or key not in after.files:
            lines.append(f"{key}: only in the {'after' if key in after.files else 'before'} tree")
            continue
        a, b = before[key], after[key]
        if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
            lines.append(f"{key}: differs ({a.dtype}{a.shape} vs {b.dtype}{b.shape})")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--cases", nargs="*", default=[], help="run only the cases whose names hold one of these")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.worker, args.backend, args.cases)
        return 0
    if len(args.trees) != 2:
        parser.error("give two trees: BEFORE_TREE AFTER_TREE")
    with tempfile.TemporaryDirectory() as tmp:
        before, after = (_run_tree(tree, os.path.join(tmp, f"{i}.npz"), args) for i, tree in enumerate(args.trees))
        differing = compare(before, after)
        print(f"{len(before.files)} arrays before, {len(after.files)} after; {len(differing)} differ")
        for line in differing:
            print("  " + line)
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
