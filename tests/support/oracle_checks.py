"""Shared checks of a backend against the float64 oracle, and the table of option cases.

`assert_matches_oracle` is the accuracy rule of the kernel tests;
`check_case` runs one option set through a backend (``"cpu"`` by default)
and checks every output with it. `CASES` holds the option sets every kernel
is held to; `BIASES` the bias shapes of its ``(2, 4, 23, 31)`` problem;
`decode_cases` the option sets of the decode kernels' shapes.
"""

import numba
import numpy as np

import elastic_np as enp
from elastic_np import reference
from elastic_np.testing import _tolerances

DTYPES = [np.float64, np.float32]


def make_inputs(dtype, B=2, H=4, Hkv=2, N=23, M=31, D=8, Dv=6, seed=0):
    """Seeded standard normal ``q, k, v, dout`` of the given sizes in ``dtype``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, N, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, M, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, M, Dv)).astype(dtype)
    dout = rng.standard_normal((B, H, N, Dv)).astype(dtype)
    return q, k, v, dout


def assert_matches_oracle(name, result, oracle, dtype, naive=None, rounding=None):
    """Check shape and dtype, then the accuracy rule; print the worst difference.

    float64: ``max|result - oracle| <= 1e-12 * max(1, max|oracle|)``.
    float32: `elastic_np.testing._tolerances.float32_allowed`, twice the worst error of
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
    bound, naive_err = _tolerances.float32_allowed(oracle, naive, rounding)
    print(f"{name}: worst |diff| {err:.3e}, naive float32 {naive_err:.3e} (bound {bound:.1e})")
    assert err <= bound, f"{name}: worst |diff| {err:.3e} > {bound:.3e} (naive {naive_err:.3e})"


def make_dlse(dtype, q, seed=0):
    """A seeded standard normal cotangent of ``lse`` for ``q``'s ``(B, H, N)``."""
    return np.random.default_rng(seed + 1000).standard_normal(q.shape[:3]).astype(dtype)


def check_case(dtype, opts, seed=0, backend="cpu", with_lse=False, **shape):
    """Forward and backward of a kernel backend against the oracle, for one option set.

    ``with_lse``: the backward also takes a random cotangent of ``lse`` (`make_dlse`).
    """
    q, k, v, dout = make_inputs(dtype, seed=seed, **shape)
    dlse = make_dlse(dtype, q, seed) if with_lse else None
    out, lse = enp.attention(q, k, v, return_lse=True, backend=backend, **opts)
    grads = enp.attention_backward(dout, q, k, v, out, lse, dlse=dlse, backend=backend, **opts)
    check_results(dtype, q, k, v, dout, opts, out, lse, grads, dlse=dlse)
    return out, lse, grads


def oracle(q, k, v, dout, opts, dlse=None):
    """The float64 oracle's ``(out, lse, grads)`` on the inputs converted to float64."""
    q, k, v, dout = (a.astype(np.float64) for a in (q, k, v, dout))
    out, lse = reference.attention(q, k, v, **opts)
    with np.errstate(all="ignore"):
        grads = reference.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **opts)
    return out, lse, grads


def check_results(dtype, q, k, v, dout, opts, out, lse, grads, dlse=None, rounding=None):
    """``out``, ``lse`` and every gradient against the oracle by `assert_matches_oracle`.

    float32 results get the naive float32 evaluations and the summation
    allowance of the conformance kit as their yardstick; ``rounding`` maps
    fields to a rounding allowance of their own (a sum of float32 partials).
    ``dlse`` is the cotangent of ``lse`` the backward was given, if any.
    """
    ref_out, ref_lse, ref_grads = oracle(q, k, v, dout, opts, dlse)

    naive, summation = {}, dict(rounding or {})
    if dtype == np.float32:
        orderings = _tolerances.naive_orderings(q, k, v, dout, opts, np.float32, dlse=dlse)
        naive = {name: [n[name] for n in orderings] for name in orderings[0]}
        summation = {**_tolerances.rounding_allowance(q, k, v, dout, opts, dlse=dlse), **summation}
    assert_matches_oracle("out", out, ref_out, dtype, naive.get("out"))
    assert_matches_oracle("lse", lse, ref_lse, dtype, naive.get("lse"))
    for field in ("dq", "dk", "dv", "dtau", "dbeta", "dsigma", "dbias"):
        got, want = getattr(grads, field), getattr(ref_grads, field)
        if want is None:
            assert got is None, field
            continue
        assert np.shape(got) == np.shape(want), field
        if np.shape(want) == ():
            assert isinstance(got, float), f"{field} should be a Python float"
        assert_matches_oracle(field, got, want, dtype, naive.get(field), summation.get(field))


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



_RNG = np.random.default_rng(42)
MASK_NM = _RNG.random((23, 31)) > 0.3
MASK_B1NM = _RNG.random((2, 1, 23, 31)) > 0.4
SIGMA_BH = np.array([[0.3, 0.5, 0.8, 1.2], [0.6, 0.25, 0.4, 2.0]])
ALIBI_H = np.array([0.5, 0.25, 0.125, 0.0625])
ALIBI_BH = np.array([[0.3, 0.05, 0.0, 0.2], [0.1, 0.4, 0.02, 0.07]])


def random_bias(shape, seed=0, pad=0.0):
    """A random bias of ``shape``; a fraction ``pad`` of its entries is ``-inf``."""
    rng = np.random.default_rng(seed)
    bias = rng.standard_normal(shape)
    return np.where(rng.random(shape) < pad, -np.inf, bias)


# Bias shapes for (B, H, N, M) = (2, 4, 23, 31): every pattern of broadcasting.
BIASES = {
    "full": random_bias((2, 4, 23, 31), 1),
    "nm": random_bias((23, 31), 2),
    "1h1m-keypad": random_bias((1, 4, 1, 31), 3, pad=0.25),
    "b11m-keypad": random_bias((2, 1, 1, 31), 4, pad=0.3),
    "bhn1": random_bias((2, 4, 23, 1), 5),
    "b1n1": random_bias((2, 1, 23, 1), 6),
    "scalar": np.array([0.7]),
    "full-some-inf": random_bias((2, 4, 23, 31), 7, pad=0.1),
    "1hnm": random_bias((1, 4, 23, 31), 8),
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
    "mask-nm": dict(mask=MASK_NM),
    "mask-b1nm": dict(mask=MASK_B1NM),
    "nvm": dict(nvm=True),
    "tau-beta-scalar": dict(tau=0.7, beta=0.5),
    "tau-beta-per-head": dict(tau=[0.5, 1.0, 2.0, 0.8], beta=[0.0, 0.3, 1.0, 2.5]),
    "elastic": dict(nvm=True, tau=[0.5, 1.0, 2.0, 0.8], beta=[0.0, 0.3, 1.0, 2.5]),
    "window-gate": dict(dynamic_window=enp.DynamicWindow(0.4, sharpness=3.0, threshold=0.2)),
    "window-gate-zero-threshold": dict(dynamic_window=enp.DynamicWindow(SIGMA_BH, sharpness=2.0)),
    "window-gate-per-batch": dict(
        dynamic_window=enp.DynamicWindow([[0.3], [0.7]], sharpness=5.0, threshold=0.1)
    ),
    "everything": dict(
        causal=True, window_size=(12, -1), kv_lengths=[20, 29], mask=MASK_B1NM, nvm=True,
        tau=[0.5, 1.0, 2.0, 0.8], beta=[0.0, 0.3, 1.0, 2.5],
        dynamic_window=enp.DynamicWindow(SIGMA_BH, sharpness=3.0, threshold=0.05),
    ),
    # score modifiers, alone and with the other options
    "softcap": dict(softcap=1.5),
    "softcap-tight": dict(softcap=0.2, scale=2.0),
    "alibi-h": dict(alibi_slopes=ALIBI_H),
    "alibi-bh": dict(alibi_slopes=ALIBI_BH),
    "softcap-causal": dict(softcap=0.8, causal=True),
    "softcap-window": dict(softcap=1.0, window_size=(5, 3)),
    "softcap-nvm": dict(softcap=1.2, nvm=True),
    "softcap-tau-beta": dict(softcap=0.9, tau=[0.5, 1.0, 2.0, 0.8], beta=[0.0, 0.3, 1.0, 2.5]),
    "softcap-mask": dict(softcap=1.5, mask=MASK_NM),
    "softcap-alibi": dict(softcap=1.5, alibi_slopes=ALIBI_H),
    "softcap-nvm-window": dict(softcap=0.9, nvm=True, window_size=(7, 2)),
    "alibi-causal": dict(alibi_slopes=ALIBI_H, causal=True),
    "alibi-window": dict(alibi_slopes=ALIBI_BH, window_size=(4, -1)),
    "alibi-nvm-tau": dict(alibi_slopes=[0.05, 0.1, 0.0, 0.02], nvm=True, tau=[0.5, 1.0, 2.0, 0.8]),
    "alibi-beta": dict(alibi_slopes=ALIBI_H, beta=0.6),
    "bias-nvm": dict(bias=BIASES["nm"], nvm=True),
    "bias-causal": dict(bias=BIASES["full"], causal=True),
    "bias-window-tau-beta": dict(
        bias=BIASES["1h1m-keypad"], window_size=(6, 2), tau=[0.5, 1.0, 2.0, 0.8], beta=0.4
    ),
    "bias-keypad-causal": dict(bias=BIASES["b11m-keypad"], causal=True),
    "bias-fortran-order": dict(bias=np.asfortranarray(BIASES["full"])),
    "alibi-bias-nvm": dict(alibi_slopes=ALIBI_BH, bias=BIASES["full"], nvm=True),
    "alibi-bias-mask": dict(alibi_slopes=ALIBI_H, bias=BIASES["bhn1"], mask=MASK_B1NM),
    "alibi-bias-fortran-window": dict(
        alibi_slopes=ALIBI_H, bias=np.asfortranarray(BIASES["full-some-inf"]), window_size=(5, 3)
    ),
    "bias-gate": dict(
        bias=BIASES["bhn1"], dynamic_window=enp.DynamicWindow(SIGMA_BH, sharpness=2.0)
    ),
    "modifiers-gate-nvm": dict(
        softcap=1.1, alibi_slopes=ALIBI_H, bias=BIASES["b11m-keypad"], nvm=True,
        dynamic_window=enp.DynamicWindow(0.6, sharpness=3.0, threshold=0.1),
    ),
    "modifiers-everything": dict(
        causal=True, window_size=(12, -1), kv_lengths=[20, 29], mask=MASK_B1NM, nvm=True,
        tau=[0.5, 1.0, 2.0, 0.8], beta=[0.0, 0.3, 1.0, 2.5],
        dynamic_window=enp.DynamicWindow(SIGMA_BH, sharpness=3.0, threshold=0.05),
        softcap=1.3, alibi_slopes=ALIBI_BH, bias=BIASES["full-some-inf"],
    ),
}
for _name, _bias_array in BIASES.items():
    CASES[f"bias-{_name}"] = dict(bias=_bias_array)



def laid_out(bias, layout):
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


LAYOUTS = ["C", "F", "queries-contiguous", "strided", "reversed"]


def holds_user_variant(signature):
    """Whether a kernel's signature holds a user's functions (`elastic_np.cpu._tiles.variant`: a compile each)."""
    return "KernelVariant" in str(signature)


def holds_half_bits(types):
    """Whether a signature holds an array of stored bits, a half's (uint16 or int16) or a quantized cache's
    (int8 or uint8), at any depth of its tuples: the specialisations of the other storage dtypes."""
    return any(holds_half_bits(ty.types) if hasattr(ty, "types") else _stored_bits(str(getattr(ty, "dtype", "")))
               for ty in types)


def _stored_bits(dtype):
    """Whether a Numba dtype's name is that of stored bits: a half's integers, int8, or a float8's record."""
    return dtype in ("uint16", "int16", "int8", "uint8") or dtype.startswith("Record(")


def decode_cases(B, H, N, M, seed=0):
    """Every option alone and combined, with arrays shaped for ``(B, H, N, M)``: the decode kernels' cases
    (``test_decode``, ``test_lse_gradient``)."""
    rng = np.random.default_rng(seed)
    tau = rng.uniform(0.4, 2.0, H)
    beta = rng.uniform(0.0, 2.0, H)
    lengths = rng.integers(0, M + 1, B)
    lengths[0] = M
    mask = rng.random((B, 1, N, M)) > 0.3
    bias = rng.standard_normal((B, H, N, M))
    bias[rng.random((B, H, N, M)) < 0.1] = -np.inf
    window = enp.DynamicWindow(rng.uniform(0.2, 1.0, (B, H)), sharpness=3.0, threshold=0.05)
    slopes = rng.uniform(0.0, 0.3, (B, H))
    return {
        "plain": {},
        "causal": dict(causal=True),
        "window": dict(window_size=(5, 0), causal=True),
        "window-both": dict(window_size=(3, 2)),
        "kv-lengths": dict(kv_lengths=lengths),
        "mask": dict(mask=mask),
        "nvm-tau-beta": dict(nvm=True, tau=tau, beta=beta),
        "scale": dict(scale=0.3, nvm=True),
        "dynamic-window": dict(dynamic_window=window),
        "softcap": dict(softcap=0.7, scale=2.0),
        "alibi": dict(alibi_slopes=slopes, causal=True),
        "bias": dict(bias=bias, nvm=True, beta=0.5),
        "bias-keys": dict(bias=bias[:1, :1, :1], causal=True),
        "bias-fortran": dict(bias=np.asfortranarray(bias[0, 0])),
        "everything": dict(
            causal=True, window_size=(M // 2, -1), kv_lengths=lengths, mask=mask, nvm=True,
            tau=tau, beta=beta, dynamic_window=window, softcap=1.3, alibi_slopes=slopes, bias=bias,
        ),
    }
