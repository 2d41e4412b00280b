"""The Numba CPU kernels against the float64 oracle.

float64 results must agree with `elastic_np.reference` to 1e-12 relative;
float32 results within twice the error of a float32 naive evaluation (and
1e-5 absolute on unit-scale inputs). Most cases shrink the tile sizes so that
small shapes still cross several query and key tiles.
"""

import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

import elastic_np as enp
from elastic_np import _bench, _conformance, _dispatch, _options, cpu, reference
from elastic_np._tiles import stream_width

DTYPES = [np.float64, np.float32]


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 queries x 5 keys: every test shape spans several of both, on every thread."""
    monkeypatch.setattr(cpu, "BLOCK_Q", 8)
    monkeypatch.setattr(cpu, "BLOCK_K", 5)
    monkeypatch.setattr(cpu, "SERIAL_WORK", 0)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _inputs(dtype, B=2, H=4, Hkv=2, N=23, M=31, D=8, Dv=6, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, N, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, M, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, M, Dv)).astype(dtype)
    dout = rng.standard_normal((B, H, N, Dv)).astype(dtype)
    return q, k, v, dout


def assert_close(name, result, oracle, dtype, naive=None, rounding=None):
    """Check shape and dtype, then the accuracy rule; print the worst difference.

    float64: ``max|result - oracle| <= 1e-12 * max(1, max|oracle|)``.
    float32: `elastic_np._conformance.float32_allowed`, twice the worst error of
    ``naive`` (naive float32 evaluations in several summation orders) plus
    ``rounding`` (default one float32 ulp of the scale), and at most
    ``1e-5 * max(1, max|oracle|)``.
    ``-inf`` (an empty row's lse with beta = 0) must sit at the same places.
    ``out``, ``lse``, ``dq``, ``dk``, ``dv``, ``dbias`` keep the input dtype; ``dtau``,
    ``dbeta``, ``dsigma`` come back in float64 like ``tau``, ``beta``, ``sigma``.
    """
    result = np.asarray(result)
    oracle = np.asarray(oracle, dtype=np.float64)
    assert result.shape == oracle.shape, f"{name}: shape {result.shape} != {oracle.shape}"
    if name in ("out", "lse", "dq", "dk", "dv", "dbias"):
        assert result.dtype == dtype, f"{name}: dtype {result.dtype} != {np.dtype(dtype)}"
    inf_r, inf_o = np.isneginf(result), np.isneginf(oracle)
    np.testing.assert_array_equal(inf_r, inf_o, err_msg=f"{name}: -inf entries differ")
    assert np.isfinite(result[~inf_r]).all(), f"{name}: NaN or inf"
    finite = ~inf_o
    r64 = result.astype(np.float64)[finite]
    o64 = oracle[finite]
    scale = max(1.0, float(np.abs(o64).max(initial=0.0)))
    err = float(np.abs(r64 - o64).max(initial=0.0))
    if np.dtype(dtype) == np.float64:
        bound = 1e-12 * scale
        print(f"{name}: worst |diff| {err:.3e} (bound {bound:.1e})")
        assert err <= bound, f"{name}: worst |diff| {err:.3e} > {bound:.1e}"
        return
    bound, naive_err = _conformance.float32_allowed(oracle, naive, rounding)
    print(f"{name}: worst |diff| {err:.3e}, naive float32 {naive_err:.3e} (bound {bound:.1e})")
    assert err <= bound, f"{name}: worst |diff| {err:.3e} > {bound:.3e} (naive {naive_err:.3e})"


def check_case(dtype, opts, seed=0, **shape):
    """Forward and backward of the CPU backend against the oracle, for one option set."""
    q, k, v, dout = _inputs(dtype, seed=seed, **shape)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
    grads = enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", **opts)

    q64, k64, v64, dout64 = (a.astype(np.float64) for a in (q, k, v, dout))
    ref_out, ref_lse = reference.attention(q64, k64, v64, **opts)
    with np.errstate(all="ignore"):
        ref_grads = reference.attention_backward(dout64, q64, k64, v64, ref_out, ref_lse, **opts)

    naive, summation = {}, {}
    if dtype == np.float32:
        orderings = _conformance.naive_orderings(q, k, v, dout, opts, np.float32)
        naive = {name: [n[name] for n in orderings] for name in orderings[0]}
        summation = _conformance.summation_allowance(q, k, v, dout, opts)
    assert_close("out", out, ref_out, dtype, naive.get("out"))
    assert_close("lse", lse, ref_lse, dtype, naive.get("lse"))
    for field in ("dq", "dk", "dv", "dtau", "dbeta", "dsigma", "dbias"):
        got, want = getattr(grads, field), getattr(ref_grads, field)
        if want is None:
            assert got is None, field
            continue
        assert np.shape(got) == np.shape(want), field
        if np.shape(want) == ():
            assert isinstance(got, float), f"{field} should be a Python float"
        assert_close(field, got, want, dtype, naive.get(field), summation.get(field))
    return out, lse, grads


# ---------------------------------------------------------------------------
# Every option alone and combined
# ---------------------------------------------------------------------------

_RNG = np.random.default_rng(42)
_MASK_NM = _RNG.random((23, 31)) > 0.3
_MASK_B1NM = _RNG.random((2, 1, 23, 31)) > 0.4
_SIGMA_BH = np.array([[0.3, 0.5, 0.8, 1.2], [0.6, 0.25, 0.4, 2.0]])
_ALIBI_H = np.array([0.5, 0.25, 0.125, 0.0625])
_ALIBI_BH = np.array([[0.3, 0.05, 0.0, 0.2], [0.1, 0.4, 0.02, 0.07]])


def _bias(shape, seed=0, pad=0.0):
    """A random bias of ``shape``; a fraction ``pad`` of its entries is ``-inf``."""
    rng = np.random.default_rng(seed)
    bias = rng.standard_normal(shape)
    return np.where(rng.random(shape) < pad, -np.inf, bias)


# Bias shapes for (B, H, N, M) = (2, 4, 23, 31): every pattern of broadcasting.
BIASES = {
    "full": _bias((2, 4, 23, 31), 1),
    "nm": _bias((23, 31), 2),
    "1h1m-keypad": _bias((1, 4, 1, 31), 3, pad=0.25),
    "b11m-keypad": _bias((2, 1, 1, 31), 4, pad=0.3),
    "bhn1": _bias((2, 4, 23, 1), 5),
    "b1n1": _bias((2, 1, 23, 1), 6),
    "scalar": np.array([0.7]),
    "full-some-inf": _bias((2, 4, 23, 31), 7, pad=0.1),
    "1hnm": _bias((1, 4, 23, 31), 8),
}

CASES = {
    "plain": {},
    "scale": dict(scale=0.3),
    "causal": dict(causal=True),
    "window": dict(window_size=(5, 3)),
    "window-left": dict(window_size=(4, -1)),
    "window-right": dict(window_size=(-1, 2)),
    "causal-window": dict(causal=True, window_size=(6, 0)),
    "kv-lengths": dict(kv_lengths=[17, 31]),
    "mask-nm": dict(mask=_MASK_NM),
    "mask-b1nm": dict(mask=_MASK_B1NM),
    "nvm": dict(nvm=True),
    "tau-beta-scalar": dict(tau=0.7, beta=0.5),
    "tau-beta-per-head": dict(tau=[0.5, 1.0, 2.0, 0.8], beta=[0.0, 0.3, 1.0, 2.5]),
    "elastic": dict(nvm=True, tau=[0.5, 1.0, 2.0, 0.8], beta=[0.0, 0.3, 1.0, 2.5]),
    "window-gate": dict(dynamic_window=enp.DynamicWindow(0.4, sharpness=3.0, threshold=0.2)),
    "window-gate-zero-threshold": dict(dynamic_window=enp.DynamicWindow(_SIGMA_BH, sharpness=2.0)),
    "window-gate-per-batch": dict(
        dynamic_window=enp.DynamicWindow([[0.3], [0.7]], sharpness=5.0, threshold=0.1)
    ),
    "everything": dict(
        causal=True, window_size=(12, -1), kv_lengths=[20, 29], mask=_MASK_B1NM, nvm=True,
        tau=[0.5, 1.0, 2.0, 0.8], beta=[0.0, 0.3, 1.0, 2.5],
        dynamic_window=enp.DynamicWindow(_SIGMA_BH, sharpness=3.0, threshold=0.05),
    ),
    # score modifiers, alone and with the other options
    "softcap": dict(softcap=1.5),
    "softcap-tight": dict(softcap=0.2, scale=2.0),
    "alibi-h": dict(alibi_slopes=_ALIBI_H),
    "alibi-bh": dict(alibi_slopes=_ALIBI_BH),
    "softcap-causal": dict(softcap=0.8, causal=True),
    "softcap-window": dict(softcap=1.0, window_size=(5, 3)),
    "softcap-nvm": dict(softcap=1.2, nvm=True),
    "softcap-tau-beta": dict(softcap=0.9, tau=[0.5, 1.0, 2.0, 0.8], beta=[0.0, 0.3, 1.0, 2.5]),
    "softcap-mask": dict(softcap=1.5, mask=_MASK_NM),
    "softcap-alibi": dict(softcap=1.5, alibi_slopes=_ALIBI_H),
    "softcap-nvm-window": dict(softcap=0.9, nvm=True, window_size=(7, 2)),
    "alibi-causal": dict(alibi_slopes=_ALIBI_H, causal=True),
    "alibi-window": dict(alibi_slopes=_ALIBI_BH, window_size=(4, -1)),
    "alibi-nvm-tau": dict(alibi_slopes=[0.05, 0.1, 0.0, 0.02], nvm=True, tau=[0.5, 1.0, 2.0, 0.8]),
    "alibi-beta": dict(alibi_slopes=_ALIBI_H, beta=0.6),
    "bias-nvm": dict(bias=BIASES["nm"], nvm=True),
    "bias-causal": dict(bias=BIASES["full"], causal=True),
    "bias-window-tau-beta": dict(
        bias=BIASES["1h1m-keypad"], window_size=(6, 2), tau=[0.5, 1.0, 2.0, 0.8], beta=0.4
    ),
    "bias-keypad-causal": dict(bias=BIASES["b11m-keypad"], causal=True),
    "bias-fortran-order": dict(bias=np.asfortranarray(BIASES["full"])),
    "alibi-bias-nvm": dict(alibi_slopes=_ALIBI_BH, bias=BIASES["full"], nvm=True),
    "alibi-bias-mask": dict(alibi_slopes=_ALIBI_H, bias=BIASES["bhn1"], mask=_MASK_B1NM),
    "alibi-bias-fortran-window": dict(
        alibi_slopes=_ALIBI_H, bias=np.asfortranarray(BIASES["full-some-inf"]), window_size=(5, 3)
    ),
    "bias-gate": dict(
        bias=BIASES["bhn1"], dynamic_window=enp.DynamicWindow(_SIGMA_BH, sharpness=2.0)
    ),
    "modifiers-gate-nvm": dict(
        softcap=1.1, alibi_slopes=_ALIBI_H, bias=BIASES["b11m-keypad"], nvm=True,
        dynamic_window=enp.DynamicWindow(0.6, sharpness=3.0, threshold=0.1),
    ),
    "modifiers-everything": dict(
        causal=True, window_size=(12, -1), kv_lengths=[20, 29], mask=_MASK_B1NM, nvm=True,
        tau=[0.5, 1.0, 2.0, 0.8], beta=[0.0, 0.3, 1.0, 2.5],
        dynamic_window=enp.DynamicWindow(_SIGMA_BH, sharpness=3.0, threshold=0.05),
        softcap=1.3, alibi_slopes=_ALIBI_BH, bias=BIASES["full-some-inf"],
    ),
}
for _name, _bias_array in BIASES.items():
    CASES[f"bias-{_name}"] = dict(bias=_bias_array)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_options(small_tiles, dtype, case):
    check_case(dtype, CASES[case])


def _laid_out(bias, layout):
    """The values of ``bias`` in another memory layout: a view where numpy gives one.

    ``"strided"`` is every other entry along every axis of a NaN-filled
    array, so that an entry read through wrong strides shows.
    """
    if layout == "C":
        return np.ascontiguousarray(bias)
    if layout == "F":
        return np.asfortranarray(bias)
    if layout == "queries-contiguous":  # the last two axes transposed in memory, as `.mT` gives
        return np.ascontiguousarray(np.swapaxes(bias, -1, -2)).swapaxes(-1, -2)
    if layout == "strided":
        big = np.full(tuple(2 * n + 1 for n in bias.shape), np.nan, dtype=bias.dtype)
        view = big[(slice(1, None, 2),) * bias.ndim]
        view[...] = bias
        return view
    if layout == "reversed":  # negative strides along the keys
        return np.ascontiguousarray(bias[..., ::-1])[..., ::-1]
    raise ValueError(layout)


_LAYOUTS = ["C", "F", "queries-contiguous", "strided", "reversed"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_name", ["full", "nm", "bhn1", "b1n1", "1h1m-keypad", "1hnm"])
@pytest.mark.parametrize("layout", _LAYOUTS)
def test_bias_layouts(small_tiles, dtype, bias_name, layout):
    # With beta and NVM a bias constant along the keys changes the result
    # (softmax alone is blind to it): every layout must be read at its strides.
    bias = _laid_out(BIASES[bias_name].astype(dtype), layout)
    check_case(dtype, dict(bias=bias, beta=[0.0, 0.3, 1.0, 2.5], nvm=True, tau=0.8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dq_shares_in_chunks(small_tiles, monkeypatch, dtype):
    # One key tile per chunk: the dq shares are summed over many chunks.
    monkeypatch.setattr(cpu, "DQ_SHARES_BYTES", 1)
    check_case(dtype, CASES["everything"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_gqa(small_tiles, dtype):
    check_case(dtype, dict(causal=True, nvm=True, tau=0.6), H=3, Hkv=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_query(small_tiles, dtype):
    check_case(dtype, dict(window_size=(3, 7), beta=1.0), H=4, Hkv=1)


# ---------------------------------------------------------------------------
# Sizes: not multiples of the tile, degenerate lengths, empty rows
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,opts",
    [
        (np.float64, dict(causal=True, nvm=True, tau=0.8, beta=0.5)),
        (np.float32, dict(window_size=(300, 40), kv_lengths=[1000], tau=[1.5, 0.7], beta=0.2)),
    ],
)
def test_default_tiles_odd_sizes(dtype, opts):
    check_case(dtype, opts, B=1, H=2, Hkv=1, N=97, M=1025, D=59, Dv=59)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,opts",
    [
        (dict(N=1, M=31), dict(causal=True)),
        (dict(N=1, M=31), dict(beta=0.5, nvm=True)),
        (dict(N=23, M=1), dict(causal=True, beta=0.4)),
        (dict(N=23, M=1), dict(dynamic_window=enp.DynamicWindow(0.5))),
        (dict(N=1, M=1), dict(tau=0.3)),
        (dict(N=31, M=12), dict(causal=True)),
        (dict(N=31, M=12), dict(causal=True, beta=[0.0, 0.5, 1.0, 2.0], window_size=(3, -1))),
    ],
)
def test_degenerate_lengths(small_tiles, dtype, shape, opts):
    check_case(dtype, opts, **shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [0.0, 0.7])
def test_empty_rows(small_tiles, dtype, beta):
    # N > M causal: the first N - M queries see no key; kv_lengths = 0 empties batch 1;
    # the mask removes every key of query 5.
    mask = np.ones((40, 13), dtype=bool)
    mask[5] = False
    opts = dict(causal=True, kv_lengths=[13, 0], mask=mask, beta=beta, tau=0.9)
    out, lse, grads = check_case(dtype, opts, N=40, M=13)
    empty = np.zeros((2, 4, 40), dtype=bool)
    empty[:, :, :27] = True
    empty[1] = True
    empty[:, :, 5] = True
    assert (out[empty] == 0).all()
    want = np.log(dtype(beta)) if beta > 0 else -np.inf
    np.testing.assert_array_equal(lse[empty], np.full(empty.sum(), want, dtype=dtype))
    for field in ("dq", "dk", "dv"):
        assert np.isfinite(getattr(grads, field)).all()
    assert np.isfinite(grads.dtau) and np.isfinite(grads.dbeta)
    assert (grads.dq[empty] == 0).all()
    assert (grads.dk[1] == 0).all() and (grads.dv[1] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_closed_everywhere(small_tiles, dtype):
    # threshold above the bell's peak 1/(sigma sqrt(2 pi)): every row is empty.
    opts = dict(beta=0.5, dynamic_window=enp.DynamicWindow(0.5, threshold=1.0))
    out, lse, grads = check_case(dtype, opts)
    assert (out == 0).all()
    assert grads.dsigma == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_narrow_gate_on_long_keys(dtype):
    # A narrow band over many keys: only tiles near the diagonal are visited.
    opts = dict(dynamic_window=enp.DynamicWindow(0.02, sharpness=4.0, threshold=1.0), tau=0.5)
    check_case(dtype, opts, B=1, H=2, Hkv=2, N=90, M=700, D=16, Dv=16)


# ---------------------------------------------------------------------------
# Inputs: layout, mutation, determinism, dtypes, dispatch
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(small_tiles, dtype):
    q, k, v, dout = _inputs(dtype)
    # Same values through transposed and strided views.
    qn = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    kn = np.concatenate([k, k], axis=3)[..., ::2]
    kn[...] = k
    vn = np.asfortranarray(v)
    doutn = np.asfortranarray(dout)
    assert not (qn.flags.c_contiguous or kn.flags.c_contiguous or vn.flags.c_contiguous)
    mask = np.asfortranarray(_MASK_NM)
    opts = dict(causal=True, nvm=True, tau=0.7, mask=mask[None, None])
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
    outn, lsen = enp.attention(qn, kn, vn, return_lse=True, backend="cpu", **opts)
    np.testing.assert_array_equal(out, outn)
    np.testing.assert_array_equal(lse, lsen)
    g = enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", **opts)
    gn = enp.attention_backward(
        doutn, qn, kn, vn, np.asfortranarray(outn), lsen[..., ::-1][..., ::-1], backend="cpu", **opts
    )
    for field in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(g, field), getattr(gn, field))
    assert g.dtau == gn.dtau and g.dbeta == gn.dbeta


@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_unmodified_and_deterministic(small_tiles, dtype):
    q, k, v, dout = _inputs(dtype)
    mask = _MASK_B1NM.copy()
    sigma = _SIGMA_BH.copy()
    tau = np.array([0.5, 1.0, 2.0, 0.8])
    beta = np.array([0.0, 0.3, 1.0, 2.5])
    lengths = np.array([20, 29])
    opts = dict(
        causal=True, kv_lengths=lengths, mask=mask, nvm=True, tau=tau, beta=beta,
        dynamic_window=enp.DynamicWindow(sigma, sharpness=3.0, threshold=0.05),
    )
    inputs = (q, k, v, dout, mask, sigma, tau, beta, lengths)
    check_unmodified_and_deterministic(q, k, v, dout, opts, inputs, "dsigma")


def check_unmodified_and_deterministic(q, k, v, dout, opts, inputs, grad_field):
    """Forward and backward leave ``inputs`` (and ``out``, ``lse``) alone and give the
    same bits with all threads and with one: out, lse, dq, dk, dv, dtau, dbeta and ``grad_field``.
    """
    copies = [a.copy() for a in inputs]

    def run():
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", **opts)
        lse_in, out_in = lse.copy(), out.copy()
        g = enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", **opts)
        np.testing.assert_array_equal(out, out_in)
        np.testing.assert_array_equal(lse, lse_in)
        return out, lse, g

    first = run()
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        second = run()
    finally:
        numba.set_num_threads(threads)
    for a, b in zip(inputs, copies):
        np.testing.assert_array_equal(a, b)
    # Same bits, whatever the thread count.
    np.testing.assert_array_equal(first[0], second[0])
    np.testing.assert_array_equal(first[1], second[1])
    for field in ("dq", "dk", "dv", "dtau", "dbeta", grad_field):
        np.testing.assert_array_equal(getattr(first[2], field), getattr(second[2], field))


def test_dtype_errors():
    q, k, v, dout = _inputs(np.float32)
    with pytest.raises(TypeError, match="`q` has dtype float16"):
        enp.attention(q.astype(np.float16), k, v, backend="cpu")
    with pytest.raises(TypeError, match="share one dtype"):
        enp.attention(q, k.astype(np.float64), v, backend="cpu")
    with pytest.raises(TypeError, match="`k`"):
        enp.attention(q, k.astype(np.int32), v, backend="cpu")
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu")
    with pytest.raises(TypeError, match="`dout` has dtype float64"):
        enp.attention_backward(dout.astype(np.float64), q, k, v, out, lse, backend="cpu")
    with pytest.raises(TypeError, match="`lse` has dtype float64"):
        enp.attention_backward(dout, q, k, v, out, lse.astype(np.float64), backend="cpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_dtype_follows_input(dtype):
    q, k, v, _ = _inputs(dtype, N=5, M=7)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu")
    assert out.dtype == dtype and lse.dtype == dtype


def test_auto_backend_without_gpu():
    if _dispatch._cuda_is_available():
        pytest.skip("a GPU is usable here, so 'auto' picks cuda")
    assert _dispatch.get_backend("auto") is cpu
    q, k, v, _ = _inputs(np.float32, N=5, M=7)
    np.testing.assert_array_equal(
        enp.attention(q, k, v, backend="auto"), enp.attention(q, k, v, backend="cpu")
    )


def test_is_available():
    assert cpu.is_available()
    cpu.check_available()
    assert np.dtype(np.float32) in cpu.dtypes and np.dtype(np.float64) in cpu.dtypes


def test_one_compiled_kernel_per_dtype():
    """Read-only, strided and broadcast inputs and masks reuse the same compiled kernels."""
    for dtype in (np.float32, np.float64):
        q, k, v = (a.astype(dtype) for a in _bench.make_inputs(1, 2, 9, 11, 4, seed=3))
        for a in (q, k, v):
            a.setflags(write=False)
        mask = np.broadcast_to(np.random.default_rng(0).random((9, 11)) < 0.8, (1, 2, 9, 11))
        for options in ({}, {"mask": mask}, {"mask": np.ones((9, 11), bool)}):
            out, lse = enp.attention(q, k[..., ::1], v, return_lse=True, backend="cpu", **options)
            out.setflags(write=False)
            enp.attention_backward(out, q, k, v, out, lse, backend="cpu", **options)
    for kernel in (cpu._forward_kernel, cpu._backward_prepare, cpu._backward_kernel, cpu._sum_dq_shares):
        assert len(kernel.signatures) <= 2, kernel.signatures


# ---------------------------------------------------------------------------
# Score modifiers: bias shapes, dtypes, reductions, no copies
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_name", ["full", "nm", "1h1m-keypad", "bhn1", "scalar"])
def test_bias_other_dtype(small_tiles, dtype, bias_name):
    # a float32 bias with float64 q and a float64 bias with float32 q
    other = np.float32 if dtype == np.float64 else np.float64
    bias = BIASES[bias_name].astype(other)
    _, _, grads = check_case(dtype, dict(bias=bias, softcap=2.0, alibi_slopes=_ALIBI_H))
    assert grads.dbias.shape == bias.shape and grads.dbias.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,bias_shape",
    [
        (dict(N=1, M=31), (1, 31)),
        (dict(N=1, M=31), (2, 4, 1, 1)),
        (dict(N=23, M=1), (2, 4, 23, 1)),
        (dict(N=23, M=1), (1,)),
        (dict(N=1, M=1), (2, 1, 1, 1)),
        (dict(N=31, M=12), (4, 31, 12)),
        (dict(B=1, H=3, Hkv=1, N=17, M=9), (3, 1, 9)),
    ],
)
def test_modifiers_degenerate_lengths(small_tiles, dtype, shape, bias_shape):
    H = shape.get("H", 4)
    opts = dict(
        bias=_bias(bias_shape, 11, pad=0.1), softcap=1.2, alibi_slopes=np.linspace(0.1, 0.4, H),
        causal=True, beta=0.3,
    )
    check_case(dtype, opts, **shape)


@pytest.mark.parametrize(
    "dtype,opts",
    [
        (np.float64, dict(softcap=5.0, alibi_slopes=[0.01, 0.002], causal=True, tau=0.8)),
        (np.float32, dict(softcap=2.0, bias=_bias((2, 97, 1025), 12, pad=0.05), beta=0.2)),
        (np.float64, dict(bias=_bias((1, 2, 1, 1025), 13, pad=0.2), nvm=True, kv_lengths=[1000])),
        (np.float32, dict(bias=_bias((97, 1), 14), window_size=(300, 40))),
        # whole 8 x 8 float64 blocks through registers, and the edges
        (np.float64, dict(bias=_bias((1, 2, 97, 1025), 15, pad=0.05), causal=True)),
        # an (N, M) bias: dbias summed over the heads through transposed blocks
        (np.float32, dict(bias=_bias((97, 1025), 16), softcap=3.0)),
        (np.float64, dict(bias=_bias((97, 1025), 17, pad=0.05), beta=0.5)),
    ],
)
def test_modifiers_default_tiles_odd_sizes(dtype, opts):
    check_case(dtype, opts, B=1, H=2, Hkv=1, N=97, M=1025, D=59, Dv=59)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_name", ["nm", "bhn1", "b1n1", "scalar", "1hnm"])
@pytest.mark.parametrize(
    "min_tasks,partial_bytes,pair_batch",
    # lanes of one pair; one lane in batches of 4 (all), 3 (then 1) and 1 pair
    [(10**6, 1 << 25, 8), (1, 1 << 25, 8), (1, 1 << 25, 3), (10**6, 1, 1)],
)
def test_dbias_lanes_and_chunks(
    small_tiles, monkeypatch, dtype, bias_name, min_tasks, partial_bytes, pair_batch
):
    # one key tile per chunk of dq shares
    monkeypatch.setattr(cpu, "DQ_SHARES_BYTES", 1)
    monkeypatch.setattr(cpu, "DBIAS_MIN_TASKS", min_tasks)
    monkeypatch.setattr(cpu, "DBIAS_PARTIALS_BYTES", partial_bytes)
    monkeypatch.setattr(cpu, "DBIAS_PAIR_BATCH", pair_batch)
    check_case(dtype, dict(bias=BIASES[bias_name], softcap=1.5, causal=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pair_batch", [8, 3])
def test_dbias_summed_over_heads_with_their_own_ranges(small_tiles, monkeypatch, dtype, pair_batch):
    # a task's heads visit different query tiles (a gate per head, lengths
    # per batch) and some tiles none: the sum over heads and its write-out
    monkeypatch.setattr(cpu, "DBIAS_MIN_TASKS", 1)
    monkeypatch.setattr(cpu, "DBIAS_PAIR_BATCH", pair_batch)
    sigma = np.array([[0.05, 0.5, 0.1, 1.2], [0.6, 0.08, 0.4, 2.0]])
    opts = dict(
        bias=BIASES["nm"], kv_lengths=[9, 31], nvm=True, tau=[0.5, 1.0, 2.0, 0.8],
        dynamic_window=enp.DynamicWindow(sigma, sharpness=3.0, threshold=0.3),
    )
    check_case(dtype, opts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["full", "nm"])
def test_dbias_streamed_on_cache_lines(monkeypatch, dtype, layout):
    # 48 keys, whole cache lines in both dtypes: the rows of dbias start on
    # lines and `_store_transposed` streams them (per head; and the sum over
    # heads, one lane in one batch), the 37 queries leave edges to it
    monkeypatch.setattr(cpu, "DBIAS_MIN_TASKS", 1)
    bias = _bias((2, 4, 37, 48), 11) if layout == "full" else _bias((37, 48), 12)
    check_case(dtype, dict(bias=bias, causal=True, kv_lengths=[48, 29]), N=37, M=48)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("on_lines", [True, False])
def test_store_transposed_on_and_off_cache_lines(dtype, on_lines):
    # runs starting on cache lines are streamed, others stored: the same entries
    line = stream_width(dtype)
    bk, bq, stride = 2 * line + 3, 21, 3 * line
    tile = np.random.default_rng(7).standard_normal((bk + 1, bq + 2)).astype(dtype)
    dst = cpu._zeros_on_lines(bq * stride + 2 * line, dtype)
    assert dst.ctypes.data % 64 == 0
    dst[:] = np.nan
    start = line if on_lines else line + 1
    cpu._store_transposed(tile, bk, bq, dst, start, stride, dtype(0.5))
    view = dst[start : start + bq * stride].reshape(bq, stride)
    np.testing.assert_array_equal(view[:, :bk], dtype(0.5) * tile[:bk, :bq].T)
    assert np.isnan(view[:, bk:]).all() and np.isnan(dst[:start]).all()  # nothing else written
    assert np.isnan(dst[start + bq * stride :]).all()


def test_dbias_plan_lanes(monkeypatch):
    # broadcast over (b, h): folded pairs split into lanes by DBIAS_MIN_TASKS and memory
    q, k, v, _ = _inputs(np.float64)  # B=2, H=4, Hkv=2, N=23, M=31
    p = _options.prepare(q, k, v, bias=BIASES["nm"], dtypes=cpu.dtypes)
    plan = cpu._DbiasPlan(p, np.dtype(np.float64), n_kt=1, chunk=1)
    assert plan.params.tolist() == [2, 1, 1, 4, 1, 1]
    assert plan.shape == (1, 1, 23, 31) and plan.partials.shape == (4, 23 * 31)
    # one lane, its 4 pairs in one batch: the sums go straight to `direct`
    plan = cpu._DbiasPlan(p, np.dtype(np.float32), n_kt=64, chunk=8)
    assert plan.params.tolist() == [3, 1, 1, 1, 1, 4]
    assert plan.direct.shape == (23 * 31,) and plan.direct.dtype == np.float32
    monkeypatch.setattr(cpu, "DBIAS_PAIR_BATCH", 3)
    plan = cpu._DbiasPlan(p, np.dtype(np.float64), n_kt=64, chunk=8)
    assert plan.params.tolist() == [2, 1, 1, 1, 1, 3] and plan.partials.shape == (1, 23 * 31)
    p = _options.prepare(q, k, v, bias=BIASES["full"], dtypes=cpu.dtypes)
    plan = cpu._DbiasPlan(p, np.dtype(np.float64), n_kt=7, chunk=7)
    assert plan.params[0] == 1 and plan.direct.shape == (2 * 4 * 23 * 31,)
    p = _options.prepare(q, k, v, bias=BIASES["bhn1"], dtypes=cpu.dtypes)
    plan = cpu._DbiasPlan(p, np.dtype(np.float64), n_kt=7, chunk=3)
    assert plan.params.tolist() == [2, 0, 0, 1, 3, 1] and plan.partials.shape == (3, 2 * 4 * 23)


def test_reduce_to_shape_sums_only_axes_longer_than_one():
    # dbias computed in its compact (1, 1, N, M) shape comes back as a view:
    # no pass over it to "sum" axes of length 1
    grad = np.arange(2 * 3 * 4, dtype=np.float32).reshape(1, 1, 6, 4)
    out = _options.reduce_to_shape(grad, (6, 4))
    assert out.shape == (6, 4) and out.dtype == np.float32 and np.shares_memory(out, grad)
    full = np.arange(2 * 3 * 6 * 4, dtype=np.float64).reshape(2, 3, 6, 4)
    for shape in [(6, 4), (3, 1, 4), (1, 6, 1), (2, 1, 1, 1), ()]:
        lead = full.ndim - len(shape)
        axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1)
        want = full.sum(axis=axes, keepdims=True).reshape(shape)
        np.testing.assert_array_equal(_options.reduce_to_shape(full, shape), want)


def test_every_jit_function_states_its_fastmath():
    # Numba compiles a function without its own `fastmath` with the flags of
    # whatever compiles it first and keeps that version: the tile code took the
    # forward kernel's flags, or none when a backward (or a call from Python)
    # came first, and the kernels' last bits changed with the order (measured:
    # 488 of 1104 float32 entries of `out`). Inlined functions take their caller's.
    jitted = {
        name: f for name, f in vars(cpu).items()
        if isinstance(f, numba.core.registry.CPUDispatcher) and f.py_func.__module__ == cpu.__name__
    }
    assert len(jitted) > 20
    for name, f in jitted.items():
        assert "fastmath" in f.targetoptions or f.targetoptions.get("inline") == "always", name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", _LAYOUTS)
def test_bias_not_copied(dtype, layout):
    # The kernels read the caller's memory at its strides; only negative
    # strides (or another dtype, below) make a copy. Never written.
    q, k, v, _ = _inputs(dtype)
    for name in ("full", "nm", "1h1m-keypad", "bhn1"):
        bias = _laid_out(BIASES[name].astype(dtype), layout)
        p = _options.prepare(q, k, v, bias=bias, dtypes=cpu.dtypes)
        opt = cpu._options(p, with_sigma_grad=True, dtype=np.dtype(dtype))
        assert np.shares_memory(opt.bias, bias) == (layout != "reversed" or bias.shape[-1] == 1)
        assert not opt.bias.flags.writeable
        # the same entries through the strides
        b_, h_, i_, j_ = (np.arange(n)[:, None, None, None] for n in (2, 4, 23, 31))
        idx = (b_ * opt.bias_strides[0] + np.swapaxes(h_, 0, 1) * opt.bias_strides[1]
               + np.moveaxis(i_, 0, 2) * opt.bias_strides[2] + np.moveaxis(j_, 0, 3) * opt.bias_strides[3])
        np.testing.assert_array_equal(opt.bias[idx], np.broadcast_to(bias, (2, 4, 23, 31)))
    # another dtype is converted into a copy, never the caller's array written
    other = BIASES["nm"].astype(np.float32 if dtype == np.float64 else np.float64)
    opt = cpu._options(_options.prepare(q, k, v, bias=other, dtypes=cpu.dtypes), False, np.dtype(dtype))
    assert opt.bias.dtype == dtype and not np.shares_memory(opt.bias, other)
    np.testing.assert_array_equal(opt.bias.reshape(23, 31), other.astype(dtype))


# Options that skip tiles: the kernels never read those entries for the
# attention, yet a NaN or +inf there must raise as the reference's check does.
_SKIPPING = {
    "causal-kv-lengths": dict(causal=True, kv_lengths=[17, 31]),
    "window": dict(window_size=(3, 1)),
    "mask-none-kept": dict(mask=np.zeros((23, 31), bool)),
    "plain": {},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "bias_name", ["full", "nm", "1h1m-keypad", "bhn1", "b1n1", "scalar", "fortran", "full-mT", "nm-mT"]
)
@pytest.mark.parametrize("skipping", list(_SKIPPING))
def test_bias_values_checked_by_the_kernels(small_tiles, dtype, bias_name, skipping):
    """NaN or +inf anywhere in the bias raises, forward and backward; -inf does not.

    ``cpu.prepare`` leaves the check to the kernels, which count the bad
    entries as they read the bias (also in the tiles a mask skips). Every
    entry of the caller's array is tried, or 24 of them at random and the
    corners.
    """
    q, k, v, dout = _inputs(dtype)
    opts = _SKIPPING[skipping]
    if bias_name == "fortran":
        base = np.asfortranarray(BIASES["full"])
    elif bias_name.endswith("-mT"):  # queries contiguous
        base = _laid_out(BIASES[bias_name[:-3]], "queries-contiguous")
    else:
        base = BIASES[bias_name]
    base = np.array(base, dtype=dtype, order="K")
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", bias=base, **opts)
    rng = np.random.default_rng(len(bias_name) * 7 + len(skipping))
    flat = list(range(base.size))
    if base.size > 30:
        flat = [0, base.size - 1] + list(rng.choice(base.size, 24, replace=False))
    for n, at in enumerate(flat):
        bad_value = (np.nan, np.inf)[n % 2]
        for value, raises in ((bad_value, True), (-np.inf, False)):
            bias = base.copy(order="K")
            bias[np.unravel_index(at, bias.shape)] = value
            problem = cpu.prepare(q, k, v, bias=bias, dtypes=cpu.dtypes, **opts)
            assert problem.bias_unchecked  # not checked before the kernels
            if raises:
                with pytest.raises(ValueError, match="`bias` contains NaN or \\+inf"):
                    cpu.forward(problem)
                with pytest.raises(ValueError, match="`bias` contains NaN or \\+inf"):
                    cpu.backward(problem, dout, out, lse)
            else:
                cpu.forward(problem)
                cpu.backward(problem, dout, out, lse)


def test_bias_values_checked_before_conversion():
    # a float64 bias beyond the float32 range is finite: the float32 kernels
    # convert it, so its values are checked on the caller's array, before
    q, k, v, _ = _inputs(np.float32)
    bias = np.zeros((23, 31))
    bias[3, 4] = np.nan
    problem = cpu.prepare(q, k, v, bias=bias, dtypes=cpu.dtypes)
    with pytest.raises(ValueError, match="`bias` contains NaN"):
        cpu.forward(problem)
    bias[3, 4] = 1e300
    problem = cpu.prepare(q, k, v, bias=bias, dtypes=cpu.dtypes)
    with pytest.raises(ValueError, match="`bias` has finite entries beyond the range of float32"):
        cpu.forward(problem)
    bias[3, 4] = -1e300  # -inf once converted: removes the entry, as a float32 score would
    problem = cpu.prepare(q, k, v, bias=bias, dtypes=cpu.dtypes)
    assert not cpu._options(problem, False, np.dtype(np.float32)).check_bias
    # no check at all when the caller asks for none
    bias[3, 4] = np.nan
    problem = cpu.prepare(q, k, v, bias=bias, dtypes=cpu.dtypes, check_finite=False)
    assert not problem.bias_unchecked
    assert not cpu._options(problem, False, np.dtype(np.float32)).check_bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_name", ["full", "nm", "b11m-keypad", "bhn1", "scalar"])
def test_modifiers_inputs_unmodified_and_deterministic(small_tiles, monkeypatch, dtype, bias_name):
    monkeypatch.setattr(cpu, "DQ_SHARES_BYTES", 4000)  # a few chunks of key tiles
    q, k, v, dout = _inputs(dtype)
    bias = BIASES[bias_name].astype(dtype)
    slopes = _ALIBI_BH.copy()
    opts = dict(bias=bias, alibi_slopes=slopes, softcap=1.5, causal=True, tau=0.7, nvm=True)
    inputs = (q, k, v, dout, bias, slopes)
    check_unmodified_and_deterministic(q, k, v, dout, opts, inputs, "dbias")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "opts,fused",
    [
        (dict(softcap=0.7), True),
        (dict(softcap=0.7, nvm=True), True),
        (dict(softcap=0.7, kv_lengths=[31, 25]), True),  # kv_lengths only shortens the tile
        (dict(softcap=0.7, mask=_MASK_NM), False),
        (dict(softcap=0.7, window_size=(2, 2)), False),
        (dict(softcap=0.7, nvm=True, dynamic_window=enp.DynamicWindow(0.8, sharpness=3.0)), False),
        (dict(softcap=0.7, alibi_slopes=_ALIBI_H), False),
        (dict(softcap=0.7, bias=BIASES["full"]), False),
        (dict(bias=BIASES["full"]), True),
        (dict(bias=BIASES["full"], nvm=True), False),  # under NVM the product comes first
        (dict(alibi_slopes=_ALIBI_BH, bias=BIASES["nm"]), True),
        (dict(bias=BIASES["nm"], tau=[0.5, 1.0, 3.0, 0.8]), True),
        (dict(alibi_slopes=_ALIBI_BH, bias=BIASES["nm"], tau=[0.5, 1.0, 3.0, 0.8]), True),
        (dict(alibi_slopes=_ALIBI_BH, bias=np.asfortranarray(BIASES["full"])), True),
        (dict(bias=BIASES["b11m-keypad"]), True),
        (dict(alibi_slopes=_ALIBI_H, causal=True), False),
        (dict(bias=BIASES["bhn1"], mask=_MASK_NM), False),
    ],
)
def test_logits_tile_maxima_with_the_product(dtype, opts, fused):
    # Where nothing is removed and no modifier follows the soft-cap, the
    # forward takes a tile's column maxima with the product (capped after the
    # soft-cap: tanh is increasing): the same logits bits and the maxima of
    # a separate pass. Elsewhere the maxima are left to the caller. A bias
    # along the keys given as a key-major tile (`bias_t`) gives the same bits.
    q, k, v, _ = _inputs(dtype)
    p = _options.prepare(q, k, v, dtypes=cpu.dtypes, **opts)
    opt = cpu._options(p, with_sigma_grad=False, dtype=np.dtype(dtype))
    b, h, hk, N, M, D = 1, 2, 1, 23, 31, 8
    i0, bq, j0, bk = 8, 12, 5, 20
    bk = min(bk, int(opt.kv_lengths[b]) - j0)
    off_lo, off_hi = cpu._offset_range(opt, b, h, N, M)
    nvm_in_logits = opt.nvm and opt.has_gate
    nonneg = opt.nvm and not opt.has_gate
    q_t = np.zeros((D, 16), dtype)
    q_t[:, :bq] = (q[b, h, i0 : i0 + bq] * (opt.scale / opt.tau[h])).T
    k_j = np.ascontiguousarray(k[b, hk, j0 : j0 + bk])
    no_slope = np.empty((0, 0), dtype)

    def logits(want_max, bias_t=no_slope):
        st = np.full((bk + 1, 16), np.nan, dtype)
        tile_max = np.full(16 if want_max else 0, -np.inf, dtype)  # empty: no maxima wanted
        kept, maxed, clean = cpu._logits_tile(
            st, k_j, q_t, D, opt, b, h, i0, bq, j0, bk, N, M, off_lo, off_hi, nvm_in_logits,
            no_slope, tile_max, nonneg, bias_t,
        )
        assert kept
        # checked as read (no NaN or +inf here): a bias along the keys read through
        # the transposes, a bias contiguous or constant along the queries row by row
        along_keys = opt.bias_strides[3] == 1 and opt.bias_strides[2] > 1
        by_rows = opt.bias_strides[2] <= 1
        assert clean == (not opt.has_bias or (along_keys and bias_t.size == 0) or by_rows)
        return st, tile_max, maxed

    st, tile_max, maxed = logits(True)
    st_plain, _, maxed_plain = logits(False)
    assert maxed == fused and not maxed_plain
    np.testing.assert_array_equal(st, st_plain)
    assert np.isnan(st[bk:]).all() and np.isnan(st[:, bq:]).all()
    if opt.has_bias and opt.bias_strides[3] == 1 and opt.bias_strides[2] > 1:
        bias_t = np.full((bk + 1, 16), np.nan, dtype)
        full = np.broadcast_to(opts["bias"], (2, 4, N, M))
        bias_t[:bk, :bq] = full[b, h, i0 : i0 + bq, j0 : j0 + bk].T
        np.testing.assert_array_equal(logits(False, bias_t)[0], st_plain)
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
    cpu._column_max(st, bk, bq, col_max, nonneg)
    np.testing.assert_array_equal(col_max, expected)
    np.testing.assert_array_equal(np.signbit(col_max), np.signbit(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_large_is_plain(small_tiles, dtype):
    # tanh(x / cap) cap -> x: a huge cap is the plain attention to rounding
    q, k, v, dout = _inputs(dtype)
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
    for kernel in (cpu._forward_kernel, cpu._backward_prepare, cpu._backward_kernel, cpu._sum_dq_shares):
        assert len(kernel.signatures) <= 2, kernel.signatures


def test_concurrent_calls_from_python_threads_agree_with_sequential_ones():
    """Calls from several Python threads share the kernels' thread pool safely."""
    import concurrent.futures

    problems = [_inputs(np.float32, seed=s) for s in range(4)]

    def run(inputs):
        q, k, v, dout = inputs
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cpu", causal=True)
        return out, enp.attention_backward(dout, q, k, v, out, lse, backend="cpu", causal=True).dq

    sequential = [run(p) for p in problems]
    with concurrent.futures.ThreadPoolExecutor(4) as callers:
        concurrent_results = list(callers.map(run, problems))
    for (out_a, dq_a), (out_b, dq_b) in zip(sequential, concurrent_results):
        np.testing.assert_array_equal(out_a, out_b)
        np.testing.assert_array_equal(dq_a, dq_b)


def _attention_cpu(q, k, v):
    return enp.attention(q, k, v, backend="cpu")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_the_kernels():
    """The thread pool does not survive a fork; the child makes its own (no hang)."""
    import multiprocessing
    import warnings

    q, k, v, _ = _inputs(np.float32)
    want = _attention_cpu(q, k, v)  # the parent's pool exists now
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
        with multiprocessing.get_context("fork").Pool(1) as pool:
            got = pool.apply_async(_attention_cpu, (q, k, v)).get(timeout=300)
    np.testing.assert_array_equal(got, want)


def test_a_smaller_pool_is_shut_down_when_more_threads_are_asked_for(monkeypatch):
    import concurrent.futures

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two Numba threads")
    small = concurrent.futures.ThreadPoolExecutor(1)
    small.submit(int).result()  # one idle worker thread
    monkeypatch.setattr(cpu, "_pool", (1, small))
    monkeypatch.setattr(cpu, "SERIAL_WORK", 0)
    q, k, v, _ = _inputs(np.float32)
    threads = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        np.testing.assert_array_equal(_attention_cpu(q, k, v), _attention_cpu(q, k, v))
    finally:
        numba.set_num_threads(threads)
    assert cpu._pool[0] == 2 and cpu._pool[1] is not small
    with pytest.raises(RuntimeError, match="shutdown"):
        small.submit(int)  # shut down, its thread gone


@pytest.mark.parametrize("N", [1, 20])  # the decode kernel and the prefill forward
def test_a_small_call_runs_on_the_calling_thread(monkeypatch, N):
    """Below `cpu.SERIAL_WORK` the pool is not used (handing work to it costs more)."""
    monkeypatch.setattr(cpu, "_pool", None)
    monkeypatch.setattr(cpu, "thread_count", lambda: 2)
    q, k, v, _ = _inputs(np.float32, N=N)
    want = _attention_cpu(q, k, v)
    assert cpu._pool is None
    monkeypatch.setattr(cpu, "SERIAL_WORK", 0)
    np.testing.assert_array_equal(_attention_cpu(q, k, v), want)
    assert cpu._pool is not None


def test_kernels_do_not_launch_numbas_threading_layer():
    """Launching it can load a second OpenMP runtime beside another library's (PyTorch's)."""
    code = textwrap.dedent(
        """
        import numba, numba.np.ufunc.parallel as parallel, numpy as np
        import elastic_np as enp
        from elastic_np import cpu
        q = np.ones((1, 2, 3, 4), np.float32)
        enp.attention(q, q, q, backend="cpu")
        enp.attention(q[:, :, :1], q, q, backend="cpu")  # the decode kernel
        assert not parallel._is_initialized, "launched"
        assert cpu.thread_count() == numba.config.NUMBA_NUM_THREADS
        numba.set_num_threads(1)  # the user's setting launches it, and is followed
        assert cpu.thread_count() == 1
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
