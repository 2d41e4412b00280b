"""Float64 oracles: the definitions every backend of elastic_np is held to.

Everything here is plain NumPy, computes in float64 and returns float64,
whatever the input precision. The functions favour being obviously right over
being fast; the attention oracle materialises the full ``(B, H, N, M)`` score
matrix and is meant for the sizes a test uses.

Non-finite inputs follow SciPy's ``check_finite=True`` habit: by default a NaN
or ``+inf`` logit raises a `ValueError`, while ``-inf`` is accepted as a masked
entry (it gets weight 0). With ``check_finite=False`` nothing is checked and a
NaN propagates to the rows it touches.

The package mirrors the derivations: ``_softmax`` (the vector functions),
``_attention`` (scores, masks, the dynamic window, the forward), ``_backward``
(the hand-derived backward), ``_double_backward`` (its second-order VJP) and
``_merge`` (merging partials over key sets).
``_backend`` is the face that ``backend="reference"`` shows the dispatcher,
the same as `elastic_np.cpu` and `elastic_np.cuda` (``dtypes``,
``is_available``, ``check_available``, ``prepare``, ``check_backward_arrays``,
``forward``, ``backward``); those names are not in ``__all__``.
"""

from elastic_np._contract._types import AttentionGrads  # noqa: F401  (a name of the former module)
from elastic_np.reference._attention import attention, scores, structural_keep, window_gate, window_position  # noqa: F401
from elastic_np.reference._backend import (  # noqa: F401  (the backend's face, for the dispatcher)
    backward,
    check_available,
    check_backward_arrays,
    double_backward,
    dtypes,
    forward,
    is_available,
    prepare,
    takes_variants,
)
from elastic_np.reference._backward import attention_backward
from elastic_np._contract._grads import DoubleBackwardGrads  # noqa: F401
from elastic_np.reference._double_backward import attention_double_backward
from elastic_np.reference._merge import merge_attention
from elastic_np.reference._softmax import (
    elastic_softmax,
    elastic_softmax_vjp,
    log_softmax,
    nvm,
    online_softmax,
    softmax,
    softmax_vjp,
)

__all__ = [
    "softmax",
    "log_softmax",
    "nvm",
    "elastic_softmax",
    "online_softmax",
    "softmax_vjp",
    "elastic_softmax_vjp",
    "attention",
    "attention_backward",
    "attention_double_backward",
    "merge_attention",
]
