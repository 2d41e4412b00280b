"""The kernel plan: every option as runtime values the njit kernels read (`kernel_options`).

Built once per call on the host, from the validated problem: the compact
mask and bias with their element strides, the dynamic window tabulated by
offset, per-head ``tau`` and ``beta``, ALiBi's slopes. One compiled
specialisation per dtype serves every option set.
"""

import collections
import math

import numpy as np
from numba import njit

from elastic_np._contract import _validation
from elastic_np._contract._compact import compact_bias, compact_mask
from elastic_np._contract._problem import Kept
from elastic_np._contract._ranges import offset_band
from elastic_np.cpu._prefill.values import finite
from elastic_np.cpu._tiles.logits import ensure_modifiers
from elastic_np.cpu._tiles.pages import used_pages

# Everything the njit code needs to know about the options, as runtime values:
# one compiled specialisation per dtype whatever the options are.
_Options = collections.namedtuple(
    "_Options",
    [
        "scale",  # float
        "causal",  # bool
        "left",  # int, -1 unbounded
        "right",  # int, -1 unbounded
        "nvm",  # bool
        "has_mask",  # bool
        "has_gate",  # bool
        "tau",  # float64 (H,)
        "beta",  # float64 (H,)
        "kv_lengths",  # int64 (B,)
        "n_queries",  # int N
        "n_keys",  # int M
        "diag_shift",  # int64 (B,): kv_ends[b] - N, entry (i, j) at offset off = j - i - diag_shift[b]
        "mask",  # bool, 1-D: the mask's distinct entries, C order
        "mask_strides",  # int64 (4,): element strides of (b, h, i, j) into `mask`, 0 when broadcast
        "log_gate",  # float64 (B, H, N + M - 1): log G by offset j - i - diag_shift[b], + M - 1
        "dlog_gate",  # float64, same shape: d log G / d sigma (0 where G = 0)
        "band",  # int64 (B, H, 2): offsets [lo, hi] that causal, the window and the gate leave (`offset_band`)
        "has_softcap",  # bool
        "softcap",  # float (1.0 when off)
        "has_alibi",  # bool
        "alibi",  # float64 (B, H) slopes (1 x 1 zeros when off)
        "has_bias",  # bool
        "bias",  # kernel dtype, 1-D read-only: the bias's distinct entries (a 1-element dummy when off)
        "bias_strides",  # int64 (4,): element strides of (b, h, i, j) into `bias`, 0 when broadcast
    ],
)


#: `kernel_options` of the latest problems with a ``plan_key``, by it: every layer of a model's step repeats one.
_KEPT = Kept()


def kernel_options(p, with_sigma_grad, dtype):
    """The `_Options` of problem ``p`` for kernels computing in ``dtype``; looked up when ``p.plan_key`` is set.

    A kept one's arrays are shared by the calls that look it up: the kernels only read them.
    """
    key = None if p.plan_key is None else (p.plan_key, with_sigma_grad, dtype)
    return _KEPT.get_or_make(key, lambda: _built_options(p, with_sigma_grad, dtype))


def _built_options(p, with_sigma_grad, dtype):
    B, H, Hkv, N, M, D, Dv = p.shape
    if p.mask is None:
        mask = np.ones(1, dtype=np.bool_)
        mask_strides = np.zeros(4, dtype=np.int64)
    else:
        mask, mask_strides = compact_mask(p.mask)
        mask = mask.reshape(-1)
    gate_band = None
    if p.sigma is None:
        log_gate = dlog_gate = np.zeros((1, 1, 1))
    else:
        width = max(N + M - 1, 1)
        log_gate = np.empty((B, H, width))
        dlog_gate = np.empty((B, H, width) if with_sigma_grad else (1, 1, 1))
        gate_band = np.empty((B, H, 2), dtype=np.int64)
        _window_tables(
            p.sigma, float(p.sharpness), float(p.threshold), N, M,
            np.ascontiguousarray(p.kv_ends, dtype=np.int64), with_sigma_grad, log_gate, dlog_gate, gate_band,
        )
    if p.softcap is not None or p.alibi is not None or p.bias is not None:
        ensure_modifiers(dtype)
    if p.bias is None:
        bias = np.zeros(1, dtype=dtype)
        bias.setflags(write=False)
        bias_strides = np.zeros(4, dtype=np.int64)
    else:
        bias, bias_strides = compact_bias(p.bias, dtype, check=p.bias_unchecked)
    return _Options(
        scale=float(p.scale),
        causal=bool(p.causal),
        left=int(p.window[0]),
        right=int(p.window[1]),
        nvm=bool(p.nvm),
        has_mask=p.mask is not None,
        has_gate=p.sigma is not None,
        tau=np.ascontiguousarray(p.tau, dtype=np.float64),
        beta=np.ascontiguousarray(p.beta, dtype=np.float64),
        kv_lengths=np.ascontiguousarray(p.kv_lengths, dtype=np.int64),
        n_queries=N,
        n_keys=M,
        diag_shift=np.ascontiguousarray(p.kv_ends - N, dtype=np.int64),
        mask=mask,
        mask_strides=mask_strides,
        log_gate=log_gate,
        dlog_gate=dlog_gate,
        band=offset_band(p, gate_band),
        has_softcap=p.softcap is not None,
        softcap=float(p.softcap) if p.softcap is not None else 1.0,
        has_alibi=p.alibi is not None,
        alibi=np.zeros((1, 1)) if p.alibi is None else np.ascontiguousarray(p.alibi, np.float64),
        has_bias=p.bias is not None,
        bias=bias,
        bias_strides=bias_strides,
    )


@njit(cache=True, fastmath=False)
def _window_tables(sigma, sharpness, threshold, N, M, ends, with_grad, log_gate, dlog_gate, band):
    """Tabulate the dynamic-window gate by offset ``off = j - i - (E_b - N)``, ``E_b = ends[b]``.

    Fills ``log_gate[b, h, off + M - 1] = log G`` (``-inf`` where the gate is
    closed) and, with ``with_grad``, ``dlog_gate`` with ``d log G / d sigma``
    (0 where closed); ``band[b, h] = [lo, hi]``, the offsets between the first
    and the last open entry (``lo > hi`` when none is open).

    The band is first bounded analytically, ``f > threshold`` only where
    ``x^2 < 2 sigma^2 log(1 / (threshold sigma sqrt(2 pi)))`` (where ``f``
    does not underflow to 0 for ``threshold = 0``), widened by a margin; the
    table is evaluated only there, and the band is then trimmed to the entries
    that are exactly open. The position is ``x = 2 off / (E_b - 1)`` (0 for
    ``E_b <= 1``); the offsets run over ``[1 - M, N - 1]`` whatever ``E_b``.
    """
    B, H = sigma.shape
    width = log_gate.shape[2]
    root_2pi = math.sqrt(2 * math.pi)
    for b in range(B):
        E = ends[b]
        for h in range(H):
            s = sigma[b, h]
            for t in range(width):
                log_gate[b, h, t] = -np.inf
                if with_grad:
                    dlog_gate[b, h, t] = 0.0
            # Analytic bound on |x| where f > threshold (or f > 0).
            if threshold > 0.0:
                c = threshold * s * root_2pi
                y_max = -math.log(c) if c < 1.0 else -1.0
            else:
                y_max = 746.0  # exp(-y) underflows to 0 beyond about 745.13
            if y_max < 0.0:
                band[b, h, 0] = 1
                band[b, h, 1] = 0
                continue
            if E > 1:
                x_max = s * math.sqrt(2.0 * y_max) * (1.0 + 1e-6) + 1e-12
                reach = min(x_max * (E - 1) / 2.0 + 2.0, float(N + M + 1))
                off_reach = int(reach)
            else:
                off_reach = N + M + 1
            lo_t = max(-off_reach + M - 1, 0)
            hi_t = min(off_reach + M - 1, width - 1)
            first = width
            last = -1
            for t in range(lo_t, hi_t + 1):
                off = t - (M - 1)
                x = 2.0 * off / (E - 1) if E > 1 else 0.0
                u = x / s  # divided first: s * s and s**3 underflow for a tiny sigma
                f = math.exp(-0.5 * (u * u)) / (s * root_2pi)
                g = math.tanh(sharpness * (f if f > threshold else 0.0))
                if g > 0.0:
                    log_gate[b, h, t] = math.log(g)
                    if with_grad:
                        # d log G / d sigma = (d log G / d log y) (d log f / d sigma), y = sharpness f
                        dlog_gate[b, h, t] = _log_tanh_elasticity(sharpness * f) * ((u * u - 1.0) / s)
                    first = min(first, t)
                    last = max(last, t)
            band[b, h, 0] = first - (M - 1)
            band[b, h, 1] = last - (M - 1)


@njit(cache=True, fastmath=False)
def _log_tanh_elasticity(y):
    """``d log tanh(y) / d log y = 2y / sinh(2y)`` for ``y > 0``, as the oracle's `log_tanh_elasticity`.

    ``(w / (1 - e^2)) e`` with ``w = 4y``, ``e = exp(-2y)``, ``1 - e^2`` from
    ``expm1``: no cancellation as ``tanh(y)`` rounds to 1, and no ``1 / y``
    that overflows as ``y`` reaches the subnormals (a row far from all its
    keys), where it is exactly 1. 0 where ``e`` underflows.
    """
    e = math.exp(-2.0 * y)
    if e == 0.0:
        return 0.0
    w = 4.0 * y
    return w / -math.expm1(-w) * e


def check_cache(problem):
    """The check `prepare` deferred, for the paths that do not make it as they read.

    Every key and value finite passes at once (`finite`); else the keys below ``kv_lengths`` alone are checked,
    and the error named (`elastic_np._contract._validation.check_cache_values`).
    """
    if problem.kv_unchecked and not (finite(problem.k) and finite(problem.v)):
        _validation.check_cache_values(problem.k, problem.v, problem.kv_lengths)


def check_paged_cache(paged, problem):
    """`check_cache` for a paged cache ``(k_pages, v_pages, block_table)``: batch entry ``b``'s first
    ``kv_lengths[b]`` keys and values, page by page, in place (the pages no entry uses are never read)."""
    if not problem.kv_unchecked:
        return
    k_pages, v_pages, table = paged
    for name, pool in (("k", k_pages), ("v", v_pages)):
        for _, _, page, n in used_pages(table, problem.kv_lengths, pool.shape[1]):
            if not _validation.all_finite(pool[page, :n]):
                raise ValueError(f"`{name}` contains NaN or inf")
