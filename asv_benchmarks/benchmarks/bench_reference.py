"""The float64 attention oracle (`elastic_np.reference`) at small sizes."""

import numpy as np

from elastic_np import reference as ref

from .common import kv_heads, make_dout, make_inputs, variant_options


class ReferenceAttention:
    """Forward and hand-derived backward of the float64 oracle."""

    params = [["plain", "elastic", "dynamic_window", "gqa"], [64, 256]]
    param_names = ["variant", "N"]

    def setup(self, variant, N):
        self.q, self.k, self.v = make_inputs(N, np.float64, Hkv=kv_heads(variant))
        self.options = variant_options(variant)
        self.dout = make_dout(N, np.float64)
        self.out, self.lse = ref.attention(self.q, self.k, self.v, **self.options)

    def time_forward(self, variant, N):
        ref.attention(self.q, self.k, self.v, **self.options)

    def time_backward(self, variant, N):
        ref.attention_backward(
            self.dout, self.q, self.k, self.v, self.out, self.lse, **self.options
        )
