"""The CUDA kernels on the CUDA simulator, held to the float64 oracle.

Run with ``NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda`` (see conftest).
Shapes are small and tiles are patched small (``small_tiles``), so every case
runs several blocks, ragged last tiles and skipped tiles.
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import cuda, reference
from elastic_np._contract import _problem
from elastic_np.cuda._launch import arrays as _arrays, layouts as _layouts, options as _options, plan as _plan
from elastic_np.cuda._runtime import gpu as _host
from elastic_np.testing import _tolerances
from oracle_checks import make_inputs

pytestmark = pytest.mark.usefixtures("small_tiles")

GRAD_FIELDS = ("dq", "dk", "dv", "dtau", "dbeta", "dsigma", "dbias")
ARRAY_FIELDS = ("out", "lse", "dq", "dk", "dv", "dbias")


def make_problem(seed, B=1, H=2, Hkv=None, N=12, M=12, D=8, Dv=None, dtype=np.float64):
    Hkv = H if Hkv is None else Hkv
    Dv = D if Dv is None else Dv
    return make_inputs(dtype, B, H, Hkv, N, M, D, Dv, seed)


def run_cuda(q, k, v, dout, opts):
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cuda", **opts)
    grads = enp.attention_backward(dout, q, k, v, out, lse, backend="cuda", **opts)
    return out, lse, grads


def run_reference(q, k, v, dout, opts):
    out, lse = reference.attention(q, k, v, **opts)
    grads = reference.attention_backward(dout, q, k, v, out, lse, **opts)
    return out, lse, grads


def items(out, lse, grads):
    yield "out", out
    yield "lse", lse
    for name in GRAD_FIELDS:
        value = getattr(grads, name)
        if value is not None:
            yield name, value


def max_error(got, want):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite], want[~finite])  # -inf lse of empty rows
    return float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))


def assert_float64_close(got, want):
    """Every output within 1e-12 relative (to the array's scale) of the oracle."""
    for (name, g), (_, w) in zip(items(*got), items(*want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, name
        if name in ARRAY_FIELDS:
            assert g.dtype == np.float64, name
        scale = max(1.0, float(np.max(np.abs(w[np.isfinite(w)]), initial=0.0)))
        assert max_error(g, w) <= 1e-12 * scale, (name, max_error(g, w))


def assert_float32_rule(got, q, k, v, dout, opts, want):
    """The float32 rule (`elastic_np.testing._tolerances.float32_allowed`) on every output.

    Twice the worst error of naive float32 evaluations in several summation
    orders, plus a rounding allowance (one float32 ulp of the scale, or
    `rounding_allowance` for the cancelling sums), and at most 1e-5
    relative to the scale: the rule of the CPU tests.
    """
    orderings = _tolerances.naive_orderings(q, k, v, dout, opts, np.float32)
    summation = _tolerances.rounding_allowance(q, k, v, dout, opts)
    for (name, g), (_, w) in zip(items(*got), items(*want)):
        g = np.asarray(g)
        if name in ARRAY_FIELDS:
            assert g.dtype == np.float32, name
            assert g.shape == np.shape(w), name
        allowed, naive_err = _tolerances.float32_allowed(
            w, [n[name] for n in orderings], summation.get(name))
        err = max_error(g, w)
        assert err <= allowed, (name, err, naive_err, allowed)


CASES = {
    "plain, N != M": (dict(N=17, M=29, D=16), {}),
    "causal and window": (dict(N=24, M=24), dict(causal=True, window_size=(6, 0))),
    "two-sided window, decoding": (dict(N=5, M=37), dict(causal=True, window_size=(9, 2))),
    "elastic per head, GQA": (
        dict(H=4, Hkv=2, N=20, M=33),
        dict(nvm=True, tau=np.array([0.5, 1.0, 2.0, 1.5]), beta=np.array([0.0, 0.3, 1.0, 2.0])),
    ),
    "dynamic window with band": (
        dict(N=32, M=32, D=4, Dv=6),
        dict(
            dynamic_window=enp.DynamicWindow(np.array([0.15, 0.4]), sharpness=3.0, threshold=0.3),
            beta=0.2,
        ),
    ),
    "kv_lengths and empty rows": (
        dict(B=2, N=14, M=21),
        dict(kv_lengths=[11, 0], beta=np.array([0.0, 0.7]), causal=True),
    ),
    "broadcast mask with empty rows": (dict(N=13, M=18), "mask"),
    "ragged cache aligned to kv_lengths": (
        dict(B=3, N=5, M=21),
        dict(
            kv_lengths=[21, 9, 2], align="kv_lengths", causal=True, window_size=(6, -1),
            alibi_slopes=[0.2, 0.05], beta=0.3,
            dynamic_window=enp.DynamicWindow([[0.3], [0.5], [0.9]], sharpness=3.0, threshold=0.1),
        ),
    ),
    "single key, window gate": (
        dict(N=6, M=1),
        dict(dynamic_window=enp.DynamicWindow(0.7, sharpness=2.0, threshold=0.1), nvm=True),
    ),
}


def case_options(name, shape):
    opts = CASES[name][1]
    if opts == "mask":
        rng = np.random.default_rng(5)
        mask = rng.random((1, 1, shape["N"], shape["M"])) < 0.6
        mask[0, 0, 3] = False  # a row with nothing kept, beta = 0: lse = -inf
        opts = dict(mask=mask, nvm=True, tau=0.8)
    return opts


@pytest.mark.parametrize("name", list(CASES))
def test_float64_matches_reference(name):
    shape = CASES[name][0]
    opts = case_options(name, shape)
    q, k, v, dout = make_problem(1, **shape)
    copies = [a.copy() for a in (q, k, v, dout)]
    got = run_cuda(q, k, v, dout, opts)
    want = run_reference(q, k, v, dout, opts)
    assert_float64_close(got, want)
    for a, c in zip((q, k, v, dout), copies):
        np.testing.assert_array_equal(a, c)  # inputs untouched


@pytest.mark.parametrize(
    "name",
    [
        "plain, N != M",
        "elastic per head, GQA",
        "dynamic window with band",
        "kv_lengths and empty rows",
        "broadcast mask with empty rows",
        "ragged cache aligned to kv_lengths",
    ],
)
def test_float32_rule(name):
    shape = CASES[name][0]
    opts = case_options(name, shape)
    q, k, v, dout = make_problem(2, **shape, dtype=np.float32)
    got = run_cuda(q, k, v, dout, opts)
    want = run_reference(*(a.astype(np.float64) for a in (q, k, v, dout)), opts)
    assert_float32_rule(got, q, k, v, dout, opts, want)


def test_device_arrays_stay_on_device():
    from numba import cuda as numba_cuda

    opts = dict(causal=True, nvm=True, tau=0.7, beta=0.5)
    q, k, v, dout = make_problem(3, H=2, Hkv=1, N=10, M=15)
    host = run_cuda(q, k, v, dout, opts)
    dq_, dk_, dv_, ddout = (numba_cuda.to_device(a) for a in (q, k, v, dout))
    out, lse = enp.attention(dq_, dk_, dv_, return_lse=True, backend="cuda", **opts)
    assert _arrays.is_device(out) and _arrays.is_device(lse)
    grads = enp.attention_backward(ddout, dq_, dk_, dv_, out, lse, backend="cuda", **opts)
    for name in ("dq", "dk", "dv"):
        assert _arrays.is_device(getattr(grads, name)), name
        np.testing.assert_array_equal(getattr(grads, name).copy_to_host(), getattr(host[2], name))
    np.testing.assert_array_equal(out.copy_to_host(), host[0])
    np.testing.assert_array_equal(lse.copy_to_host(), host[1])
    assert grads.dtau == host[2].dtau and grads.dbeta == host[2].dbeta


def test_device_arrays_are_validated():
    from numba import cuda as numba_cuda

    q, k, v, _ = make_problem(4, N=4, M=4)
    dq_, dk_ = numba_cuda.to_device(q), numba_cuda.to_device(k)
    with pytest.raises(ValueError, match="`v`"):
        enp.attention(dq_, dk_, numba_cuda.to_device(np.ascontiguousarray(v[:, :, :3])), backend="cuda")
    with pytest.raises(TypeError, match="`q`"):
        enp.attention(numba_cuda.to_device(q.astype(np.float16)), dk_, dk_, backend="cuda")
    with pytest.raises(ValueError, match="C-contiguous"):
        enp.attention(dq_, dk_, numba_cuda.to_device(np.zeros((1, 2, 4, 16)))[:, :, :, ::2], backend="cuda")
    out, lse = enp.attention(dq_, dk_, dk_, return_lse=True, backend="cuda")
    with pytest.raises(ValueError, match="`lse`"):
        enp.attention_backward(out, dq_, dk_, dk_, out, numba_cuda.to_device(np.zeros((1, 2, 3))), backend="cuda")


@pytest.mark.skipif(not _host.simulator(), reason="runs on a real GPU, not the simulator")
def test_simulator_is_not_picked_by_auto():
    assert cuda.is_available() is False
    cuda.check_available()  # the simulator runs the kernels when asked for explicitly


def test_tiles_shrink_to_fit_shared_memory(monkeypatch):
    from elastic_np.cuda._runtime import config as _cuda_config

    monkeypatch.setattr(_cuda_config, "MAX_SHARED_BYTES", 48 * 1024)
    monkeypatch.setattr(_cuda_config, "FORWARD_BLOCK_Q", 64)
    monkeypatch.setattr(_cuda_config, "FORWARD_BLOCK_K", 32)
    threads, tile = _plan.forward_tiles(8, 64, 64)
    assert _layouts.forward_elements(threads, tile, 64, 64) * 8 <= 48 * 1024
    assert threads >= 1 and tile >= 1
    with pytest.raises(ValueError, match="shared memory"):
        _plan.forward_tiles(8, 4096, 4096)


def test_mixed_host_and_device_inputs():
    from numba import cuda as numba_cuda

    q, k, v, dout = make_problem(6, N=6, M=9)
    out, lse = enp.attention(numba_cuda.to_device(q), k, v, return_lse=True, backend="cuda", beta=0.5)
    assert _arrays.is_device(out)
    want_out, want_lse = reference.attention(q, k, v, beta=0.5)
    np.testing.assert_allclose(out.copy_to_host(), want_out, rtol=1e-12, atol=1e-12)
    grads = enp.attention_backward(dout, q, k, v, out, lse, backend="cuda", beta=0.5)
    want = reference.attention_backward(dout, q, k, v, want_out, want_lse, beta=0.5)
    np.testing.assert_allclose(grads.dk.copy_to_host(), want.dk, rtol=1e-12, atol=1e-12)
    assert abs(grads.dbeta - want.dbeta) <= 1e-12


def random_options(rng, B, H, N, M):
    """A seeded mix of every option, so that the tile-skipping rules meet each other."""
    opts = {}
    if rng.random() < 0.5:
        opts["causal"] = True
    if rng.random() < 0.5:
        opts["window_size"] = (int(rng.integers(-1, 8)), int(rng.integers(-1, 8)))
    if rng.random() < 0.5:
        opts["kv_lengths"] = rng.integers(0, M + 1, size=B)
    if rng.random() < 0.4:
        opts["mask"] = rng.random((B, 1, N, M)) < 0.7
    if rng.random() < 0.5:
        opts["nvm"] = True
    opts["tau"] = rng.uniform(0.5, 2.0, size=H) if rng.random() < 0.5 else float(rng.uniform(0.5, 2.0))
    opts["beta"] = rng.uniform(0.0, 1.0, size=H) if rng.random() < 0.5 else 0.0
    if rng.random() < 0.5:
        opts["dynamic_window"] = enp.DynamicWindow(
            rng.uniform(0.2, 1.0, size=(B, H)), sharpness=float(rng.uniform(1, 4)),
            threshold=float(rng.choice([0.0, 0.2])),
        )
    if "kv_lengths" in opts and rng.random() < 0.5:
        opts["align"] = "kv_lengths"
    return opts


@pytest.mark.parametrize("seed", range(20))
def test_float64_random_option_mix(seed):
    rng = np.random.default_rng(100 + seed)
    B, Hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    H = Hkv * int(rng.integers(1, 3))
    N, M = int(rng.integers(1, 20)), int(rng.integers(1, 24))
    shape = dict(B=B, H=H, Hkv=Hkv, N=N, M=M, D=int(rng.integers(1, 7)), Dv=int(rng.integers(1, 7)))
    opts = random_options(rng, B, H, N, M)
    q, k, v, dout = make_problem(seed, **shape)
    assert_float64_close(run_cuda(q, k, v, dout, opts), run_reference(q, k, v, dout, opts))


@pytest.mark.parametrize("sigma, threshold, M", [(0.15, 0.3, 32), (0.4, 0.05, 57), (0.05, 2.0, 16), (3.0, 0.1, 20)])
@pytest.mark.parametrize("length", [None, 0, 1, 2, 11])
def test_window_band_covers_the_open_gate_and_little_more(sigma, threshold, M, length):
    """The band of each sequence, aligned to the array or (``length``) to its own end."""
    N = M - 3
    q, k, v, _ = make_problem(0, N=N, M=M, D=2)
    aligned = {} if length is None else dict(kv_lengths=[length], align="kv_lengths")
    p = _problem.prepare(q, k, v, dynamic_window=enp.DynamicWindow(sigma, threshold=threshold), **aligned)
    band = _options.window_band(p)
    G = reference.window_gate(p)[0][0, 0]
    end = M if length is None else length
    offset = np.arange(M)[None, :] - np.arange(N)[:, None] - (end - N)
    open_offsets = np.abs(offset[G > 0])
    if band[0, 0] >= 0:
        assert (open_offsets <= band[0, 0]).all()  # the kernels skip nothing the gate keeps
    widest = open_offsets.max(initial=-1)
    # and visit at most two extra diagonals per side (of those the sequence has)
    reach = np.abs(offset[:, :end]).max(initial=0)
    assert min(band[0, 0] if band[0, 0] >= 0 else reach, reach) <= max(widest, 0) + 2


# ---------------------------------------------------------------------------
# Score modifiers: softcap, ALiBi, bias (and dbias)
# ---------------------------------------------------------------------------


def bias_of(shape, seed=7, neg_inf=None, dtype=np.float64):
    """A seeded bias of ``shape``, with ``-inf`` at the index ``neg_inf`` (removed entries)."""
    bias = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    if neg_inf is not None:
        bias[neg_inf] = -np.inf
    return bias


MOD_CASES = {
    "softcap": (dict(N=11, M=13), lambda: dict(softcap=0.7)),
    "softcap, causal window, nvm, tau per head": (
        dict(N=12, M=12),
        lambda: dict(softcap=2.0, causal=True, window_size=(5, 1), nvm=True, tau=np.array([0.6, 1.4])),
    ),
    "alibi (H,)": (dict(N=9, M=14), lambda: dict(alibi_slopes=np.array([0.5, 0.125]))),
    "alibi (B, H), GQA, beta, decoding": (
        dict(B=2, H=4, Hkv=2, N=3, M=17),
        lambda: dict(alibi_slopes=np.linspace(0.05, 0.8, 8).reshape(2, 4), beta=0.4, causal=True),
    ),
    "full bias, GQA, nvm, beta per head": (
        dict(B=2, H=4, Hkv=2, N=10, M=11),
        lambda: dict(bias=bias_of((2, 4, 10, 11)), nvm=True, beta=np.array([0.0, 0.2, 0.5, 1.0])),
    ),
    "(N, M) bias, window": (dict(B=2, N=10, M=13), lambda: dict(bias=bias_of((10, 13)), window_size=(4, 4))),
    "(1, H, 1, M) key padding, causal": (
        dict(B=2, N=9, M=12),
        lambda: dict(bias=bias_of((1, 2, 1, 12), neg_inf=(0, 1, 0, slice(8, None))), causal=True),
    ),
    "(B, 1, 1, M) key padding, empty rows": (
        dict(B=2, N=7, M=10),
        lambda: dict(bias=bias_of((2, 1, 1, 10), neg_inf=(1, 0, 0, slice(0, 5))), causal=True, tau=0.9),
    ),
    "(B, H, N, 1) bias, dynamic window": (
        dict(B=2, N=9, M=16),
        lambda: dict(
            bias=bias_of((2, 2, 9, 1)), tau=np.array([0.7, 1.3]),
            dynamic_window=enp.DynamicWindow(np.array([0.3, 0.6]), sharpness=2.0, threshold=0.2),
        ),
    ),
    "scalar-like (1,) bias, softcap, alibi, nvm": (
        dict(B=2, H=4, Hkv=1, N=6, M=9),
        lambda: dict(bias=np.array([0.3]), softcap=1.2, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]), nvm=True),
    ),
    "everything at once": (
        dict(B=2, H=4, Hkv=2, N=13, M=15, D=5, Dv=3),
        lambda: dict(
            softcap=1.5, alibi_slopes=np.array([0.05, 0.1, 0.2, 0.4]),
            bias=bias_of((1, 4, 13, 15), neg_inf=(0, 2, slice(0, 4), slice(0, 3))),
            causal=True, window_size=(9, 0), nvm=True, tau=np.array([0.5, 1.0, 2.0, 1.5]), beta=0.3,
            kv_lengths=[15, 12], mask=np.random.default_rng(3).random((2, 1, 13, 15)) < 0.8,
            dynamic_window=enp.DynamicWindow(0.5, sharpness=3.0, threshold=0.05),
        ),
    ),
    "N = 1, bias over keys": (dict(N=1, M=9), lambda: dict(bias=bias_of((9,)), softcap=0.9, alibi_slopes=[0.2, 0.4])),
    "M = 1, row bias": (dict(B=2, N=6, M=1), lambda: dict(bias=bias_of((2, 1, 6, 1)), alibi_slopes=[0.3, 0.6], beta=0.5)),
    "float32 bias with float64 q": (
        dict(N=8, M=11), lambda: dict(bias=bias_of((2, 8, 11), dtype=np.float32), softcap=3.0),
    ),
    "caller's broadcast view as bias": (
        dict(B=2, N=7, M=9), lambda: dict(bias=np.broadcast_to(bias_of((7, 9)), (2, 2, 7, 9))),
    ),
    # read at the caller's strides, dbias summed over the batch in the bias's own layout
    "caller's (H, N, M) view broadcast over heads": (
        dict(B=2, H=3, Hkv=1, N=7, M=9), lambda: dict(bias=np.broadcast_to(bias_of((1, 7, 9)), (3, 7, 9))),
    ),
    "transposed (H, N, M) bias": (dict(B=2, N=7, M=9), lambda: dict(bias=bias_of((2, 9, 7)).transpose(0, 2, 1))),
    "slice of a larger bias": (dict(B=2, N=7, M=9), lambda: dict(bias=bias_of((2, 10, 12))[:, 2:9, 1:10])),
}

MOD_FLOAT32 = [
    "softcap",
    "alibi (B, H), GQA, beta, decoding",
    "full bias, GQA, nvm, beta per head",
    "(1, H, 1, M) key padding, causal",
    "(B, H, N, 1) bias, dynamic window",
    "scalar-like (1,) bias, softcap, alibi, nvm",
    "everything at once",
]


@pytest.mark.parametrize("name", list(MOD_CASES))
def test_modifiers_float64_match_reference(name):
    shape, options = MOD_CASES[name]
    opts = options()
    q, k, v, dout = make_problem(11, **shape)
    inputs = (q, k, v, dout) + ((opts["bias"],) if "bias" in opts else ())
    copies = [a.copy() for a in inputs]
    got = run_cuda(q, k, v, dout, opts)
    want = run_reference(q, k, v, dout, opts)
    assert_float64_close(got, want)
    if "bias" in opts:
        assert got[2].dbias.shape == np.shape(opts["bias"])
    for a, c in zip(inputs, copies):
        np.testing.assert_array_equal(a, c)  # inputs untouched, the bias too


@pytest.mark.parametrize("name", MOD_FLOAT32)
def test_modifiers_float32_rule(name):
    shape, options = MOD_CASES[name]
    opts = options()
    q, k, v, dout = make_problem(12, **shape, dtype=np.float32)
    got = run_cuda(q, k, v, dout, opts)
    want = run_reference(*(a.astype(np.float64) for a in (q, k, v, dout)), opts)
    assert_float32_rule(got, q, k, v, dout, opts, want)


def test_float64_bias_with_float32_q():
    q, k, v, dout = make_problem(13, N=9, M=10, dtype=np.float32)
    bias = bias_of((1, 2, 9, 10), neg_inf=(0, 0, 2, slice(None)))
    opts = dict(bias=bias, alibi_slopes=[0.25, 0.5])
    got = run_cuda(q, k, v, dout, opts)
    assert got[2].dbias.dtype == np.float32 and got[2].dbias.shape == bias.shape
    want = run_reference(*(a.astype(np.float64) for a in (q, k, v, dout)), opts)
    assert_float32_rule(got, q, k, v, dout, opts, want)


def test_dbias_is_deterministic_and_any_thread_count_agrees():
    from elastic_np.cuda._runtime import config as _cuda_config

    q, k, v, dout = make_problem(14, B=2, H=2, N=9, M=10)
    opts = dict(bias=np.array([0.2]), softcap=1.0, causal=True)
    first = run_cuda(q, k, v, dout, opts)[2].dbias
    again = run_cuda(q, k, v, dout, opts)[2].dbias
    assert first.tobytes() == again.tobytes()  # same bits, run after run
    _cuda_config.DBIAS_THREADS = 1  # (restored by the small_tiles fixture)
    serial = run_cuda(q, k, v, dout, opts)[2].dbias
    want = run_reference(q, k, v, dout, opts)[2].dbias
    assert abs(serial - want) <= 1e-12 * max(1.0, abs(want)) and abs(first - want) <= 1e-12 * max(1.0, abs(want))


def test_device_bias_stays_on_device():
    from numba import cuda as numba_cuda

    q, k, v, dout = make_problem(15, B=2, H=2, Hkv=1, N=8, M=11)
    for bias in (bias_of((2, 1, 1, 11), neg_inf=(0, 0, 0, slice(9, None))), bias_of((2, 2, 8, 11))):
        opts = dict(causal=True, softcap=2.0, alibi_slopes=[0.1, 0.3], beta=0.2)
        host = run_cuda(q, k, v, dout, dict(opts, bias=bias))
        device_bias = numba_cuda.to_device(bias)
        out, lse = enp.attention(q, k, v, return_lse=True, backend="cuda", bias=device_bias, **opts)
        assert _arrays.is_device(out) and _arrays.is_device(lse)
        grads = enp.attention_backward(dout, q, k, v, out, lse, backend="cuda", bias=device_bias, **opts)
        assert _arrays.is_device(grads.dbias) and tuple(grads.dbias.shape) == bias.shape
        np.testing.assert_array_equal(out.copy_to_host(), host[0])
        for name in ("dq", "dk", "dv", "dbias"):
            np.testing.assert_array_equal(getattr(grads, name).copy_to_host(), getattr(host[2], name), err_msg=name)
        np.testing.assert_array_equal(device_bias.copy_to_host(), bias)  # untouched


def test_device_inputs_with_a_host_bias_and_a_device_bias_of_another_dtype():
    from numba import cuda as numba_cuda

    q, k, v, dout = make_problem(16, N=7, M=9)
    bias = bias_of((7, 9), dtype=np.float32)
    opts = dict(bias=bias, nvm=True)
    host = run_cuda(q, k, v, dout, opts)
    dq_, dk_, dv_, ddout = (numba_cuda.to_device(a) for a in (q, k, v, dout))
    for b in (bias, numba_cuda.to_device(bias)):
        out, lse = enp.attention(dq_, dk_, dv_, return_lse=True, backend="cuda", bias=b, nvm=True)
        grads = enp.attention_backward(ddout, dq_, dk_, dv_, out, lse, backend="cuda", bias=b, nvm=True)
        assert grads.dbias.dtype == np.float64 and tuple(grads.dbias.shape) == (7, 9)
        np.testing.assert_array_equal(grads.dbias.copy_to_host(), host[2].dbias)
        np.testing.assert_array_equal(grads.dq.copy_to_host(), host[2].dq)


def test_device_bias_is_validated():
    from numba import cuda as numba_cuda

    q, k, v, _ = make_problem(17, N=4, M=5)
    with pytest.raises(ValueError, match="`bias`"):
        enp.attention(q, k, v, backend="cuda", bias=numba_cuda.to_device(np.zeros((3, 5))))
    with pytest.raises(TypeError, match="`bias`"):
        enp.attention(q, k, v, backend="cuda", bias=numba_cuda.to_device(np.zeros((4, 5), dtype=np.int32)))
    with pytest.raises(ValueError, match="C-contiguous"):
        enp.attention(q, k, v, backend="cuda", bias=numba_cuda.to_device(np.zeros((4, 10)))[:, ::2])


def random_modifiers(rng, B, H, N, M):
    """A seeded mix of the score modifiers, the bias in a random broadcast shape."""
    opts = {}
    if rng.random() < 0.5:
        opts["softcap"] = float(rng.uniform(0.5, 3.0))
    if rng.random() < 0.5:
        opts["alibi_slopes"] = rng.uniform(0.0, 0.5, size=(B, H) if rng.random() < 0.5 else (H,))
    if rng.random() < 0.7:
        shape = tuple(n if rng.random() < 0.5 else 1 for n in (B, H, N, M))
        shape = shape[int(rng.integers(0, 3)) :] if shape[0] == 1 else shape  # drop leading axes sometimes
        bias = rng.standard_normal(shape)
        bias[rng.random(shape) < 0.15] = -np.inf
        opts["bias"] = bias
    return opts


@pytest.mark.parametrize("seed", range(12))
def test_modifiers_float64_random_option_mix(seed):
    rng = np.random.default_rng(300 + seed)
    B, Hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    H = Hkv * int(rng.integers(1, 3))
    N, M = int(rng.integers(1, 14)), int(rng.integers(1, 16))
    shape = dict(B=B, H=H, Hkv=Hkv, N=N, M=M, D=int(rng.integers(1, 6)), Dv=int(rng.integers(1, 6)))
    opts = dict(random_options(rng, B, H, N, M), **random_modifiers(rng, B, H, N, M))
    q, k, v, dout = make_problem(seed, **shape)
    assert_float64_close(run_cuda(q, k, v, dout, opts), run_reference(q, k, v, dout, opts))


@pytest.mark.parametrize("bias_shape", [(2, 2, 9, 10), (1, 2, 1, 10), None])
def test_every_output_entry_is_written(monkeypatch, bias_shape):
    """Device buffers start as NaN here, so an entry a kernel leaves unwritten shows."""
    from numba import cuda as numba_cuda

    def poisoned(shape, dtype=np.float64, **kwargs):
        return numba_cuda.to_device(np.full(shape, np.nan, dtype=dtype))

    monkeypatch.setattr(numba_cuda, "device_array", poisoned)
    q, k, v, dout = make_problem(18, B=2, N=9, M=10)
    opts = dict(causal=True, window_size=(3, 0), softcap=1.0, kv_lengths=[10, 6])
    if bias_shape is not None:
        opts["bias"] = bias_of(bias_shape, neg_inf=(0, 1, slice(None), 0))
    assert_float64_close(run_cuda(q, k, v, dout, opts), run_reference(q, k, v, dout, opts))


@pytest.mark.parametrize("opts", [dict(scale=0.3), dict(tau=0.3, softcap=0.7), dict(tau=np.array([0.7, 1.3]))])
def test_nvm_keeps_exact_zero_scores(opts):
    """Integer-valued, zero-padded inputs: many ``q . k`` are exactly 0, which NVM keeps."""
    rng = np.random.default_rng(4)
    q = rng.integers(-2, 3, (1, 2, 12, 6)).astype(np.float64)
    k = rng.integers(-2, 3, (1, 2, 12, 6)).astype(np.float64)
    q[..., 4:] = k[..., 4:] = 0.0
    v, dout = rng.standard_normal((1, 2, 12, 6)), rng.standard_normal((1, 2, 12, 6))
    assert (np.einsum("bhnd,bhmd->bhnm", q, k) == 0).mean() > 0.1
    opts = dict(opts, nvm=True)
    assert_float64_close(run_cuda(q, k, v, dout, opts), run_reference(q, k, v, dout, opts))
