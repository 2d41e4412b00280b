"""The dynamic window at its edges, shared by the CPU (``test_hardening_window``, ``test_cpu_double_backward``)
and the CUDA tests (``tests/cuda/test_sim_hardening_window.py``): rows far from all their keys, scores under a
faint gate, and the conformance kit's rule for every quantity of a backend's results.
"""

import numpy as np

import elastic_np as enp
from elastic_np.testing import _tolerances
from elastic_np.testing._report import worst_error

GRADS = ("dq", "dk", "dv", "dtau", "dbeta", "dsigma")


def far_rows(seed=0, N=24, M=3, D=4):
    """``q, k, v, dout`` of one head, unit normals, with many more queries than keys."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s) for s in ((N, D), (M, D), (M, D), (N, D)))


def run(backend, dtype, q, k, v, dout, options, dlse=None):
    """``(out, lse, grads)`` of ``backend`` on the inputs in ``dtype``."""
    args = [np.asarray(a, dtype=dtype) for a in (q, k, v)]
    out, lse = enp.attention(*args, return_lse=True, backend=backend, **options)
    with np.errstate(all="ignore"):  # the oracle's warnings are the test's to judge
        grads = enp.attention_backward(np.asarray(dout, dtype=dtype), *args, out, lse, dlse=dlse,
                                       backend=backend, **options)
    return out, lse, grads


def fields(out, lse, grads):
    """``out``, ``lse`` and the gradients the options produce, by name."""
    found = {"out": out, "lse": lse}
    found.update({name: getattr(grads, name) for name in GRADS if getattr(grads, name) is not None})
    return found


def out_of_rule(q, k, v, dout, options, dtype, got):
    """The quantities of ``got`` outside the kit's rule for ``dtype`` against the oracle, as messages.

    float32: `_tolerances.kit_allowed` (twice the naive float32 error plus
    the rounding allowance, or the floor). float64: the float64 floor or the
    rounding allowance at float64's epsilon, whichever is larger.
    """
    want = fields(*run("reference", np.float64, q, k, v, dout, options))
    with np.errstate(all="ignore"):
        rounding = _tolerances.rounding_allowance(q, k, v, dout, options, dtype=dtype)
        naive = _tolerances.naive_orderings(q, k, v, dout, options, dtype) if dtype == np.float32 else None
    over = []
    for name, value in want.items():
        if name not in ("lse", "dbeta"):  # an empty row's lse, and its e^-lse, may be infinite
            assert np.isfinite(value).all(), f"the oracle's {name} is not finite"
        if naive is not None:
            allowed, _ = _tolerances.kit_allowed(value, [n[name] for n in naive], dtype, rounding.get(name, 0.0))
        else:
            allowed = max(_tolerances.FLOOR["float64"] * max(1.0, np.max(np.abs(value), initial=0.0)),
                          rounding.get(name, 0.0))
        error, note = worst_error(got[name], value)
        if not error <= allowed:
            over.append(f"{name}: error {error:.3g} > allowed {allowed:.3g} {note}")
    return over


def faint_gate_inputs(scale, seed=0, N=8, M=6, D=4):
    """Scores ``s = scale q.k`` near 1e-3 under a gate of sharpness 1e-3 (``log G`` near -8): ``(q, k, v, dout, options)``."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((1, 2, N, D)), 1e-3 * rng.standard_normal((1, 2, M, D))
    v, dout = rng.standard_normal((1, 2, M, 3)), rng.standard_normal((1, 2, N, 3))
    q, k, v, dout = (a.astype(np.float32).astype(np.float64) for a in (q, k, v, dout))
    window = enp.DynamicWindow([0.7, 0.3], sharpness=1e-3)
    return q, k, v, dout, dict(scale=scale, tau=[1.0, 0.5], beta=[0.0, 0.3], dynamic_window=window)
