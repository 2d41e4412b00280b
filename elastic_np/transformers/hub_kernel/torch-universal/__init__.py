"""elastic_np's FlashAttention functions as a build of a kernel of the ``kernels`` package.

transformers loads it for ``attn_implementation="elastic-np/flash-attn"``
once `elastic_np.transformers.register` has pointed the ``kernels``
package's local overrides at this folder. A change to this file changes its
digest in ``metadata.json`` (tests/transformers/test_continuous_batching.py).
"""

from elastic_np.transformers.flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
