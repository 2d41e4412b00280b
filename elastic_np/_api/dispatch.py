"""The public entry points: `attention`, `attention_backward` and `attention_double_backward` validate
once, then hand over to a backend; `merge_attention` rounds the float64 merge of `elastic_np.reference.merge_attention` to the partials' dtype.

A backend is a module (`elastic_np.reference`, `elastic_np.cpu`,
`elastic_np.cuda`) with the face `elastic_np._contract._backend.Backend`.
"""

import contextlib
import functools
import importlib

from elastic_np._api import compile_report, plans
from elastic_np._contract import _grads, _spec, _validation
from elastic_np._contract._backend import Backend
from elastic_np._contract._errors import BackendUnavailableError
from elastic_np._contract._problem import Kept
from elastic_np._variants.variant import given as variant_given, make_variant
from elastic_np.reference._merge import check_partials, merge_partials

BACKENDS = _spec.BACKENDS
_BACKEND_MODULES = {name: f"elastic_np.{name}" for name in BACKENDS}


def get_backend(name) -> Backend:
    """Return the backend module for ``name`` ("auto", "reference", "cpu", "cuda")."""
    if not isinstance(name, str) or (name != "auto" and name not in _BACKEND_MODULES):
        raise ValueError(
            f"`backend` must be one of 'auto', {', '.join(repr(b) for b in BACKENDS)}; got {name!r}"
        )
    if name == "auto":
        name = "cuda" if cuda_is_available() else "cpu"
    try:
        module = importlib.import_module(_BACKEND_MODULES[name])
    except ImportError as exc:
        raise BackendUnavailableError(f"backend {name!r} is not available: {exc}") from exc
    module.check_available()
    return module


def validated(module, q, k, v, options):
    """The backend's validated problem: its ``prepare``, then `_spec.check_support` (once per ``plan_key``)."""
    problem = module.prepare(q, k, v, dtypes=module.dtypes, **options)
    kernel_dtype = None if module.dtypes is None else problem.compute_dtype
    key = None if problem.plan_key is None else (module.__name__, problem.plan_key)
    _SUPPORTED.get_or_make(key, lambda: _spec.check_support(options, module.__name__.rsplit(".", 1)[-1],
                                                            kernel_dtype) or True)
    return problem


#: True for ``(backend module's name, plan_key)`` of the latest problems `_spec.check_support` passed.
_SUPPORTED = Kept()


def _reported(module, what, problem):
    """`compile_report.reported` for a kernel backend (the reference compiles nothing)."""
    if module.dtypes is None:
        return contextlib.nullcontext()
    if problem.variant is not None:
        return compile_report.reported(module.__name__.rsplit(".", 1)[-1], f"{what} with a user's function",
                                       problem.dtype, cached=False)
    return compile_report.reported(module.__name__.rsplit(".", 1)[-1], what, problem.dtype)


@functools.lru_cache(maxsize=None)
def cuda_is_available():
    """Whether the CUDA backend can run here: asked once a process, not on every call of "auto" (an
    import attempt where numba-cuda is missing), as a GPU does not come or go while it runs."""
    try:
        module = importlib.import_module(_BACKEND_MODULES["cuda"])
    except ImportError:
        return False
    return module.is_available()


@_spec.answers_foreign_names
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
    k_scale=None,
    v_scale=None,
    precision=None,
    layout="bhnd",
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    captures=(),
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
        ``H`` must be a multiple of ``Hkv`` (grouped-query attention); with
        ``layout="bnhd"``, ``(B, N, H, D)``, ``(B, M, Hkv, D)``, ``(B, M, Hkv, Dv)``.
    %(options)s
    score_mod : callable, optional
        A user's score modifier ``score_mod(score, b, h, q_idx, kv_idx,
        *captures) -> score``, applied after the built-in ones (see the page
        "Your own attention variant"); compiled by Numba on the CPU.
    mask_mod : callable, optional
        A user's mask ``mask_mod(b, h, q_idx, kv_idx, *captures) -> bool``,
        True where the entry is kept, with the built-in masks.
    block_mask : BlockMask, optional
        `create_block_mask`'s evaluation of ``mask_mod`` per block: the
        kernels skip the empty blocks and evaluate no mask on the full ones.
    captures : tuple of ndarray, optional
        The arrays both functions take after the indices.
    return_lse : bool, optional
        Also return the log-denominator ``lse`` of shape ``(B, H, N)``; a
        loss may use it (`attention_backward` takes its cotangent ``dlse``).
    backend : {"auto", "reference", "cpu", "cuda"}, optional
        "auto" picks "cuda" when a GPU is usable, else "cpu".

    Returns
    -------
    out : ndarray, shape (B, H, N, Dv)
        In the input dtype for "cpu" and "cuda", float64 for "reference";
        ``(B, N, H, Dv)`` with ``layout="bnhd"``.
    lse : ndarray, shape (B, H, N)
        Only with ``return_lse=True``; in the dtype the backend computes in:
        that of ``out``, float32 for bfloat16 and float16 inputs.

    Raises
    ------
    TypeError
        For a dtype the backend does not take (the CPU kernels: float32,
        float64, bfloat16, float16; the CUDA kernels: float32, float64; the
        same for ``q``, ``k``, ``v``), a non-boolean mask, or a
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
    if variant_given(score_mod, mask_mod, block_mask, captures):
        variant = make_variant(score_mod, mask_mod, block_mask, captures)
        return variant_forward(q, k, v, _spec.gathered(locals()), variant, return_lse, backend)
    call_key = None if type(return_lse) is not bool else plans.key(  # (a backward's key has "backward" there)
        q, k, v, (scale, causal, kv_lengths, align, mask, nvm, tau, beta, dynamic_window, softcap, alibi_slopes, bias,
                  k_scale, v_scale, precision, layout, return_lse, backend), (scale, tau, beta, softcap), window_size)
    if call_key is not None:
        plan = plans.lookup(call_key, k, v)
        if plan is not None:
            return plan.run_checked(q, k, v)
    options = _spec.gathered(locals())
    return_lse = _validation.boolean(return_lse, "return_lse")
    module = get_backend(backend)
    problem = validated(module, q, k, v, options)
    with _reported(module, "forward", problem):
        out, lse = module.forward(problem)
    plans.keep(call_key, module, problem, {**options, "return_lse": return_lse, "backend": backend}, k, v)
    out = problem.as_given(out)
    return (out, lse) if return_lse else out


@_spec.answers_foreign_names
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
    k_scale=None,
    v_scale=None,
    precision=None,
    layout="bhnd",
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    captures=(),
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
    %(other_names)s, score_mod, mask_mod, block_mask, captures
        The options given to `attention`.
    backend : {"auto", "reference", "cpu", "cuda"}, optional

    Returns
    -------
    AttentionGrads
        ``dq``, ``dk``, ``dv`` in the input dtype (float64 for "reference");
        ``dtau``, ``dbeta``, ``dsigma``, ``dbias`` in the shapes of ``tau``,
        ``beta``, ``sigma``, ``bias`` (``dsigma`` None without a dynamic
        window, ``dbias`` None without a bias; ``dbias`` in the dtype of ``dq``);
        with a ``score_mod``, ``dcaptures``: the floating captures' gradients.

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
    if variant_given(score_mod, mask_mod, block_mask, captures):
        variant = make_variant(score_mod, mask_mod, block_mask, captures)
        return variant_backward((dout, q, k, v, out, lse, dlse), _spec.gathered(locals()), variant, backend)
    call_key = plans.key(q, k, v, (scale, causal, kv_lengths, align, mask, nvm, tau, beta, dynamic_window, softcap,
                                   alibi_slopes, bias, k_scale, v_scale, precision, layout, "backward", backend),
                         (scale, tau, beta, softcap), window_size)
    if call_key is not None:
        plan = plans.PLANS.get(call_key)
        if plan is not None:
            return plan.backward(dout, q, k, v, out, lse, dlse)
    options = _spec.gathered(locals())
    module = get_backend(backend)
    problem = validated(module, q, k, v, options)
    dtype = None if module.dtypes is not None else problem.dtype
    dout, out, lse, dlse = module.check_backward_arrays(problem, dout, out, lse, dtype=dtype, dlse=dlse)
    with _reported(module, "backward", problem):
        grads = module.backward(problem, dout, out, lse, dlse)
    plans.keep_backward(call_key, module, problem)
    return problem.grads_as_given(grads)


def _variant_module(backend):
    """The backend of a call with a user's variant: "auto" is "cpu"; one that takes none is an error."""
    module = None if backend == "cuda" else get_backend("cpu" if backend == "auto" else backend)
    if not getattr(module, "takes_variants", False):
        raise ValueError(f"backend {backend!r} does not take `score_mod`, `mask_mod`, `block_mask` or `captures`; "
                         "use backend='cpu' or backend='reference'")
    return module


def variant_forward(q, k, v, options, variant, return_lse, backend):
    """`attention` with a user's ``variant`` (`elastic_np._variants.variant.Variant`): no plan is kept."""
    return_lse = _validation.boolean(return_lse, "return_lse")
    module = _variant_module(backend)
    problem = validated(module, q, k, v, options).with_variant(variant)
    with _reported(module, "forward", problem):
        out, lse = module.forward(problem)
    out = problem.as_given(out)
    return (out, lse) if return_lse else out


def variant_backward(arrays, options, variant, backend):
    """`attention_backward` with a user's ``variant``; ``arrays = (dout, q, k, v, out, lse, dlse)``."""
    dout, q, k, v, out, lse, dlse = arrays
    module = _variant_module(backend)
    problem = validated(module, q, k, v, options).with_variant(variant)
    dtype = None if module.dtypes is not None else problem.dtype
    dout, out, lse, dlse = module.check_backward_arrays(problem, dout, out, lse, dtype=dtype, dlse=dlse)
    with _reported(module, "backward", problem):
        grads = module.backward(problem, dout, out, lse, dlse)
    return problem.grads_as_given(grads)


@_spec.answers_foreign_names
@_spec.takes_options()
def attention_double_backward(ddq, ddk, ddv, dout, q, k, v, out, lse, *, ddtau=None, ddbeta=None, ddsigma=None,
                              ddbias=None, dlse=None, backend="auto", **options):
    r"""Second-order VJP of `attention_backward`: the gradients of ``<u, attention_backward(...)>``.

    ``u = (ddq, ddk, ddv, ddtau, ddbeta, ddsigma, ddbias)`` is a cotangent of
    the backward's outputs; the result is the gradient of :math:`\langle u,
    G\rangle` for the backward's inputs ``dout``, ``dlse``, ``q``, ``k``,
    ``v`` and the parameters, ``out`` and ``lse`` being the forward's
    functions of them (see `elastic_np.reference.attention_double_backward`,
    the oracle, and the derivations page).

    Parameters
    ----------
    ddq, ddk, ddv : array_like or None
        Cotangents of ``dq``, ``dk``, ``dv``, in the shapes of ``q``, ``k``,
        ``v``; None stands for zeros.
    dout, q, k, v, out, lse : array_like
        As for `attention_backward`.
    ddtau, ddbeta, ddsigma, ddbias : array_like or float, optional
        Cotangents of ``dtau``, ``dbeta``, ``dsigma``, ``dbias``, in the
        shapes ``tau``, ``beta``, ``sigma``, ``bias`` were given in; None
        (default) stands for zeros.
    dlse : array_like, shape (B, H, N), optional
        The cotangent of ``lse`` given to the backward; None stands for zeros.
    backend : {"auto", "reference", "cpu", "cuda"}, optional
        A backend without a double backward raises
        `~elastic_np.BackendUnavailableError`.
    %(other_names)s
        The options given to `attention`.

    Returns
    -------
    DoubleBackwardGrads
        ``ddout`` (the shape of ``dout``), ``ddlse`` ``(B, H, N)``, and
        ``dq, dk, dv, dtau, dbeta, dsigma, dbias`` as `attention_backward`
        returns them.

    Raises
    ------
    TypeError, ValueError
        As for `attention_backward`, and for a cotangent of the wrong shape
        or with NaN or inf; the message names it.

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, ddq = (rng.standard_normal((1, 1, 4, 8)) for _ in range(4))
    >>> out, lse = enp.attention(q, k, v, return_lse=True, backend="reference")
    >>> g = enp.attention_double_backward(ddq, None, None, np.ones_like(out), q, k, v, out, lse,
    ...                                   backend="reference")
    >>> g.ddout.shape, g.dq.shape
    ((1, 1, 4, 8), (1, 1, 4, 8))
    """
    options = _spec.complete(options, "attention_double_backward")
    module = get_backend(backend)
    if not hasattr(module, "double_backward"):
        name = module.__name__.rsplit(".", 1)[-1]
        raise BackendUnavailableError(
            f"backend {name!r} has no double backward; use backend='cpu' or backend='reference'")
    problem = validated(module, q, k, v, options)
    dtype = None if module.dtypes is not None else problem.dtype
    dout, out, lse, dlse = module.check_backward_arrays(problem, dout, out, lse, dtype=dtype, dlse=dlse)
    direction = _grads.direction(problem, (ddq, ddk, ddv), (ddtau, ddbeta, ddsigma, ddbias), check_finite=True)
    with _reported(module, "double backward", problem):
        result = module.double_backward(problem, dout, out, lse, dlse, direction)
    return _grads.double_backward_as_given(problem, *result)


def merge_attention(outs, lses, *, beta=0.0):
    r"""Combine attention over disjoint key sets into the attention over their union.

    Given partials ``(out_p, lse_p)`` that `attention` returned (with
    ``return_lse=True``) over disjoint sets of keys, each with ``beta = 0``,
    returns what it would return over the union of the keys with ``beta``:

    .. math::

        \mathrm{lse} = \log\Big(\sum_p e^{\mathrm{lse}_p} + \beta_h\Big), \qquad
        \mathrm{out} = \sum_p e^{\mathrm{lse}_p - \mathrm{lse}}\, \mathrm{out}_p .

    This is the block update of the online softmax made an API: for
    split-KV, KV caches kept in pieces and distributed attention. The
    computation is in float64, stable for any spread of the ``lse_p``.

    Parameters
    ----------
    outs : sequence of array_like, or ndarray
        The partial outputs, each of shape ``(B, H, N, Dv)``, or one array of
        shape ``(P, B, H, N, Dv)`` whose leading axis runs over the partials.
    lses : sequence of array_like, or ndarray
        Their log-denominators, each ``(B, H, N)``, or one ``(P, B, H, N)``
        array; computed with ``beta = 0``. ``-inf`` marks a row for which a
        partial kept no key: that partial contributes nothing to the row
        (its ``out`` there gets weight 0).
    beta : float or array_like of shape (H,), optional
        The sink, finite and ``>= 0``, added once to the merged denominator.

    Returns
    -------
    out : ndarray, shape (B, H, N, Dv)
    lse : ndarray, shape (B, H, N)
        In the partials' dtype, float32 or float64. A row that no partial
        kept a key for gives ``out = 0`` and ``lse = log(beta)`` (``-inf``
        for ``beta = 0``), the attention's empty-row rule.

    Raises
    ------
    TypeError
        For ``outs`` or ``lses`` that are neither a list, a tuple nor an
        array; partials that are not float32 or float64 or do not all share
        one dtype; a ``beta`` that is not a real number or array.
    ValueError
        For no partial, different numbers of ``outs`` and ``lses``,
        mismatched shapes, NaN or inf in ``outs``, NaN or ``+inf`` in
        ``lses``, a negative or non-finite ``beta``; the message names the
        argument.

    See Also
    --------
    elastic_np.reference.merge_attention : The same in float64, for any real float dtype.

    Notes
    -----
    The partials must be computed with ``beta = 0``: the sink belongs to the
    denominator of the whole row, and partials that each added it would
    count it once per partial. The arrays passed are never written to.

    Examples
    --------
    >>> import numpy as np
    >>> import elastic_np as enp
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    >>> parts = [enp.attention(q, k[:, :, keys], v[:, :, keys], return_lse=True, backend="reference")
    ...          for keys in (slice(0, 1), slice(1, 3))]
    >>> outs, lses = zip(*parts)
    >>> out, lse = enp.merge_attention(outs, lses, beta=0.5)
    >>> want, want_lse = enp.attention(q, k, v, beta=0.5, return_lse=True, backend="reference")
    >>> bool(np.allclose(out, want, rtol=1e-13, atol=0) and np.allclose(lse, want_lse, rtol=1e-13))
    True
    """
    outs, lses, beta = check_partials(outs, lses, beta, kernel_dtypes=True)
    out, lse = merge_partials(outs, lses, beta)
    dtype = outs[0].dtype
    return out.astype(dtype, copy=False), lse.astype(dtype, copy=False)
