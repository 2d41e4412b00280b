"""What `elastic_np.torch.attention` adds to the NumPy entry points, forward + backward.

Times, side by side in one process over interleaved rounds, the same float32
problem two ways: through the adapter (``out = attention(q, k, v)``,
``out.backward(dout)`` on tensors that require grad) and by calling
`elastic_np.attention` and `elastic_np.attention_backward` directly, both on
the CPU kernels. Both keep the gradients of a step until the start of the
next (autograd keeps them in ``.grad``), so that both leave the memory
allocator in the same state. Prints the ratio adapter / direct per round:
median and range. Without options, and with per-head ``tau`` and ``beta`` (tensors that
require grad in the adapter, so ``dtau`` and ``dbeta`` reach autograd).

Usage: ``python benchmarks/torch_adapter_overhead.py [--rounds R] [--n N] [--heads H] [--dim D]``
"""

import argparse

import numpy as np
import torch

import elastic_np as enp
import elastic_np.torch as enpt
try:
    import elastic_np.cli._bench as _bench
except ImportError:  # a tree from before the tools moved to elastic_np.cli
    from elastic_np import _bench


def make_cases(n, heads, dim):
    """``{(variant, "adapter" | "direct"): callable}`` running forward + backward once."""
    q, k, v = _bench.make_inputs(1, heads, n, n, dim, dtype=np.float32)
    dout = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
    tensors = [torch.from_numpy(a).requires_grad_() for a in (q, k, v)]
    dout_t = torch.from_numpy(dout)
    tau = np.linspace(0.7, 1.3, heads)
    beta = np.linspace(0.2, 1.0, heads)
    tau_t, beta_t = (torch.tensor(a, requires_grad=True) for a in (tau, beta))
    cases = {}
    for variant, numpy_opts, torch_opts in (
        ("plain", {}, {}),
        ("tau+beta", {"tau": tau, "beta": beta}, {"tau": tau_t, "beta": beta_t}),
    ):
        def adapter(opts=torch_opts):
            for t in (*tensors, tau_t, beta_t):
                t.grad = None
            enpt.attention(*tensors, backend="cpu", **opts).backward(dout_t)
            return tensors[0].grad

        def direct(opts=numpy_opts, held=[]):
            held.clear()  # as the adapter's .grad = None: last step's gradients go first
            out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
            held.append(enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", **opts))
            return held[0].dq

        cases[(variant, "adapter")] = adapter
        cases[(variant, "direct")] = direct
    return cases


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeat", type=int, default=3, help="best of REPEAT calls per round")
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args(argv)

    cases = make_cases(args.n, args.heads, args.dim)
    for (variant, _), fn in cases.items():  # compile / warm up
        fn()
    for variant in ("plain", "tau+beta"):  # the same gradient both ways
        np.testing.assert_array_equal(cases[(variant, "adapter")]().numpy(), cases[(variant, "direct")]())
    times = {key: [] for key in cases}
    order = list(cases)
    for r in range(args.rounds):
        for key in order if r % 2 == 0 else order[::-1]:  # no case always runs first
            times[key].append(_bench.best_time(cases[key], repeat=args.repeat))

    print(f"B=1 H={args.heads} N=M={args.n} D={args.dim} float32, forward + backward, "
          f"{args.rounds} interleaved rounds, alternating order (best of {args.repeat} per round)")
    for variant in ("plain", "tau+beta"):
        adapter = np.array(times[(variant, "adapter")])
        direct = np.array(times[(variant, "direct")])
        ratio = adapter / direct
        print(f"  {variant:9s} adapter {np.median(adapter) * 1e3:8.2f} ms  direct "
              f"{np.median(direct) * 1e3:8.2f} ms  adapter/direct median {np.median(ratio):.3f} "
              f"(range {ratio.min():.3f}-{ratio.max():.3f})")


if __name__ == "__main__":
    main()
