"""The reference as a backend: the face that `elastic_np.cpu` and `elastic_np.cuda` show the dispatcher.

``backend="reference"`` computes in float64 whatever the input dtype
(``dtypes = None``: any real float, converted), through the oracles'
own code: `forward` is `elastic_np.reference._attention._forward`,
`backward` is `elastic_np.reference._backward._backward`, `double_backward`
`elastic_np.reference._double_backward._double_backward`. It needs nothing
beyond NumPy, so it is always available.
"""

from elastic_np._contract import _problem
from elastic_np.reference._attention import _forward
from elastic_np.reference._backward import _backward, check_backward_arrays
from elastic_np.reference._double_backward import _double_backward

#: Any real float dtype, computed in float64 (the kernels list theirs).
dtypes = None

#: Takes a user's ``score_mod``, ``mask_mod`` and ``block_mask`` (`elastic_np._variants`).
takes_variants = True

__all__ = [
    "dtypes", "is_available", "check_available", "prepare", "check_backward_arrays", "forward", "backward",
    "double_backward",
]


def is_available():
    """True: the reference needs only NumPy."""
    return True


def check_available():
    """Raise nothing: the reference is always usable."""
    return None


def prepare(q, k, v, **options):
    """`elastic_np._contract._problem.prepare` itself: the oracle has every value checked first."""
    return _problem.prepare(q, k, v, **options)


def forward(problem):
    """Attention forward for a validated problem: ``(out, lse)`` in float64.

    Parameters
    ----------
    problem : elastic_np._contract._problem.AttentionProblem

    Returns
    -------
    out : ndarray, shape (B, H, N, Dv)
    lse : ndarray, shape (B, H, N)
    """
    return _forward(problem)


def backward(problem, dout, out, lse, dlse=None):
    """Attention backward for a validated problem, from ``out`` and ``lse``: `~elastic_np.AttentionGrads`.

    ``dlse``, the cotangent of ``lse``, is None for zeros.
    """
    return _backward(problem, dout, out, lse, dlse)


def double_backward(problem, dout, out, lse, dlse, direction):
    """The second-order VJP for a validated problem: ``(ddout, ddlse, AttentionGrads)``, float64.

    ``direction`` holds the cotangents of the backward's outputs
    (`elastic_np._contract._grads.Direction`); ``ddout`` and
    ``ddlse`` are the tangents of ``out`` and ``lse`` along it.
    """
    return _double_backward(problem, dout, out, lse, dlse, direction)
