"""PyTorch adapter: `attention` and the packed `varlen_attention` with autograd, and the `ElasticAttention` module.

``import elastic_np.torch`` imports torch (``pip install "elastic_np[torch]"``);
``import elastic_np`` does not.

`attention` is the operator ``elastic_np::attention`` (`torch.library`,
``elastic_np.torch._ops``): its forward calls `elastic_np.attention` and
keeps ``out`` and ``lse``; its backward, the operator
``elastic_np::attention_backward``, calls `elastic_np.attention_backward`
with them and the cotangents of ``out`` and ``lse`` (the forward is never
computed again) and hands ``dq``, ``dk``, ``dv``, ``dtau``, ``dbeta``,
``dsigma`` and ``dbias`` to autograd. ``torch.compile`` keeps a call in its
graph. CPU tensors reach the kernels through ``Tensor.numpy()``, without a
copy when they are C-contiguous, and the results come back through
``torch.from_numpy`` (``elastic_np.torch._arrays``). An eager call on CPU
tensors (plain or parameters) runs the same code without the operators'
dispatch, which would be most of a small call (``elastic_np.torch._fast``
for scalar options, through `elastic_np.attention`'s plans; else
``_ops._EagerAttention``): the same bits, the same errors; ``torch.compile``,
``torch.func`` transforms, other tensor subclasses and CUDA tensors go
through the operators. The backward operator
is differentiable in turn (``elastic_np::attention_double_backward``, which
calls `elastic_np.attention_double_backward`): a gradient penalty or a
Hessian-vector product works eagerly on CPU tensors; the packed
`varlen_attention`'s backward has no derivative.

CUDA tensors (``q``, ``k``, ``v`` and a tensor ``bias`` on one device) go
through the CUDA backend in place: their memory reaches the kernels through
``__cuda_array_interface__`` (a strided tensor is made contiguous first), and
``out``, ``lse``, ``dq``, ``dk``, ``dv`` and ``dbias`` come back as tensors on
the same device over the memory the kernels wrote, with no host round trip.
``tau``, ``beta``, ``sigma``, ``mask``, ``kv_lengths`` and ``alibi_slopes``
may be on the CPU or that device; the backend reads them on the host (a small
copy), and ``dtau``, ``dbeta``, ``dsigma`` are moved to their parameter's
device. This path runs in the tests on an H100 (``tests/torch/test_torch_cuda.py``) and on
the CUDA simulator.
"""

import math
import numbers

import numpy as np
import torch

from elastic_np._api import adapters as common
from elastic_np._api import varlen
from elastic_np._contract import _spec
from elastic_np._contract._quantized import quantize_kv as _quantize_kv
from elastic_np.torch import _arrays, _fast, _ops, _variant, _varlen
from elastic_np._api.adapters import DynamicWindow
from elastic_np._variants.variant import given as variant_given

__all__ = ["attention", "varlen_attention", "quantize_kv", "ElasticAttention", "DynamicWindow"]


def _load_cpu_backend():
    """The CPU backend, loaded with this module: the half second of Numba's first load goes to the import, not to
    a first call (`elastic_np.cpu.load`)."""
    from elastic_np import cpu

    cpu.load()


_load_cpu_backend()


@_spec.takes_options(own=_spec.LEARNABLE)
def attention(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, captures=(), dropout_p=0.0,
              return_lse=False, backend="auto", **options):
    """`elastic_np.attention` on torch tensors, differentiable in every learnable input.

    Parameters
    ----------
    q, k, v : torch.Tensor
        Tensors of shapes ``(B, H, N, D)``, ``(B, Hkv, M, D)``,
        ``(B, Hkv, M, Dv)``, float32, float64, bfloat16 or float16 on the CPU
        (float32 or float64 on a GPU; the same for all three), any
        strides, all on the CPU or all on one CUDA device; gradients flow to
        those that require them.
        On the CPU ``k`` and ``v`` may also be a quantized cache, int8,
        float8_e4m3fn or float8_e5m2 (`quantize_kv`), with ``k_scale`` and
        ``v_scale``: read without a copy (float8 as the ``ml_dtypes`` type of
        its name), and no gradient flows through them (a backward is a
        `TypeError`).
    tau, beta : float or torch.Tensor of shape () or (H,), optional
        Temperature (``> 0``) and the sink, the denominator's offset (``>= 0``);
        a tensor that requires grad gets ``dtau`` or ``dbeta``. With CUDA
        tensors they (and ``sigma``) may be on the CPU or ``q``'s device.
    dynamic_window : DynamicWindow or elastic_np.DynamicWindow, optional
        The bell-curve window; with `DynamicWindow` its ``sigma`` may be a
        tensor (broadcastable to ``(B, H)``) that gets ``dsigma``.
    bias : torch.Tensor, optional
        Additive score bias broadcastable to ``(B, H, N, M)``, on ``q``'s
        device; gets ``dbias`` in its own shape.
    %(other_names)s
        As in `elastic_np.attention` (tensors are accepted); no gradient.
    score_mod, mask_mod, block_mask : optional
        A user's variant, as in `elastic_np.attention` (the page "Your own
        attention variant"), on CPU tensors; the call then runs through an
        autograd function rather than the ``torch.library`` operator, which
        ``torch.compile`` does not trace into.
    captures : tuple of torch.Tensor or ndarray, optional
        The arrays ``score_mod`` and ``mask_mod`` take; a floating tensor that
        requires grad gets its gradient.
    dropout_p : float, optional
        SDPA's attention dropout: 0 only (it changes nothing); any other value
        is a `ValueError`, attention dropout not being supported.
    return_lse : bool, optional
        Also return ``lse`` of shape ``(B, H, N)``, differentiable like ``out``
        (a loss may use either or both). A row with ``lse = -inf`` (nothing
        kept, ``beta = 0``) passes no gradient back.
    backend : {"auto", "cpu", "reference", "cuda"}, optional
        "auto" runs the CPU kernels on CPU tensors and the CUDA kernels on
        CUDA tensors (in place; only "auto" and "cuda" take those).
        "reference" runs the float64 oracle (results cast back to the input dtype).

    Returns
    -------
    out : torch.Tensor, shape (B, H, N, Dv)
        In the dtype of ``q``, on its device.
    lse : torch.Tensor, shape (B, H, N)
        Only with ``return_lse=True``; in the dtype of ``q`` (float32 for
        bfloat16 and float16, which the CPU kernels compute in float32).

    Raises
    ------
    TypeError
        For a tensor on a device other than the CPU or ``q``'s CUDA device,
        CUDA tensors with a backend other than "auto" or "cuda", a CUDA tensor
        of dtype float16 or bfloat16 (convert it with ``.float()``), or other
        than float32, float64, bfloat16 or float16 on the CPU; and as
        `elastic_np.attention`.
    ValueError
        For ``dropout_p`` other than 0, and as `elastic_np.attention`.
    elastic_np.BackendUnavailableError
        For CUDA tensors where the CUDA backend cannot run (saying what is missing).

    Examples
    --------
    >>> import torch
    >>> import elastic_np.torch as enpt
    >>> q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    >>> beta = torch.tensor([0.5, 1.0], requires_grad=True)
    >>> out = enpt.attention(q, k, v, causal=True, tau=0.8, beta=beta)
    >>> out.sum().backward()
    >>> beta.grad.shape, q.grad.shape
    (torch.Size([2]), torch.Size([1, 2, 5, 8]))
    """
    if variant_given(score_mod, mask_mod, block_mask, captures):
        _check_dropout(dropout_p)
        fixed, learnable = common.split(_spec.complete(options, "attention"))
        fixed["backend"] = common.kernel_backend(backend)
        return _variant.attention(q, k, v, (score_mod, mask_mod, block_mask, captures), fixed, learnable, return_lse)
    short = _fast.attention(q, k, v, dropout_p, backend, options)  # no gradient, scalar options
    if short is not None:
        return short if return_lse else short[0]
    _check_dropout(dropout_p)
    fixed, learnable = common.split(_spec.complete(options, "attention"))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    device = _arrays._cuda_device(q, k, v, backend)
    # before the operator, which would take tensors on "meta" for their shapes alone
    _arrays.check_devices(device, (("q", q), ("k", k), ("v", v), *learnable.items(),
                                         *((n, fixed[n]) for n in _spec.TENSOR_OPTIONS)), caches=_arrays.CACHES)
    fixed["backend"] = common.kernel_backend(backend) if device is None else "cuda"
    out, lse = _ops.attention(q, k, v, fixed, learnable)
    return (out, lse) if return_lse else out


def quantize_kv(x, dtype, *, scale="head", group_size=None, layout="bhnd"):
    """`elastic_np.quantize_kv` on a torch tensor: a key or value cache quantized, and its scale.

    Parameters
    ----------
    x : torch.Tensor
        The cache, a CPU tensor of float32, float64, bfloat16 or float16, of
        the shapes `elastic_np.quantize_kv` takes. bfloat16 and float16 are
        read as float32, which holds each of their values exactly; float32
        and float64 as they are. No gradient flows.
    dtype : {torch.int8, torch.float8_e4m3fn, torch.float8_e5m2}
        The storage format, or its name ("int8", "float8_e4m3fn",
        "float8_e5m2").
    scale, group_size, layout
        As in `elastic_np.quantize_kv`.

    Returns
    -------
    data : torch.Tensor
        Of ``dtype`` and the shape of ``x``: the bits of `elastic_np.quantize_kv`.
    scale : torch.Tensor of float32
        Its scale, for `attention`'s ``k_scale`` or ``v_scale``.

    Raises
    ------
    TypeError
        For ``x`` not a CPU tensor of those dtypes, another ``dtype``, and as
        `elastic_np.quantize_kv`.
    ValueError
        As `elastic_np.quantize_kv`.

    Examples
    --------
    >>> import torch
    >>> import elastic_np.torch as enpt
    >>> k = torch.tensor([[[[0.5, -1.0], [0.25, 2.0]]]])
    >>> data, k_scale = enpt.quantize_kv(k, torch.int8)
    >>> data[0, 0].tolist(), k_scale.tolist()
    ([[32, -64], [16, 127]], [0.015748031437397003])
    >>> data, k_scale = enpt.quantize_kv(k, torch.float8_e4m3fn, scale="token")
    >>> data.dtype, k_scale.shape
    (torch.float8_e4m3fn, torch.Size([1, 1, 2]))
    >>> enpt.attention(torch.ones(1, 1, 3, 2), data, data, k_scale=k_scale, v_scale=k_scale).shape
    torch.Size([1, 1, 3, 2])
    """
    name = _storage_name(dtype)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`x` must be a torch.Tensor, got {type(x).__name__}")
    _arrays.check_on_cpu(x, "x")
    if not x.is_floating_point():
        raise TypeError(f"`x` has dtype {x.dtype}; quantize_kv takes a float cache")
    x = x.detach()
    array = _arrays.to_numpy((x.float() if x.dtype in (torch.bfloat16, torch.float16) else x).resolve_neg())
    data, factor = _quantize_kv(array, name, scale=scale, group_size=group_size, layout=layout)
    return _arrays.from_numpy(data), torch.from_numpy(factor)


def _storage_name(dtype):
    """The name of a quantized storage dtype: a torch dtype of `_arrays.QUANTIZED`, or its name."""
    name = _arrays.QUANTIZED.get(dtype) if isinstance(dtype, torch.dtype) else dtype
    if not isinstance(name, str) or name not in _arrays.QUANTIZED.values():
        names = ", ".join(f"torch.{n}" for n in _arrays.QUANTIZED.values())
        raise TypeError(f"`dtype` must be one of {names} (or its name), got {dtype!r}")
    return name


def _check_dropout(dropout_p):
    """A `ValueError` unless ``dropout_p`` is 0 (SDPA's default, which drops nothing)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or dropout_p != 0:
        raise ValueError(f"`dropout_p`={dropout_p!r}: {_spec.FOREIGN_NAMES['dropout_p']} (dropout_p=0.0, "
                         "which drops nothing, is taken)")


@_varlen.taking_our_names
@_spec.takes_options(own=_spec.LEARNABLE, names=tuple(n for n in varlen.OPTIONS if n not in varlen.CACHE_SCALES))
def varlen_attention(query, key, value, cu_seq_q, cu_seq_k, max_q=None, max_k=None, *, return_aux=None,
                     enable_gqa=False, seqused_k=None, block_table=None, num_splits=None, dropout_p=0.0,
                     return_lse=False, backend="auto", **options):
    """`elastic_np.varlen_attention` on torch tensors: a packed batch, differentiable in every learnable input.

    ``torch.nn.attention.varlen.varlen_attn``'s arguments, in its order and
    by its names (``varlen_attn(query, key, value, cu_seq_q, cu_seq_k,
    max_q, max_k)`` reads the same here), and `elastic_np.varlen_attention`'s
    names too (``q``, ``k``, ``v``, ``cu_seqlens_q``, ``cu_seqlens_k``, by
    keyword), with the options of `attention`. Each sequence is attended
    to on its own, causality and the windows aligned to its own end, and the
    forward and every gradient are the bits of `attention` called sequence by
    sequence. The operator ``elastic_np::varlen_attention``
    (``torch.library``, with its backward operator): ``torch.compile`` keeps
    a call in its graph.

    Parameters
    ----------
    query : torch.Tensor, shape (total_q, H, D)
    key, value : torch.Tensor, shape (total_k, Hkv, D) and (total_k, Hkv, Dv)
        float32, float64, bfloat16 or float16 (the same for all three), CPU
        tensors, any strides; gradients flow to those that require them. With
        ``block_table``, pages ``(num_blocks, block_size, Hkv, D)``. ``key``
        and ``value`` may be a quantized cache (int8, float8_e4m3fn,
        float8_e5m2) with ``k_scale`` and ``v_scale``, as in
        `elastic_np.varlen_attention` (no gradient through them). By
        keyword also ``q``, ``k``, ``v``.
    cu_seq_q, cu_seq_k : torch.Tensor or array_like of int, shape (S + 1,)
        Where each of the ``S`` sequences starts, from 0 to the packed length
        (``cu_seq_k`` may be None with ``block_table``). By keyword also
        ``cu_seqlens_q``, ``cu_seqlens_k``.
    max_q, max_k : int, optional
        The longest sequences, checked when given (torch requires them).
    return_aux : torch.nn.attention.varlen.AuxRequest, optional
        With ``lse=True``, return ``(out, lse)`` as torch does: ``lse`` of
        shape ``(H, total_q)``, differentiable like ``out``.
    enable_gqa : bool, optional
        Taken for torch's signature: grouped-query heads need no flag here
        (``H`` a multiple of ``Hkv``).
    seqused_k : torch.Tensor of int, shape (S,), optional
        Keys each sequence uses (required with ``block_table``).
    block_table : torch.Tensor of int, shape (S, max_blocks), optional
        A paged cache, as in `elastic_np.varlen_attention`: the forward only
        (a backward through it is an error).
    num_splits : {None, 1}, optional
        torch's split-KV count on a GPU. Each sequence's result here is the
        bits of a call of its own whatever the batch (what torch's 1 asks
        for); another count is a `ValueError`.
    dropout_p : float, optional
        0 only, as in `attention` (FlashAttention's ``flash_attn_varlen_func``
        takes it).
    tau, beta : float or torch.Tensor of shape () or (H,), optional
        Shared by the sequences; a tensor that requires grad gets ``dtau`` or
        ``dbeta``, summed over them.
    dynamic_window : DynamicWindow or elastic_np.DynamicWindow, optional
        ``sigma`` broadcastable to ``(H,)``, or ``(S, H)`` per sequence; a
        tensor gets ``dsigma``.
    bias : list of torch.Tensor, optional
        One per sequence, the ``s``-th broadcastable to ``(H, N_s, M_s)``;
        each gets its ``dbias``.
    %(other_names)s
        As in `elastic_np.varlen_attention` (``scale`` and ``window_size``
        as torch's; tensors are accepted; ``mask`` a list of boolean tensors,
        one per sequence); no gradient.
    return_lse : bool, optional
        Also return ``lse`` of shape ``(total_q, H)``, differentiable like ``out``.
    backend : {"auto", "cpu", "reference"}, optional
        "auto" runs the CPU kernels; "reference" the float64 oracle (results
        cast back to the input dtype).

    Returns
    -------
    out : torch.Tensor, shape (total_q, H, Dv)
        In the dtype of ``query``.
    lse : torch.Tensor, shape (total_q, H), or (H, total_q) with ``return_aux``
        Only with ``return_lse=True`` or ``return_aux.lse``; in the dtype of
        ``query`` (float32 for bfloat16 and float16, as torch's always is).

    Raises
    ------
    TypeError
        For a tensor that is not on the CPU (the CUDA backend does not take
        packed batches yet) or of another floating dtype, and as
        `elastic_np.varlen_attention`.
    ValueError
        For ``num_splits`` other than None or 1, ``return_aux`` asking for
        more than ``lse``, ``dropout_p`` other than 0, and as
        `elastic_np.varlen_attention` (whose messages name ``q``, ``k``,
        ``v``, ``cu_seqlens_q``, ``cu_seqlens_k``), before anything is
        computed.

    Examples
    --------
    >>> import torch
    >>> import elastic_np.torch as enpt
    >>> q, k, v = (torch.randn(7, 2, 8, requires_grad=True) for _ in range(3))  # sequences of 3 and 4
    >>> cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    >>> beta = torch.tensor(0.5, requires_grad=True)
    >>> out = enpt.varlen_attention(q, k, v, cu, cu, 4, 4, window_size=(-1, 0), beta=beta)
    >>> out.sum().backward()
    >>> out.shape, q.grad.shape, beta.grad.shape
    (torch.Size([7, 2, 8]), torch.Size([7, 2, 8]), torch.Size([]))
    >>> second = enpt.attention(q[None, 3:], k[None, 3:], v[None, 3:], causal=True, beta=0.5, layout="bnhd")
    >>> torch.equal(out[3:], second[0])
    True
    """
    _check_dropout(dropout_p)
    aux_lse = _varlen.wants_aux_lse(return_aux, return_lse)
    _varlen.check_num_splits(num_splits)
    options = _spec.complete(options, "varlen_attention")
    varlen.check_options(options)
    fixed, learnable = common.split(options)
    q, k, v = query, key, value
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
        if x.device.type != "cpu":
            raise TypeError(f"`{name}` is on device {x.device}; elastic_np.torch.varlen_attention takes CPU "
                            "tensors (the CUDA backend does not take packed batches yet): move them with .cpu()")
    batch = {"cu_seqlens_q": cu_seq_q, "cu_seqlens_k": cu_seq_k, "block_table": block_table, "seqused_k": seqused_k}
    batch = {name: x if x is None or isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
             for name, x in batch.items()}
    batch.update(max_q=varlen.check_maximum(max_q, "max_q"), max_k=varlen.check_maximum(max_k, "max_k"))
    lists = [(f"{name}[{s}]", x) for name in varlen.PER_SEQUENCE for s, x in enumerate(options[name] or ())]
    _arrays.check_devices(None, (("q", q), ("k", k), ("v", v), *batch.items(), *learnable.items(), *lists,
                                       *((n, fixed[n]) for n in _spec.TENSOR_OPTIONS
                                         if n not in varlen.PER_SEQUENCE)), caches=_arrays.CACHES)
    fixed["backend"] = common.kernel_backend(backend)
    out, lse = _varlen.varlen_attention(q, k, v, batch, fixed, learnable)
    if aux_lse:
        return out, lse.transpose(0, 1).contiguous()
    return (out, lse) if return_lse else out


def _inverse_softplus(x):
    """``raw`` with ``softplus(raw) == x`` (for ``x > 0``)."""
    return x + math.log(-math.expm1(-x))


#: The options `ElasticAttention` is built with; it takes `_spec.PER_CALL` with each call.
_MODEL_OPTIONS = tuple(n for n in _spec.NAMES if n not in _spec.PER_CALL and n not in _spec.LEARNABLE)


@_spec.with_option_docs(own=set(_spec.NAMES) - set(_MODEL_OPTIONS))
class ElasticAttention(torch.nn.Module):
    """The attention core of a transformer block, with per-head ``tau``, ``beta`` and window width to learn.

    With its defaults it is plain attention (``tau = 1``, ``beta = 0``, no
    window, nothing learned): it gives what `attention` and torch's SDPA give
    until a parameter is made learnable. Each learnable parameter is opt-in
    (``learn_tau``, ``learn_beta``, ``learn_window``) and per head, shape
    ``(num_heads,)``:

    - ``tau = softplus(raw_tau)``: the temperature, kept ``> 0``;
    - ``beta = exp(log_beta)``: the learnable sink, kept ``> 0``, so a learned
      ``beta`` starts from a value ``> 0`` (``beta=1.0``: gpt-oss's sink logit 0);
    - ``sigma = exp(log_sigma)``: the dynamic window's width, with a window.

    A parameter that is not learned is kept with ``requires_grad=False``.

    Parameters
    ----------
    num_heads : int
        Query heads ``H``.
    tau, beta : float, optional
        Initial values (``tau > 0``, default 1; ``beta >= 0``, default 0,
        ``> 0`` when learned).
    learn_tau, learn_beta : bool, optional
        Whether ``tau`` and ``beta`` are learned (default False).
    dynamic_window : elastic_np.DynamicWindow, optional
        A window whose ``sigma`` (a scalar or ``(num_heads,)``) is the initial width.
    learn_window : bool, optional
        Whether ``sigma`` is learned (default False).
    %(other_names)s, backend
        Fixed options of `attention`.
    dtype : torch.dtype, optional
        dtype of the parameters (float32 by default).

    Examples
    --------
    >>> import torch
    >>> from elastic_np.torch import ElasticAttention
    >>> q = k = v = torch.randn(2, 4, 16, 8)
    >>> plain = ElasticAttention(4, causal=True)
    >>> torch.allclose(plain(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
    ...                atol=1e-6)
    True
    >>> attn = ElasticAttention(4, tau=0.5, learn_tau=True, beta=1.0, learn_beta=True, causal=True)
    >>> attn(q, k, v).shape
    torch.Size([2, 4, 16, 8])
    >>> sorted(name for name, p in attn.named_parameters() if p.requires_grad)
    ['log_beta', 'raw_tau']
    """

    @_spec.takes_options(names=_MODEL_OPTIONS)
    def __init__(self, num_heads, *, tau=1.0, beta=0.0, learn_tau=False, learn_beta=False,
                 dynamic_window=None, learn_window=False, backend="auto", dtype=torch.float32, **options):
        super().__init__()
        options = _spec.complete(options, "ElasticAttention", _MODEL_OPTIONS)
        if not (isinstance(num_heads, int) and num_heads > 0):
            raise ValueError(f"`num_heads` must be a positive int, got {num_heads!r}")
        tau = float(tau)
        beta = float(beta)
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"`tau` must be finite and > 0, got {tau!r}")
        if not (math.isfinite(beta) and beta >= 0):
            raise ValueError(f"`beta` must be finite and >= 0, got {beta!r}")
        if learn_beta and beta == 0:
            raise ValueError(
                "`learn_beta=True` needs an initial `beta` > 0 (beta = exp(log_beta) cannot leave 0): "
                "pass one, such as beta=1.0 (a sink logit of 0)"
            )
        self.num_heads = num_heads
        full = lambda value: torch.full((num_heads,), value, dtype=dtype)  # noqa: E731
        self.raw_tau = torch.nn.Parameter(full(_inverse_softplus(tau)), requires_grad=learn_tau)
        log_beta = math.log(beta) if beta > 0 else -math.inf
        self.log_beta = torch.nn.Parameter(full(log_beta), requires_grad=learn_beta)
        if dynamic_window is None:
            self.log_sigma = None
            self.sharpness = self.threshold = None
        else:
            sigma = np.broadcast_to(np.asarray(dynamic_window.sigma, dtype=np.float64), (num_heads,))
            self.log_sigma = torch.nn.Parameter(
                torch.tensor(np.log(sigma), dtype=dtype), requires_grad=learn_window
            )
            self.sharpness, self.threshold = dynamic_window.sharpness, dynamic_window.threshold
        self.options = dict(options, backend=backend)

    @property
    def tau(self):
        """The per-head temperature ``softplus(raw_tau)``."""
        return torch.nn.functional.softplus(self.raw_tau)

    @property
    def beta(self):
        """The per-head sink ``exp(log_beta)``."""
        return torch.exp(self.log_beta)

    @property
    def sigma(self):
        """The per-head window width ``exp(log_sigma)``, or None without a window."""
        return None if self.log_sigma is None else torch.exp(self.log_sigma)

    @_spec.takes_options(names=_spec.PER_CALL)
    def forward(self, q, k, v, *, return_lse=False, **options):
        """`attention` of ``q, k, v`` (shapes ``(B, H, N, D)``, or ``(B, N, H, D)`` with ``layout="bnhd"``) with this module's parameters.

        The options that describe the batch (%(other_names)s) are given here.
        """
        options = _spec.complete(options, "forward", _spec.PER_CALL)
        axis, axes = (1, "(B, H, N, D)") if options["layout"] == "bhnd" else (2, "(B, N, H, D)")
        if q.dim() != 4 or q.shape[axis] != self.num_heads:
            raise ValueError(
                f"this ElasticAttention was built with num_heads={self.num_heads}, but `q` of shape "
                f"{tuple(q.shape)} has {q.shape[axis] if q.dim() == 4 else 'no'} heads on axis {axis} "
                f"(shape {axes}, layout={options['layout']!r})"
            )
        window = None
        if self.log_sigma is not None:
            window = DynamicWindow(self.sigma, self.sharpness, self.threshold)
        return attention(q, k, v, tau=self.tau, beta=self.beta, dynamic_window=window,
                         return_lse=return_lse, **options, **self.options)

    def extra_repr(self):
        window = "" if self.log_sigma is None else ", dynamic_window=True"
        return f"num_heads={self.num_heads}{window}, " + ", ".join(
            f"{k}={v!r}" for k, v in self.options.items() if k != "alibi_slopes"
        )
