"""What the PyTorch and JAX adapters share; imports neither framework.

An adapter splits the options of `elastic_np.attention` in two: the
learnable ones (``tau``, ``beta``, the dynamic window's ``sigma``, ``bias``),
which may be framework arrays that carry gradients, and the rest, passed to
the kernels as they are. `numpy_options` puts them back together as the
keyword arguments of `elastic_np.attention` and `elastic_np.attention_backward`.
"""

from typing import Any, NamedTuple

from elastic_np._contract import _spec
from elastic_np._contract._types import DynamicWindow as _CoreWindow

#: The options of `elastic_np.attention` that carry a gradient, the dynamic window by its ``sigma``.
LEARNABLE = tuple("sigma" if name == "dynamic_window" else name for name in _spec.LEARNABLE)


class DynamicWindow(NamedTuple):
    """The dynamic window of `elastic_np.DynamicWindow`, with a learnable ``sigma``.

    ``sigma`` may be a framework array (a ``torch.Tensor`` that requires
    grad, a ``jax.Array``): the gradient of the window's width flows to it.
    ``sharpness`` and ``threshold`` are fixed numbers. The adapters take
    `elastic_np.DynamicWindow` as well, for a window of fixed width.

    Examples
    --------
    >>> from elastic_np._api.adapters import DynamicWindow
    >>> DynamicWindow(0.5, sharpness=4.0)
    DynamicWindow(sigma=0.5, sharpness=4.0, threshold=0.0)
    """

    sigma: Any
    sharpness: float = 1.0
    threshold: float = 0.0


def window_parts(dynamic_window):
    """``(sigma, sharpness, threshold)`` of a window, or ``(None, 1.0, 0.0)`` for none."""
    if dynamic_window is None:
        return None, 1.0, 0.0
    if isinstance(dynamic_window, (DynamicWindow, _CoreWindow)):
        return dynamic_window.sigma, dynamic_window.sharpness, dynamic_window.threshold
    raise TypeError(
        "`dynamic_window` must be an elastic_np.DynamicWindow, the adapter's DynamicWindow "
        f"(learnable sigma) or None, got {type(dynamic_window).__name__}"
    )


def kernel_backend(backend):
    """The `elastic_np` backend for host arrays: "auto" means the CPU kernels."""
    return "cpu" if backend == "auto" else backend


def split(options):
    """``(fixed, learnable)``: the complete options of `elastic_np.attention`, split.

    ``learnable`` maps the names of `LEARNABLE` to their values (``sigma``
    that of the window, None without one); ``fixed`` holds every other
    option, with the window's ``sharpness`` and ``threshold``.
    """
    sigma, sharpness, threshold = window_parts(options["dynamic_window"])
    learnable = {name: sigma if name == "sigma" else options[name] for name in LEARNABLE}
    fixed = {name: value for name, value in options.items() if name not in _spec.LEARNABLE}
    fixed.update(sharpness=sharpness, threshold=threshold)
    return fixed, learnable


def numpy_options(fixed, learnable):
    """Keyword arguments of `elastic_np.attention` from the fixed and learnable options (`split`).

    ``learnable`` maps the names of `LEARNABLE` to NumPy arrays, numbers or None.
    """
    options = {name: value for name, value in fixed.items() if name not in ("sharpness", "threshold")}
    options.update({name: learnable[name] for name in LEARNABLE if name != "sigma"})
    sigma = learnable["sigma"]
    options["dynamic_window"] = (
        None if sigma is None else _CoreWindow(sigma, fixed["sharpness"], fixed["threshold"])
    )
    return options


def grad_of(grads, name):
    """The gradient of the learnable option ``name`` in `elastic_np.AttentionGrads`."""
    return getattr(grads, "d" + name)
