"""PyTorch adapter: `attention` with autograd, and the `ElasticAttention` module.

``import elastic_np.torch`` imports torch (``pip install "elastic_np[torch]"``);
``import elastic_np`` does not.

`attention` is a ``torch.autograd.Function``: its forward calls
`elastic_np.attention` and keeps ``out`` and ``lse``; its backward calls
`elastic_np.attention_backward` with them and the cotangents of ``out`` and
``lse`` (the forward is never computed again) and hands ``dq``, ``dk``,
``dv``, ``dtau``, ``dbeta``, ``dsigma`` and ``dbias`` to autograd. CPU tensors reach the kernels through
``Tensor.numpy()``, without a copy when they are C-contiguous (the kernels
copy a strided tensor into a contiguous one), and the results come back
through ``torch.from_numpy``, without a copy either.

Tensors on other devices raise a TypeError: the CUDA path (the CUDA backend
on device memory through ``__cuda_array_interface__``) is not implemented.
"""

import math

import numpy as np
import torch

from elastic_np import _adapter_common as common
from elastic_np import _dispatch
from elastic_np._adapter_common import DynamicWindow

__all__ = ["attention", "ElasticAttention", "DynamicWindow"]

_KERNEL_DTYPES = (torch.float32, torch.float64)


def _host(value, name):
    """A CPU tensor as a NumPy view (no copy), anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.device.type != "cpu":
        raise TypeError(
            f"`{name}` is on device {value.device}; elastic_np.torch takes CPU tensors only "
            "(the CUDA path is not implemented): move it with .cpu()"
        )
    if value.is_floating_point() and value.dtype not in _KERNEL_DTYPES:
        raise TypeError(
            f"`{name}` has dtype {value.dtype}; the elastic_np kernels take torch.float32 or "
            "torch.float64: convert it with .float() (or .double())"
        )
    return value.detach().resolve_neg().numpy()


def _as_grad(grad, like):
    """A NumPy gradient (or Python float) as a tensor of ``like``'s dtype and shape."""
    return torch.as_tensor(np.asarray(grad)).to(like.dtype).reshape(like.shape)


class _AttentionFunction(torch.autograd.Function):
    """``(out, lse)`` of `elastic_np.attention`; gradients from `elastic_np.attention_backward`."""

    @staticmethod
    def forward(ctx, fixed, q, k, v, tau, beta, sigma, bias):
        learnable = dict(zip(common.LEARNABLE, (tau, beta, sigma, bias)))
        host = {name: _host(value, name) for name, value in learnable.items()}
        qn, kn, vn = (_host(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        out, lse = _dispatch.attention(
            qn, kn, vn, return_lse=True, **common.numpy_options(fixed, host)
        )
        out = torch.from_numpy(out).to(q.dtype)
        lse = torch.from_numpy(lse).to(q.dtype)
        ctx.fixed = fixed
        ctx.constants = {n: v for n, v in learnable.items() if not isinstance(v, torch.Tensor)}
        tensors = [learnable[n] if n not in ctx.constants else None for n in common.LEARNABLE]
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        # an output the loss does not use gets None, not zeros: no dlse costs nothing
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        learnable = dict(zip(common.LEARNABLE, tensors))
        learnable.update(ctx.constants)
        host = {name: _host(value, name) for name, value in learnable.items()}
        dout = torch.zeros_like(out) if dout is None else dout.to(out.dtype)
        if dlse is not None:
            dlse = _host(dlse.to(lse.dtype), "dlse")
        grads = _dispatch.attention_backward(
            _host(dout, "dout"), *(_host(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))),
            _host(out, "out"), _host(lse, "lse"), dlse=dlse, **common.numpy_options(ctx.fixed, host),
        )
        needs = ctx.needs_input_grad[1:]
        result = [
            _as_grad(g, x) if need else None
            for g, x, need in zip((grads.dq, grads.dk, grads.dv), (q, k, v), needs[:3])
        ]
        for name, need in zip(common.LEARNABLE, needs[3:]):
            result.append(_as_grad(common.grad_of(grads, name), learnable[name]) if need else None)
        return (None, *result)


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
    """`elastic_np.attention` on torch tensors, differentiable in every learnable input.

    Parameters
    ----------
    q, k, v : torch.Tensor
        CPU tensors of shapes ``(B, H, N, D)``, ``(B, Hkv, M, D)``,
        ``(B, Hkv, M, Dv)``, float32 or float64 (the same for all three), any
        strides; gradients flow to those that require them.
    tau, beta : float or torch.Tensor of shape () or (H,), optional
        Temperature (``> 0``) and the sink, the denominator's offset (``>= 0``);
        a tensor that requires grad gets ``dtau`` or ``dbeta``.
    dynamic_window : DynamicWindow or elastic_np.DynamicWindow, optional
        The bell-curve window; with `DynamicWindow` its ``sigma`` may be a
        tensor (broadcastable to ``(B, H)``) that gets ``dsigma``.
    bias : torch.Tensor, optional
        Additive score bias broadcastable to ``(B, H, N, M)``; gets ``dbias``
        in its own shape.
    scale, causal, window_size, kv_lengths, align, mask, nvm, softcap, alibi_slopes
        As in `elastic_np.attention` (tensors are accepted); no gradient.
    return_lse : bool, optional
        Also return ``lse`` of shape ``(B, H, N)``, differentiable like ``out``
        (a loss may use either or both). A row with ``lse = -inf`` (nothing
        kept, ``beta = 0``) passes no gradient back.
    backend : {"auto", "cpu", "reference"}, optional
        "auto" runs the CPU kernels. "reference" runs the float64 oracle
        (results cast back to the input dtype).

    Returns
    -------
    out : torch.Tensor, shape (B, H, N, Dv)
        In the dtype of ``q``.
    lse : torch.Tensor, shape (B, H, N)
        Only with ``return_lse=True``; in the dtype of ``q``.

    Raises
    ------
    TypeError
        For a tensor that is not on the CPU, or of dtype float16 or bfloat16
        (convert it with ``.float()``); and as `elastic_np.attention`.
    ValueError
        As `elastic_np.attention`.

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
    sigma, sharpness, threshold = common.window_parts(dynamic_window)
    fixed = {
        "scale": scale, "causal": causal, "window_size": window_size,
        "kv_lengths": _host(kv_lengths, "kv_lengths"), "align": align, "mask": _host(mask, "mask"),
        "nvm": nvm, "softcap": softcap, "alibi_slopes": _host(alibi_slopes, "alibi_slopes"),
        "sharpness": sharpness, "threshold": threshold, "backend": common.kernel_backend(backend),
    }
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    out, lse = _AttentionFunction.apply(fixed, q, k, v, tau, beta, sigma, bias)
    return (out, lse) if return_lse else out


def _inverse_softplus(x):
    """``raw`` with ``softplus(raw) == x`` (for ``x > 0``)."""
    return x + math.log(-math.expm1(-x))


class ElasticAttention(torch.nn.Module):
    """The attention core of a transformer block with learnable per-head ``tau`` and ``beta``.

    Parametrisation (each per head, shape ``(num_heads,)``):

    - ``tau = softplus(raw_tau)``: the temperature, kept ``> 0``;
    - ``beta = exp(log_beta)``: the learnable sink, kept ``> 0``;
    - ``sigma = exp(log_sigma)``: the dynamic window's width, with a window.

    A parameter that is not learned (``learn_tau=False`` ...) is kept with
    ``requires_grad=False``; a fixed ``beta`` may be 0.

    Parameters
    ----------
    num_heads : int
        Query heads ``H``.
    tau, beta : float, optional
        Initial values (``tau > 0``; ``beta > 0`` when learned, else ``>= 0``).
    learn_tau, learn_beta : bool, optional
        Whether ``tau`` and ``beta`` are learned.
    dynamic_window : elastic_np.DynamicWindow, optional
        A window whose ``sigma`` (a scalar or ``(num_heads,)``) is the initial width.
    learn_window : bool, optional
        Whether ``sigma`` is learned.
    scale, causal, window_size, nvm, softcap, alibi_slopes, backend
        Fixed options of `attention`.
    dtype : torch.dtype, optional
        dtype of the parameters (float32 by default).

    Examples
    --------
    >>> import torch
    >>> from elastic_np.torch import ElasticAttention
    >>> attn = ElasticAttention(4, tau=0.5, beta=1.0, causal=True)
    >>> q = k = v = torch.randn(2, 4, 16, 8)
    >>> attn(q, k, v).shape
    torch.Size([2, 4, 16, 8])
    >>> sorted(name for name, p in attn.named_parameters() if p.requires_grad)
    ['log_beta', 'raw_tau']
    """

    def __init__(self, num_heads, *, tau=1.0, beta=1.0, learn_tau=True, learn_beta=True,
                 dynamic_window=None, learn_window=True, scale=None, causal=False,
                 window_size=(-1, -1), nvm=False, softcap=None, alibi_slopes=None,
                 backend="auto", dtype=torch.float32):
        super().__init__()
        if not (isinstance(num_heads, int) and num_heads > 0):
            raise ValueError(f"`num_heads` must be a positive int, got {num_heads!r}")
        tau = float(tau)
        beta = float(beta)
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"`tau` must be finite and > 0, got {tau!r}")
        if not (math.isfinite(beta) and (beta > 0 or (beta == 0 and not learn_beta))):
            raise ValueError(
                f"`beta` must be finite and > 0 when learned (beta = exp(log_beta)), >= 0 when "
                f"fixed; got {beta!r}"
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
        self.options = dict(scale=scale, causal=causal, window_size=window_size, nvm=nvm,
                            softcap=softcap, alibi_slopes=alibi_slopes, backend=backend)

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

    def forward(self, q, k, v, *, bias=None, mask=None, kv_lengths=None, align="array",
                return_lse=False):
        """`attention` of ``q, k, v`` (shapes ``(B, H, N, D)``) with this module's parameters."""
        window = None
        if self.log_sigma is not None:
            window = DynamicWindow(self.sigma, self.sharpness, self.threshold)
        return attention(q, k, v, tau=self.tau, beta=self.beta, dynamic_window=window, bias=bias,
                         mask=mask, kv_lengths=kv_lengths, align=align, return_lse=return_lse,
                         **self.options)

    def extra_repr(self):
        window = "" if self.log_sigma is None else ", dynamic_window=True"
        return f"num_heads={self.num_heads}{window}, " + ", ".join(
            f"{k}={v!r}" for k, v in self.options.items() if k != "alibi_slopes"
        )
