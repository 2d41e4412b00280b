"""elastic_np: float64 oracles and Numba/CUDA kernels for Elastic-Softmax attention.

The float64 reference lives in `elastic_np.reference`; `attention` and
`attention_backward` (and `attention_double_backward`, the second-order
VJP) dispatch to a backend ("reference", "cpu", "cuda");
`merge_attention` combines attention computed over disjoint key sets;
`warmup` compiles the kernels ahead of the first call.
"""

from elastic_np import reference, testing
from elastic_np._api.dispatch import attention, attention_backward, attention_double_backward, merge_attention
from elastic_np._contract._errors import BackendUnavailableError, CompileWarning
from elastic_np._contract._types import AttentionGrads, DynamicWindow
from elastic_np._api.varlen import varlen_attention, varlen_attention_backward
from elastic_np._api.warmup import warmup
from elastic_np._api.plans import Plan, plan
from elastic_np._contract._grads import DoubleBackwardGrads
from elastic_np._contract._quantized import quantize_kv
from elastic_np._variants.block_mask import BlockMask, create_block_mask

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_backward",
    "attention_double_backward",
    "merge_attention",
    "varlen_attention",
    "varlen_attention_backward",
    "warmup",
    "quantize_kv",
    "create_block_mask",
    "BlockMask",
    "plan",
    "Plan",
    "AttentionGrads",
    "DoubleBackwardGrads",
    "DynamicWindow",
    "BackendUnavailableError",
    "CompileWarning",
    "reference",
    "testing",
]
