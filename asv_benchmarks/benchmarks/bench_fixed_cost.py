"""The fixed cost of a small call, where a call is mostly its Python: the figures of the fixed-cost issue.

A 64-key decode (8 query heads over 2 kv heads, D = 64, float32, B = 1)
through `elastic_np.attention`, through an explicit plan (`elastic_np.plan`,
skipped in commits that have none), and a growing cache's step (two calls,
two layers, on a cache one key longer each time); and a 16 x 16 causal
forward + backward. ``setup`` makes every call once first, so that no timing
includes a compile or a plan being made.
"""

import numpy as np

import elastic_np as enp

from . import common

CALLS = ["decode", "planned decode", "growing cache step", "16 x 16 causal fwd + bwd"]


class FixedCost:
    """One small call per benchmark."""

    params = [CALLS]
    param_names = ["call"]

    def setup(self, call):
        common.require_backend("cpu")
        rng = np.random.default_rng(common.SEED)
        q = rng.standard_normal((1, 8, 1, 64), dtype=np.float32)
        k, v = (rng.standard_normal((1, 2, 64, 64), dtype=np.float32) for _ in range(2))
        if call == "decode":
            self.run = lambda: enp.attention(q, k, v, backend="cpu")
        elif call == "planned decode":
            if not hasattr(enp, "plan"):
                raise NotImplementedError("elastic_np.plan is not in this version of the package")
            made = enp.plan(q.shape, k.shape, backend="cpu")
            self.run = lambda: made.run(q, k, v)
        elif call == "growing cache step":
            self.run = self._growing(rng, q)
        else:
            q, k, v, dout = (rng.standard_normal((1, 8, 16, 64), dtype=np.float32) for _ in range(4))

            def step():
                out, lse = enp.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
                return enp.attention_backward(dout, q, k, v, out, lse, causal=True, backend="cpu")
            self.run = step
        for _ in range(3):  # the plan made, its kernels' entry points found
            self.run()

    @staticmethod
    def _growing(rng, q):
        """Two calls a step over caches of 2 kv heads that grow by one key a step (wrapping at 512)."""
        caches = [rng.standard_normal((1, 2, 1024, 64), dtype=np.float32) for _ in range(4)]
        lengths = iter(range(10**9))

        def step():
            M = 512 + next(lengths) % 512
            for layer in range(2):
                k, v = (np.ascontiguousarray(c[:, :, :M]) for c in caches[2 * layer: 2 * layer + 2])
                enp.attention(q, k, v, backend="cpu")
        return step

    def time_call(self, call):
        self.run()
