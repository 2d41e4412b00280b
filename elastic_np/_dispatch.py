"""The public attention entry points: validate once, then hand over to a backend.

A backend is a module with two functions,

- ``forward(problem) -> (out, lse)``
- ``backward(problem, dout, out, lse, dlse=None) -> AttentionGrads``

that take a validated `~elastic_np._options.AttentionProblem` (``dlse``, the
cotangent of ``lse``, is None for zeros). The reference backend computes in
float64; the kernels keep the input dtype.

A backend may also define ``prepare`` and ``check_backward_arrays`` with the
signatures of `elastic_np._options.prepare` and
`elastic_np.reference.check_backward_arrays`; they replace those two (the CUDA
backend uses this to validate device arrays without copying them to the host;
the CPU backend leaves the check of the bias's values to its kernels, which
read every entry anyway).
"""

import importlib

from elastic_np import _options, _spec, _validation, reference
from elastic_np._errors import BackendUnavailableError

BACKENDS = ("reference", "cpu", "cuda")
_KERNEL_MODULES = {"cpu": "elastic_np.cpu", "cuda": "elastic_np.cuda"}


class _ReferenceBackend:
    dtypes = None  # any real float, computed in float64

    @staticmethod
    def forward(problem):
        return reference._forward(problem)

    @staticmethod
    def backward(problem, dout, out, lse, dlse=None):
        return reference._backward(problem, dout, out, lse, dlse)


def get_backend(name):
    """Return the backend module for ``name`` ("auto", "reference", "cpu", "cuda")."""
    if not isinstance(name, str):
        raise ValueError(
            f"`backend` must be one of 'auto', {', '.join(repr(b) for b in BACKENDS)}; got {name!r}"
        )
    if name == "auto":
        name = "cuda" if _cuda_is_available() else "cpu"
    if name == "reference":
        return _ReferenceBackend
    if name not in _KERNEL_MODULES:
        raise ValueError(
            f"`backend` must be one of 'auto', {', '.join(repr(b) for b in BACKENDS)}; got {name!r}"
        )
    try:
        module = importlib.import_module(_KERNEL_MODULES[name])
    except ImportError as exc:
        raise BackendUnavailableError(f"backend {name!r} is not available: {exc}") from exc
    module.check_available()
    return module


def _prepare(module):
    """The backend's own ``prepare`` (one that keeps device arrays on the device), else the common one."""
    return getattr(module, "prepare", _options.prepare)


def _cuda_is_available():
    try:
        module = importlib.import_module(_KERNEL_MODULES["cuda"])
    except ImportError:
        return False
    return module.is_available()


@_spec.with_option_docs()
def attention(
    q,
    k,
    v,
    *,
    scale=None,
    causal=False,
    window_size=(-1, -1),
    kv_lengths=None,
    align="array",
    mask=None,
    nvm=False,
    tau=1.0,
    beta=0.0,
    dynamic_window=None,
    softcap=None,
    alibi_slopes=None,
    bias=None,
    return_lse=False,
    backend="auto",
):
    r"""Scaled dot-product attention with Elastic-Softmax, masks and a dynamic window.

    Computes, for every batch ``b``, query head ``h``, query ``i``:

    .. math::

        \mathrm{out}_i = \frac{\sum_{j\,\mathrm{kept}} e^{z_{ij}} v_j}
                              {\sum_{j\,\mathrm{kept}} e^{z_{ij}} + \beta_h},
        \qquad z_{ij} = \frac{\mathrm{scale}\; q_i\cdot k_j}{\tau_h} + \log G_{ij}

    where the score ``scale * q_i . k_j`` may first be soft-capped and get
    ALiBi and a bias added (``softcap``, ``alibi_slopes``, ``bias``). See
    `elastic_np.reference.attention` for the full definition of which entries
    are kept.

    Parameters
    ----------
    q : array_like, shape (B, H, N, D)
    k : array_like, shape (B, Hkv, M, D)
    v : array_like, shape (B, Hkv, M, Dv)
        ``H`` must be a multiple of ``Hkv`` (grouped-query attention).
    %(options)s
    return_lse : bool, optional
        Also return the log-denominator ``lse`` of shape ``(B, H, N)``; a
        loss may use it (`attention_backward` takes its cotangent ``dlse``).
    backend : {"auto", "reference", "cpu", "cuda"}, optional
        "auto" picks "cuda" when a GPU is usable, else "cpu".

    Returns
    -------
    out : ndarray, shape (B, H, N, Dv)
        In the input dtype for "cpu" and "cuda", float64 for "reference".
    lse : ndarray, shape (B, H, N)
        Only with ``return_lse=True``; same dtype as ``out``.

    Raises
    ------
    TypeError
        For a dtype the backend does not take (the kernels: float32 and
        float64, the same for ``q``, ``k``, ``v``), a non-boolean mask, or a
        ``causal``, ``nvm`` or ``return_lse`` that is not a bool.
    ValueError
        For inconsistent shapes or an out-of-range option, including one
        that the dtype of the computation cannot hold (see the contract's
        "Values that are rejected"); the message names it.

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> q = k = v = np.ones((1, 1, 3, 8))
    >>> enp.attention(q, k, v, causal=True, backend="reference").shape
    (1, 1, 3, 8)
    """
    return_lse = _validation.boolean(return_lse, "return_lse")
    module = get_backend(backend)
    problem = _prepare(module)(q, k, v, dtypes=module.dtypes, **_spec.gathered(locals()))
    out, lse = module.forward(problem)
    return (out, lse) if return_lse else out


@_spec.with_option_docs()
def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    dlse=None,
    scale=None,
    causal=False,
    window_size=(-1, -1),
    kv_lengths=None,
    align="array",
    mask=None,
    nvm=False,
    tau=1.0,
    beta=0.0,
    dynamic_window=None,
    softcap=None,
    alibi_slopes=None,
    bias=None,
    backend="auto",
):
    """Gradients of `attention` for ``q, k, v, tau, beta``, the window's ``sigma`` and ``bias``.

    Parameters
    ----------
    dout : array_like, shape (B, H, N, Dv)
        Cotangent of ``out``.
    q, k, v : array_like
        The inputs given to `attention`.
    out, lse : array_like
        What `attention` returned with ``return_lse=True``. Only their
        shapes, dtypes and values (no NaN or inf; ``lse`` may be ``-inf``)
        are checked, not that they belong to these inputs.
    dlse : array_like, shape (B, H, N), optional
        Cotangent of ``lse``, for a loss that uses it; None (default) stands
        for zeros. Real floats without NaN or inf, in the dtype of ``dout``
        (for the kernels that of ``q``). A row with ``lse = -inf`` (nothing
        kept, ``beta = 0``) takes no gradient from it.
    %(other_names)s
        The options given to `attention`.
    backend : {"auto", "reference", "cpu", "cuda"}, optional

    Returns
    -------
    AttentionGrads
        ``dq``, ``dk``, ``dv`` in the input dtype (float64 for "reference");
        ``dtau``, ``dbeta``, ``dsigma``, ``dbias`` in the shapes of ``tau``,
        ``beta``, ``sigma``, ``bias`` (``dsigma`` None without a dynamic
        window, ``dbias`` None without a bias; ``dbias`` in the dtype of ``dq``).

    Raises
    ------
    TypeError, ValueError
        As for `attention`, and for ``dout``, ``out``, ``lse`` or ``dlse`` of
        the wrong shape or dtype, or with NaN.

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 1, 4, 8)) for _ in range(3))
    >>> out, lse = enp.attention(q, k, v, tau=0.5, return_lse=True, backend="reference")
    >>> grads = enp.attention_backward(np.ones_like(out), q, k, v, out, lse,
    ...                                tau=0.5, backend="reference")
    >>> grads.dk.shape, isinstance(grads.dtau, float)
    ((1, 1, 4, 8), True)
    """
    module = get_backend(backend)
    problem = _prepare(module)(q, k, v, dtypes=module.dtypes, **_spec.gathered(locals()))
    dtype = None if module.dtypes is not None else problem.dtype
    check = getattr(module, "check_backward_arrays", reference.check_backward_arrays)
    dout, out, lse, dlse = check(problem, dout, out, lse, dtype=dtype, dlse=dlse)
    return module.backward(problem, dout, out, lse, dlse)
