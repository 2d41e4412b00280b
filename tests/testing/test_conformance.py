"""The conformance battery and `elastic_np.testing.check_attention`."""

import importlib.util

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import reference
from elastic_np._api import dispatch
from elastic_np._contract import _problem
from elastic_np.testing import _battery, _cases, _tolerances
from elastic_np.testing import backend_functions, check_attention

ALL = _cases.OPTION_NAMES + _cases.VARIANT_NAMES + _cases.CAPABILITIES
#: Without a user's variant's cases, whose CPU kernels compile per function (tests/variants/test_variant_kit.py
#: runs the CPU backend through one of them).
BUILT_IN = _cases.OPTION_NAMES + _cases.CAPABILITIES



def cpu_available():
    if importlib.util.find_spec("elastic_np.cpu") is None:
        return False
    try:
        dispatch.get_backend("cpu")
    except enp.BackendUnavailableError:
        return False
    return True


# ---------------------------------------------------------------------------
# Honest implementations pass
# ---------------------------------------------------------------------------


def test_reference_backend_passes_every_case():
    fn, backward = backend_functions("reference")
    report = check_attention(fn, backward=backward, options=ALL)
    assert report, str(report)
    assert report.skipped == []
    assert {row.case for row in report.rows} == {case.name for case in _cases.CASES}
    combined = {(r.dtype, r.quantity) for r in report.rows if r.case == "combined"}
    for dtype in ("float32", "float64"):
        for quantity in ("out", "lse", "dq", "dk", "dv", "dtau", "dbeta", "dsigma"):
            assert (dtype, quantity) in combined
    assert "passed" in str(report) and "FAIL" not in str(report)


@pytest.mark.skipif(not cpu_available(), reason="the cpu backend is not available")
def test_cpu_backend_passes_every_case():
    fn, backward = backend_functions("cpu")
    report = check_attention(fn, backward=backward, options=BUILT_IN)
    assert report, str(report)
    assert {row.case for row in report.rows} == {c.name for c in _cases.CASES if c.requires <= set(BUILT_IN)}


def test_naive_float32_evaluation_passes_and_float64_one_matches_oracle():
    # The baseline itself is an honest float32 implementation (error 1x naive).
    def naive(q, k, v, k_scale=None, v_scale=None, **options):
        if k_scale is not None:  # a quantized cache's case: its values, in q's dtype
            k, v = (enp.testing.dequantize(a, s).astype(q.dtype) for a, s in ((k, k_scale), (v, v_scale)))
        out, lse, _ = _tolerances.naive_forward(q, k, v, options, q.dtype)
        return out, lse

    report = check_attention(naive, options=ALL)
    assert report, str(report)
    worst64 = max(r.error for r in report.rows if r.dtype == "float64")
    assert worst64 < 1e-13




def _torch():
    return pytest.importorskip("torch")


def sdpa(q, k, v, causal=False, scale=None, mask=None):
    torch = _torch()
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    attn_mask = None if mask is None else torch.from_numpy(mask)
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=attn_mask, is_causal=causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out.numpy()


def sdpa_backward(dout, q, k, v, causal=False, scale=None, mask=None):
    torch = _torch()
    tq, tk, tv = (torch.from_numpy(a.copy()).requires_grad_() for a in (q, k, v))
    attn_mask = None if mask is None else torch.from_numpy(mask)
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=attn_mask, is_causal=causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    out.backward(torch.from_numpy(dout))
    return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


def test_torch_sdpa_passes():
    _torch()
    report = check_attention(sdpa, backward=sdpa_backward, options=["gqa"])
    assert report, str(report)
    cases = {row.case for row in report.rows}
    assert cases == {"plain", "scale", "causal", "mask", "gqa", "plain, N=20"}
    skipped = dict(report.skipped)
    assert skipped["causal N<M"] == ["bottom_right_causal"]
    assert "beta" in skipped and "nvm" in skipped
    quantities = {row.quantity for row in report.rows}
    assert quantities == {"out", "dq", "dk", "dv"}


def sdpa_bias(q, k, v, bias=None):
    """torch's SDPA with a float ``attn_mask``: an additive bias (-inf removes)."""
    torch = _torch()
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    attn_mask = None if bias is None else torch.from_numpy(np.asarray(bias, dtype=q.dtype))
    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=attn_mask).numpy()


def sdpa_bias_backward(dout, q, k, v, bias=None):
    torch = _torch()
    tq, tk, tv = (torch.from_numpy(a.copy()).requires_grad_() for a in (q, k, v))
    tb = None if bias is None else torch.tensor(np.asarray(bias, dtype=q.dtype), requires_grad=True)
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tb)
    out.backward(torch.from_numpy(dout))
    grads = {"dq": tq.grad.numpy(), "dk": tk.grad.numpy(), "dv": tv.grad.numpy()}
    if tb is not None:
        grads["dbias"] = tb.grad.numpy()
    return grads


def test_torch_float_attn_mask_passes_as_a_bias():
    _torch()
    report = check_attention(sdpa_bias, backward=sdpa_bias_backward)
    assert report, str(report)
    assert {row.case for row in report.rows} == {
        "plain", "bias", "bias (N, M)", "bias keys, -inf", "plain, N=20"}
    assert ("bias keys, -inf", "dbias") in {(r.case, r.quantity) for r in report.rows}


# ---------------------------------------------------------------------------
# Broken implementations are caught
# ---------------------------------------------------------------------------


def test_slightly_wrong_scale_is_caught():
    def wrong_scale(q, k, v):
        return reference.attention(q, k, v, scale=1.001 / np.sqrt(q.shape[-1]))[0]

    report = check_attention(wrong_scale)
    assert not report
    assert report.failed_cases == ["plain", "plain, N=20"]
    assert {r.dtype for r in report.failures} == {"float32", "float64"}
    assert "FAIL" in str(report)


def test_wrong_causal_alignment_is_caught():
    _torch()
    # torch aligns causal top-left; declaring bottom-right alignment is wrong.
    report = check_attention(sdpa, options=["bottom_right_causal"])
    assert not report
    assert report.failed_cases == ["causal N<M", "causal N>M"]


def test_top_left_causal_is_caught_without_torch():
    def top_left(q, k, v, causal=False):
        N, M = q.shape[2], k.shape[2]
        mask = np.tril(np.ones((N, M), dtype=bool)) if causal else None
        return reference.attention(q, k, v, mask=mask)[0]

    report = check_attention(top_left, options=["bottom_right_causal"])
    assert report.failed_cases == ["causal N<M", "causal N>M"]


def test_missing_beta_is_caught():
    def no_beta(q, k, v, tau=1.0, beta=0.0):
        return reference.attention(q, k, v, tau=tau)

    report = check_attention(no_beta)
    assert not report
    assert report.failed_cases == ["beta", "tau, beta per head"]
    assert "tau" not in report.failed_cases


def test_off_by_one_mask_is_caught():
    def shifted_mask(q, k, v, mask=None):
        if mask is not None:
            mask = np.roll(mask, 1, axis=-1)
        return reference.attention(q, k, v, mask=mask)

    report = check_attention(shifted_mask)
    assert report.failed_cases == ["mask"]


def test_off_by_one_kv_lengths_is_caught():
    def one_too_many(q, k, v, kv_lengths=None):
        M = k.shape[2]
        if kv_lengths is not None:
            kv_lengths = np.minimum(np.asarray(kv_lengths) + 1, M)
        return reference.attention(q, k, v, kv_lengths=kv_lengths)

    report = check_attention(one_too_many)
    assert report.failed_cases == ["empty rows", "kv_lengths"]


def test_a_tenth_of_a_percent_in_float32_is_caught():
    def off(q, k, v):
        return (reference.attention(q, k, v)[0] * 1.001).astype(q.dtype)

    report = check_attention(off, dtypes=[np.float32])
    assert not report
    assert {row.case for row in report.rows} == {"plain", "plain, N=20"}
    for row in report.rows:
        assert row.dtype == "float32" and not row.passed
        assert row.allowed < 1e-3 * 0.5


def test_float64_floor_is_tight():
    def off(q, k, v):
        return reference.attention(q, k, v)[0] * (1 + 1e-11)

    assert not check_attention(off, dtypes=[np.float64])
    assert check_attention(lambda q, k, v: reference.attention(q, k, v)[0] * (1 + 1e-14),
                           dtypes=[np.float64])


def test_wrong_gradient_is_caught_per_quantity():
    fn, backward = backend_functions("reference")

    def bad_dk(dout, q, k, v, **options):
        g = backward(dout, q, k, v, **options)
        return g.dq, g.dk * 1.001, g.dv, g.dtau, g.dbeta, g.dsigma

    report = check_attention(fn, backward=bad_dk, options=ALL)
    assert {r.quantity for r in report.failures} == {"dk"}


def test_wrong_dbeta_is_caught():
    fn, backward = backend_functions("reference")

    def bad_dbeta(dout, q, k, v, **options):
        g = backward(dout, q, k, v, **options)
        return {"dq": g.dq, "dk": g.dk, "dv": g.dv, "dbeta": np.multiply(g.dbeta, 0.999)}

    report = check_attention(fn, backward=bad_dbeta, options=ALL)
    assert {r.quantity for r in report.failures} == {"dbeta"}
    assert "dtau" not in {r.quantity for r in report.rows}  # not returned: not checked


def test_nan_and_exceptions_are_failures_not_errors():
    def nan_out(q, k, v):
        out = reference.attention(q, k, v)[0]
        out[0, 0, 0, 0] = np.nan
        return out

    report = check_attention(nan_out)
    assert not report and all("NaN" in r.note for r in report.failures)

    def raises(q, k, v, causal=False):
        if causal:
            raise NotImplementedError("no causal here")
        return reference.attention(q, k, v)[0]

    report = check_attention(raises)
    assert report.failed_cases == ["causal"]
    assert "raised NotImplementedError: no causal here" in str(report)


def test_wrong_modifiers_are_caught():
    def softcap_after_bias(q, k, v, softcap=None, bias=None):
        if softcap is None or bias is None:
            return reference.attention(q, k, v, softcap=softcap, bias=bias)
        # the cap applied to the biased score: tanh((s + b) / c) c, wrong order
        N, M, D = q.shape[2], k.shape[2], q.shape[3]
        s = np.einsum("bhnd,bhmd->bhnm", q, np.repeat(k, q.shape[1] // k.shape[1], 1)) / np.sqrt(D)
        z = softcap * np.tanh((s + bias) / softcap)
        return reference.softmax(z) @ np.repeat(v, q.shape[1] // k.shape[1], 1)

    def alibi_top_left(q, k, v, alibi_slopes=None):
        if alibi_slopes is None:
            return reference.attention(q, k, v)
        N, M = q.shape[2], k.shape[2]
        slopes = np.broadcast_to(alibi_slopes, q.shape[:2])[:, :, None, None]
        bias = -slopes * np.abs(np.arange(N)[:, None] - np.arange(M)[None, :])
        return reference.attention(q, k, v, bias=bias)

    def ignores_softcap(q, k, v, softcap=None):
        return reference.attention(q, k, v)

    assert check_attention(ignores_softcap).failed_cases == ["softcap"]
    assert check_attention(alibi_top_left).failed_cases == ["alibi"]
    assert check_attention(softcap_after_bias).failed_cases == ["softcap + bias"]

    fn, backward = backend_functions("reference")

    def bad_dbias(dout, q, k, v, **options):
        g = backward(dout, q, k, v, **options)
        dbias = None if g.dbias is None else g.dbias * 1.001
        return {"dq": g.dq, "dk": g.dk, "dv": g.dv, "dbias": dbias}

    report = check_attention(fn, backward=bad_dbias, options=ALL)
    assert {r.quantity for r in report.failures} == {"dbias"}
    assert {r.case for r in report.failures} == {
        "bias", "bias (N, M)", "bias keys, -inf", "bias queries", "softcap + bias",
        "modifiers combined", "modifiers combined, N=20"}


def test_wrong_shape_is_a_failure():
    report = check_attention(lambda q, k, v: reference.attention(q, k, v)[0][..., :-1])
    assert not report
    assert "shape" in report.failures[0].note


# ---------------------------------------------------------------------------
# Options, inputs and the oracle's gradients
# ---------------------------------------------------------------------------


def test_a_variant_ignored_or_a_captures_gradient_off_is_caught():
    fn, backward = backend_functions("reference")

    def without_variant(q, k, v, score_mod=None, mask_mod=None, block_mask=None, captures=(), **options):
        return fn(q, k, v, **options)

    def bad_dcaptures(dout, q, k, v, **options):
        g = backward(dout, q, k, v, **options)
        return {"dq": g.dq, "dk": g.dk, "dv": g.dv, "dcaptures": tuple(
            None if d is None else d * 1.001 for d in g.dcaptures or ())}

    variant_cases = {c.name for c in _cases.CASES if c.requires & set(_cases.VARIANT_NAMES)}
    assert variant_cases == {"score_mod, mask_mod", "score_mod, block_mask"}
    report = check_attention(without_variant)
    assert {r.case for r in report.failures} == variant_cases
    report = check_attention(fn, backward=bad_dcaptures, options=ALL)
    assert {(r.case, r.quantity) for r in report.failures} == {(c, "dcaptures[0]") for c in variant_cases}
    assert {r.dtype for r in report.failures} == {"float32", "float64"}
    skipped = dict(check_attention(fn, options=BUILT_IN).skipped)
    assert skipped["score_mod, block_mask"] == ["block_mask", "captures", "score_mod"]


def test_supported_options_from_signature_and_declared():
    def fn(q, k, v, causal=False, *, tau=1.0, **kwargs):
        pass

    assert _battery.supported_options(fn) == {"causal", "tau"}
    assert _battery.supported_options(fn, ["gqa"]) == {"causal", "tau", "gqa"}
    with pytest.raises(ValueError, match="unknown options"):
        _battery.supported_options(fn, ["dropout"])
    with pytest.raises(ValueError, match="dtypes"):
        check_attention(fn, dtypes=[np.longdouble])


def test_inputs_avoid_the_nvm_jump_and_the_window_threshold():
    case = {c.name: c for c in _cases.CASES}["combined"]
    q, k, v, dout, options = _cases.draw_inputs(case, np.float32)
    s = np.einsum("bhnd,bhmd->bhnm", q, np.repeat(k, 2, axis=1))
    assert np.min(np.abs(s)) > 1e-5 * np.max(np.abs(s))
    assert q.dtype == np.float64 and np.array_equal(q, q.astype(np.float32))
    window = options["dynamic_window"]
    p = _problem.prepare(q, k, v, **options)
    f = reference.window_gate(p)[1]
    assert np.min(np.abs(f - window.threshold)) > 1e-3 * window.threshold


def test_inputs_are_seeded():
    case = _cases.CASES[0]
    a = _cases.draw_inputs(case, np.float64, seed=3)
    b = _cases.draw_inputs(case, np.float64, seed=3)
    c = _cases.draw_inputs(case, np.float64, seed=4)
    assert np.array_equal(a[0], b[0]) and not np.array_equal(a[0], c[0])


def test_oracle_gradients_pass_gradcheck():
    report = _battery.check_oracle_gradients()
    assert report, str(report)
    quantities = {(r.case, r.quantity) for r in report.rows}
    assert ("combined", "dsigma") in quantities and ("tau, beta per head", "dbeta") in quantities
    assert max(r.error for r in report.rows) < 1e-6


def test_strict_fails_on_skipped_cases_and_the_summary_counts_them():
    import elastic_np as enp

    def fn(q, k, v, causal=False):
        return enp.attention(q, k, v, causal=causal, backend="reference")

    report = enp.testing.check_attention(fn, dtypes=(np.float64,))
    assert report and report.skipped
    assert f"passed, {len(report.skipped)} cases skipped" in str(report)
    strict = enp.testing.check_attention(fn, dtypes=(np.float64,), strict=True)
    assert not strict and not strict.failures and "(strict: a skipped case fails)" in str(strict)


def test_attention_grads_print_a_summary():
    import elastic_np as enp

    q = k = v = np.ones((1, 2, 3, 4))
    out, lse = enp.reference.attention(q, k, v, tau=np.array([1.0, 2.0]))
    text = repr(enp.reference.attention_backward(out, q, k, v, out, lse, tau=np.array([1.0, 2.0])))
    assert "dq=<ndarray shape=(1, 2, 3, 4) dtype=float64>" in text and "dtau=<ndarray shape=(2,)" in text
    assert "dsigma=None" in text and "dbias=None" in text and "dcaptures=None" in text and text.count("\n") == 9


@pytest.mark.parametrize("name", ["dtau", "dsigma", "dbias"])
def test_a_tenth_of_a_percent_in_a_cancelling_sum_is_caught(name):
    # the rounding allowance of the sums that cancel is far below 0.1% on the
    # kit's unit-scale cases: every case that returns the gradient fails
    fn, backward = backend_functions("reference")

    def off(dout, q, k, v, **options):
        grads = backward(dout, q, k, v, **options)
        g = {n: getattr(grads, n) for n in ("dq", "dk", "dv", "dtau", "dbeta", "dsigma", "dbias")}
        g[name] = None if g[name] is None else np.multiply(g[name], 1.001)
        return g

    report = check_attention(fn, backward=off, options=ALL, dtypes=[np.float32])
    rows = [r for r in report.rows if r.quantity == name]
    assert rows and all(not r.passed for r in rows), [(r.case, r.error, r.allowed) for r in rows if r.passed]


def test_quantized_cache_cases_hold_a_kernel_to_the_dequantized_values():
    """The kit's quantized caches (int8 per head, float8 per token, int8 per group): the reference passes, a
    kernel that reads a per-group scale as the first group's for the whole row fails, forward only."""
    pytest.importorskip("ml_dtypes")

    def fn(q, k, v, **options):
        return enp.attention(q, k, v, return_lse=True, backend="reference", **options)

    def first_group(q, k, v, k_scale=None, v_scale=None, **options):
        if np.ndim(v_scale) == 4:
            v_scale = np.ascontiguousarray(np.repeat(v_scale[..., :1], v_scale.shape[-1], axis=-1))
        return fn(q, k, v, k_scale=k_scale, v_scale=v_scale, **options)

    cases = {"int8 cache", "float8_e4m3fn cache per token, causal", "int8 cache per group, N=20"}
    for impl, passes in ((fn, True), (first_group, False)):
        report = check_attention(impl, options=ALL, dtypes=[np.float32, np.float64])
        rows = [row for row in report.rows if row.case in cases]
        assert {row.case for row in rows} == cases and {row.dtype for row in rows} == {"float32"}
        failed = {row.case for row in rows if not row.passed}
        assert failed == (set() if passes else {"int8 cache per group, N=20"}), str(report)


def test_without_ml_dtypes_a_float8_cache_case_is_skipped_saying_so(monkeypatch):
    """ml_dtypes is optional (the test extra): without it the kit's float8 cache case is listed as skipped,
    needing it, and the int8 ones run."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ml_dtypes" else
                        find_spec(name, *a))
    run, skipped = _cases.select_cases(ALL)
    assert ("float8_e4m3fn cache per token, causal", ["ml_dtypes"]) in [(c.name, needs) for c, needs in skipped]
    assert {"int8 cache", "int8 cache per group, N=20"} <= {c.name for c in run}
