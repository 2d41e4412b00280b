"""The float64 vector oracles of `elastic_np.reference` on a batch of rows."""

import numpy as np

from elastic_np import reference as ref

from .common import SEED


class VectorOracles:
    """Softmax, log-softmax, Elastic-Softmax and their VJPs on 64 rows of ``n`` logits."""

    params = [[128, 4096]]
    param_names = ["n"]

    def setup(self, n):
        rng = np.random.default_rng(SEED)
        self.x = rng.standard_normal((64, n))
        self.dy = rng.standard_normal((64, n))
        self.y = ref.softmax(self.x)

    def time_softmax(self, n):
        ref.softmax(self.x)

    def time_log_softmax(self, n):
        ref.log_softmax(self.x)

    def time_elastic_softmax(self, n):
        ref.elastic_softmax(self.x, tau=0.5, beta=1.0)

    def time_softmax_vjp(self, n):
        ref.softmax_vjp(self.y, self.dy)

    def time_elastic_softmax_vjp(self, n):
        ref.elastic_softmax_vjp(self.x, self.dy, tau=0.5, beta=1.0)


class OnlineSoftmax:
    """The streaming softmax oracle, element by element and block by block."""

    params = [[128, 1024], [None, 64]]
    param_names = ["n", "block_size"]

    def setup(self, n, block_size):
        self.x = np.random.default_rng(SEED).standard_normal((64, n))

    def time_online_softmax(self, n, block_size):
        ref.online_softmax(self.x, block_size=block_size)
