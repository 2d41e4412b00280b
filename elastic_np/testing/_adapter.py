"""A backend of `elastic_np.attention` in the calling form of `check_attention`."""


def backend_functions(backend):
    """``(fn, backward)`` for a backend, in the form `check_attention` takes.

    Parameters
    ----------
    backend : str
        A backend name of `elastic_np.attention` (``"reference"``, ``"cpu"``,
        ``"cuda"``); it is looked up at each call, not here.

    Returns
    -------
    fn : callable
        ``fn(q, k, v, **options)`` returning ``(out, lse)`` from
        `elastic_np.attention` with ``return_lse=True``.
    backward : callable
        ``backward(dout, q, k, v, **options)`` running the forward and then
        `elastic_np.attention_backward`, returning its `~elastic_np.AttentionGrads`.

    Examples
    --------
    >>> import numpy as np
    >>> from elastic_np.testing import backend_functions, check_attention
    >>> fn, backward = backend_functions("reference")
    >>> q = k = v = np.ones((1, 1, 2, 4))
    >>> out, lse = fn(q, k, v, causal=True)
    >>> backward(np.ones_like(out), q, k, v, causal=True).dv.shape
    (1, 1, 2, 4)
    >>> bool(check_attention(fn, backward=backward, options=["causal"], dtypes=[np.float64]))
    True
    """
    import elastic_np as enp  # the package imports this one: not at module level

    def fn(q, k, v, **options):
        return enp.attention(q, k, v, return_lse=True, backend=backend, **options)

    def backward(dout, q, k, v, **options):
        out, lse = enp.attention(q, k, v, return_lse=True, backend=backend, **options)
        return enp.attention_backward(dout, q, k, v, out, lse, backend=backend, **options)

    return fn, backward
