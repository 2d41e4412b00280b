"""Tools for testing numerical code against elastic_np's oracles.

`gradcheck` compares a claimed gradient with central finite differences for any
function of NumPy arrays and scalars. `check_attention` runs any attention
implementation (a PyTorch or JAX kernel wrapped in a few lines) through the
conformance battery against the float64 oracles.
"""

import dataclasses

import numpy as np

class GradcheckError(AssertionError):
    """A claimed gradient disagrees with finite differences; the message holds the report.

    Examples
    --------
    >>> import numpy as np
    >>> from elastic_np.testing import gradcheck, GradcheckError
    >>> try:
    ...     gradcheck(lambda x: x**2, {"x": np.array([1.0])}, {"x": np.array([2.1])})
    ... except GradcheckError:
    ...     print("caught")
    caught
    """


@dataclasses.dataclass(frozen=True)
class GradcheckEntry:
    """The worst element of one checked gradient."""

    name: str
    index: tuple
    claimed: float
    numerical: float
    error: float  # max |claimed - numerical| / max(max |numerical|, max |claimed|)
    passed: bool


@dataclasses.dataclass(frozen=True)
class GradcheckReport:
    """Result of `gradcheck`: true when every input passed; prints as a table.

    Attributes
    ----------
    entries : tuple of GradcheckEntry
        One per checked input: its name, the index of the worst element, the
        claimed and numerical values there, the normwise error and whether it passed.
    rtol : float
        The relative tolerance used.

    Examples
    --------
    >>> import numpy as np
    >>> from elastic_np.testing import gradcheck
    >>> report = gradcheck(lambda x: 2 * x, {"x": np.array([1.0, 3.0])}, {"x": np.array([2.0, 2.0])})
    >>> bool(report), report.entries[0].name
    (True, 'x')
    """

    entries: tuple
    rtol: float

    def __bool__(self):
        return all(e.passed for e in self.entries)

    def __str__(self):
        lines = [f"{'input':<10} {'worst index':<16} {'claimed':>14} {'numerical':>14} {'rel. error':>10}  ok"]
        for e in self.entries:
            lines.append(
                f"{e.name:<10} {str(e.index):<16} {e.claimed:>14.7g} {e.numerical:>14.7g} "
                f"{e.error:>10.2e}  {'yes' if e.passed else 'NO'}"
            )
        return "\n".join(lines)


def gradcheck(fn, inputs, claimed, *, dout=None, eps=1e-6, rtol=1e-6, atol=None, raise_on_failure=True):
    r"""Check claimed gradients against central finite differences.

    The function checked is the scalar loss ``L = sum(dout * fn(**inputs))``.
    For each name in ``claimed``, every element ``x_e`` of that input is moved
    by ``h = eps * max(1, |x_e|)`` both ways and

    .. math:: \frac{\partial L}{\partial x_e} \approx \frac{L(x_e + h) - L(x_e - h)}{2h}

    is compared with the claimed value. The error of an input's gradient is
    normwise, ``max_e |claimed_e - numerical_e| / max(max|numerical|, max|claimed|)``,
    so that elements near zero do not dominate; the report names the element
    where the difference is largest.

    Parameters
    ----------
    fn : callable
        Called as ``fn(**inputs)``; returns an array or a scalar.
    inputs : mapping of str to array_like or float
        The arguments of ``fn``. They are copied, never modified.
    claimed : mapping of str to array_like or float
        The gradient of ``L`` for each input to check (a subset of ``inputs``),
        each in the shape of its input.
    dout : array_like, optional
        The cotangent, in the shape of ``fn``'s output; ones by default.
    eps : float, optional
        Relative finite-difference step.
    rtol, atol : float, optional
        An input passes when ``max|claimed - numerical| <= atol + rtol * scale``
        with ``scale`` the larger of the two gradients' maximum magnitudes.
        ``atol=None`` (default) uses the rounding noise of the differences,
        ``10 * eps_float64 * max(|L|, 1) / h``: below it finite differences
        cannot tell a gradient from zero.
    raise_on_failure : bool, optional
        Raise `GradcheckError` with the report when any input fails (default);
        otherwise return the report.

    Returns
    -------
    GradcheckReport
        True when every input passed; prints as a table.

    Raises
    ------
    GradcheckError
        When a gradient fails and ``raise_on_failure`` is true.

    Examples
    --------
    >>> import numpy as np
    >>> from elastic_np.testing import gradcheck
    >>> x = np.array([0.5, -1.0, 2.0])
    >>> report = gradcheck(lambda x: x**3, {"x": x}, {"x": 3 * x**2})
    >>> bool(report)
    True
    """
    inputs = {name: _copy_input(value) for name, value in inputs.items()}
    unknown = set(claimed) - set(inputs)
    if unknown:
        raise ValueError(f"`claimed` names inputs that `inputs` lacks: {sorted(unknown)}")
    out0 = np.asarray(fn(**inputs), dtype=np.float64)
    dout = np.ones_like(out0) if dout is None else np.asarray(dout, dtype=np.float64)
    if dout.shape != out0.shape:
        raise ValueError(f"`dout` shape {dout.shape} != output shape {out0.shape}")

    def loss(**args):
        return float(np.sum(dout * np.asarray(fn(**args), dtype=np.float64)))

    if atol is None:
        atol = 10 * np.finfo(np.float64).eps * max(abs(loss(**inputs)), 1.0) / eps

    entries = []
    for name, grad in claimed.items():
        grad = np.asarray(grad, dtype=np.float64)
        if grad.shape != np.shape(inputs[name]):
            raise ValueError(
                f"claimed gradient for `{name}` has shape {grad.shape}, input has {np.shape(inputs[name])}")
        entries.append(_entry(name, grad, _central_differences(loss, inputs, name, eps), atol, rtol))
    report = GradcheckReport(entries=tuple(entries), rtol=rtol)
    if raise_on_failure and not report:
        raise GradcheckError(f"gradient check failed (rtol={rtol}, atol={atol}):\n{report}")
    return report


def _entry(name, grad, numerical, atol, rtol):
    """The `GradcheckEntry` of one input: its worst element, relative to the larger gradient."""
    diff = np.abs(grad - numerical)
    scale = max(np.max(np.abs(numerical), initial=0.0), np.max(np.abs(grad), initial=0.0))
    worst = np.unravel_index(np.argmax(diff), diff.shape) if diff.size else ()
    worst_diff = float(diff[worst]) if diff.size else 0.0
    return GradcheckEntry(
        name=name, index=tuple(int(i) for i in worst),
        claimed=float(grad[worst]) if diff.size else 0.0,
        numerical=float(numerical[worst]) if diff.size else 0.0,
        error=worst_diff / scale if scale > 0 else worst_diff,
        passed=bool(np.isfinite(grad).all()) and worst_diff <= atol + rtol * scale,
    )


def _copy_input(value):
    if np.ndim(value) == 0 and not isinstance(value, np.ndarray):
        return value
    return np.array(value, dtype=np.float64 if np.issubdtype(np.asarray(value).dtype, np.floating) else None)


def _central_differences(loss, inputs, name, eps):
    base = inputs[name]
    if np.ndim(base) == 0 and not isinstance(base, np.ndarray):
        h = eps * max(1.0, abs(float(base)))
        up = loss(**{**inputs, name: float(base) + h})
        down = loss(**{**inputs, name: float(base) - h})
        return np.asarray((up - down) / (2 * h))
    x = np.array(base, dtype=np.float64)
    numerical = np.empty_like(x)
    for index in np.ndindex(x.shape):
        h = eps * max(1.0, abs(x[index]))
        saved = x[index]
        x[index] = saved + h
        up = loss(**{**inputs, name: x.copy()})
        x[index] = saved - h
        down = loss(**{**inputs, name: x.copy()})
        x[index] = saved
        numerical[index] = (up - down) / (2 * h)
    return numerical
