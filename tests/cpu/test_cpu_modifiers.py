"""The CPU kernels' logits tile with the score modifiers: tile maxima, soft-cap limits, one compile per dtype."""

import numba
import numpy as np
import pytest

import elastic_np as enp
from elastic_np import cpu
from elastic_np._contract import _problem
from elastic_np.cli import _bench
from elastic_np.cpu._tiles.logits import column_max as _column_max, logits_tile as _logits_tile
from oracle_checks import ALIBI_BH, ALIBI_H, BIASES, DTYPES, MASK_NM, holds_user_variant, make_inputs


# the kernels' helpers are only callable from compiled code (`elastic_np.cpu._runtime.numba_private.inner`)
@numba.njit
def logits_tile(st, k_j, q_t, opt, tile, nvm, cap_slope, tile_max, nonneg):
    return _logits_tile(st, k_j, q_t, opt, tile, nvm, cap_slope, tile_max, nonneg, None)


@numba.njit
def column_max(st, bk, bq, col_max, nonneg):
    _column_max(st, bk, bq, col_max, nonneg)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "opts,fused",
    [
        (dict(softcap=0.7), True),
        (dict(softcap=0.7, nvm=True), True),
        (dict(softcap=0.7, kv_lengths=[31, 25]), True),  # kv_lengths only shortens the tile
        (dict(softcap=0.7, mask=MASK_NM), False),
        (dict(softcap=0.7, window_size=(2, 2)), False),
        (dict(softcap=0.7, nvm=True, dynamic_window=enp.DynamicWindow(0.8, sharpness=3.0)), False),
        (dict(softcap=0.7, alibi_slopes=ALIBI_H), False),
        (dict(softcap=0.7, bias=BIASES["full"]), False),
        (dict(bias=BIASES["full"]), False),  # an additive modifier follows the product
        (dict(bias=BIASES["full"], nvm=True), False),
        (dict(alibi_slopes=ALIBI_BH, bias=BIASES["nm"]), False),
        (dict(bias=BIASES["nm"], tau=[0.5, 1.0, 3.0, 0.8]), False),
        (dict(alibi_slopes=ALIBI_BH, bias=BIASES["nm"], tau=[0.5, 1.0, 3.0, 0.8]), False),
        (dict(alibi_slopes=ALIBI_BH, bias=np.asfortranarray(BIASES["full"])), False),
        (dict(bias=BIASES["b11m-keypad"]), False),
        (dict(alibi_slopes=ALIBI_H, causal=True), False),
        (dict(bias=BIASES["bhn1"], mask=MASK_NM), False),
    ],
)
def test_logits_tile_maxima_with_the_product(dtype, opts, fused):
    # Where nothing is removed and no modifier follows the soft-cap, the
    # forward takes a tile's column maxima with the product (capped after the
    # soft-cap: tanh is increasing): the same logits bits and the maxima of
    # a separate pass. Elsewhere the maxima are left to the caller.
    q, k, v, _ = make_inputs(dtype)
    p = _problem.prepare(q, k, v, dtypes=cpu.dtypes, **opts)
    opt = cpu._prefill.plan.kernel_options(p, with_sigma_grad=False, dtype=np.dtype(dtype))
    b, h, hk, D = 1, 2, 1, 8
    i0, bq, j0, bk = 8, 12, 5, 20
    bk = min(bk, int(opt.kv_lengths[b]) - j0)
    # the C entry points the tile calls, registered as the backend's entry points do
    cpu._tiles.simd.compile_for(np.dtype(dtype), cpu._prefill.forward._FORWARD_TILES)
    nvm_in_logits = opt.nvm and opt.has_gate
    nonneg = opt.nvm and not opt.has_gate
    q_t = np.zeros((D, 16), dtype)
    q_t[:, :bq] = (q[b, h, i0 : i0 + bq] * (opt.scale / opt.tau[h])).T
    k_j = (np.ascontiguousarray(k[b, hk, j0 : j0 + bk]), 0)  # the keys' rows and their first column
    no_cap_slope = np.empty((0, 0), dtype)

    def logits(want_max):
        st = np.full((bk + 1, 16), np.nan, dtype)
        tile_max = np.full(16 if want_max else 0, -np.inf, dtype)  # empty: no maxima wanted
        kept, maxed = logits_tile(
            st, k_j, q_t, opt, (b, h, i0, bq, j0), nvm_in_logits, no_cap_slope, tile_max, nonneg,
        )
        assert kept
        return st, tile_max, maxed

    st, tile_max, maxed = logits(True)
    st_plain, _, maxed_plain = logits(False)
    assert maxed == fused and not maxed_plain
    np.testing.assert_array_equal(st, st_plain)
    assert np.isnan(st[bk:]).all() and np.isnan(st[:, bq:]).all()
    if fused:
        kept = np.where(st[:bk, :bq] >= 0, st[:bk, :bq], -np.inf) if nonneg else st[:bk, :bq]
        np.testing.assert_array_equal(tile_max[:bq], kept.max(axis=0))
        assert (tile_max[bq:] == -np.inf).all()
    else:
        assert (tile_max == -np.inf).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bk,bq", [(1, 5), (7, 13), (128, 128), (10, 128)])
@pytest.mark.parametrize("nonneg", [False, True])
def test_column_max_is_the_loop_in_order(dtype, bk, bq, nonneg):
    rng = np.random.default_rng(bk * 131 + bq)
    st = rng.standard_normal((bk + 2, 130)).astype(dtype)
    st[rng.random(st.shape) < 0.1] = -np.inf
    # signed zeros: the first of equal maxima stays
    st[0, : bq // 2] = np.where(rng.random(bq // 2) < 0.5, 0.0, -0.0)
    st[bk - 1, : bq // 2] = np.where(rng.random(bq // 2) < 0.5, 0.0, -0.0)
    col_max = np.full(131, -np.inf, dtype)
    col_max[::3] = rng.standard_normal(44).astype(dtype)
    expected = col_max.copy()
    for c in range(bk):
        for r in range(bq):
            x = st[c, r]
            if x > expected[r] and (x >= 0 or not nonneg):
                expected[r] = x
    column_max(st, bk, bq, col_max, nonneg)
    np.testing.assert_array_equal(col_max, expected)
    np.testing.assert_array_equal(np.signbit(col_max), np.signbit(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_large_is_plain(small_tiles, dtype):
    # tanh(x / cap) cap -> x: a huge cap is the plain attention to rounding
    q, k, v, dout = make_inputs(dtype)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", softcap=1e8)
    plain, plain_lse = enp.attention(q, k, v, return_lse=True, backend="cpu")
    np.testing.assert_allclose(out, plain, rtol=0, atol=20 * np.finfo(dtype).eps)


def test_one_compiled_kernel_per_dtype_with_modifiers():
    for dtype in (np.float32, np.float64):
        q, k, v = (a.astype(dtype) for a in _bench.make_inputs(1, 2, 9, 11, 4, seed=3))
        for options in (
            {"softcap": 2.0},
            {"alibi_slopes": [0.1, 0.2]},
            {"bias": np.zeros((9, 11), np.float32)},
            {"bias": np.zeros((1, 2, 9, 11), np.float64)},
            {"bias": np.broadcast_to(np.zeros(11, dtype), (9, 11)), "softcap": 3.0},
        ):
            out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **options)
            enp.attention_backward(out, q, k, v, out, lse, backend="cpu", **options)
    # one per dtype of the operands: float32 and float64 here, and the bits
    # views of bfloat16 and float16 where other tests of the process ran them
    # (and, for the forward, the bytes of a quantized cache, with or without
    # per-token or per-group scales: tests/cpu/test_quantized.py); a user's
    # functions compile their own (tests/variants)
    for kernel in (cpu._prefill.forward._forward_kernel, cpu._prefill.backward._backward_prepare, cpu._prefill.backward._backward_kernel,
                   cpu._prefill.key_tiles.sum_dq_shares):
        dtypes = [_operand_dtypes(signature) for signature in kernel.signatures if not holds_user_variant(signature)]
        assert len(dtypes) == len(set(dtypes)), kernel.signatures


def _operand_dtypes(signature):
    """The types of a kernel's first three arguments (its operands ``q``, ``k``, ``v``, or what stands first) and,
    for the forward, of its quantized cache's scales (``quant``: None for a float cache)."""
    quant = signature[5] if len(signature) == 13 else None  # `_forward_kernel`'s (q, k, v, pages, opt, quant, ...)
    return tuple(str(t) for t in signature[:3]), str(quant)


def _first_array(types):
    """The first array type among a signature's arguments (inside tuples too)."""
    for t in types:
        if isinstance(t, numba.types.Array):
            return t
        if isinstance(t, numba.types.BaseTuple):
            found = _first_array(t.types)
            if found is not None:
                return found
    return None
