"""The flash forward's geometry on the CUDA simulator: row groups, column passes, determinism.

``small_tiles`` runs every other test with row groups of two threads; here
the key tile is also set so that a row group spans 4 and 8 threads (more
shuffle steps), and the value head is wider than one pass of the output
micro-tile (``ACC_COLS`` columns per thread), so the kernel makes several
passes over the keys with a partial last one.
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np import cuda, reference
from elastic_np.cuda._runtime import config as _cuda_config
from elastic_np.cuda._launch import layouts as _layouts, plan as _plan
from oracle_checks import assert_matches_oracle
from test_sim_attention import CASES, MOD_CASES, case_options, make_problem

pytestmark = pytest.mark.usefixtures("small_tiles")


@pytest.fixture(autouse=True)
def flash_only(monkeypatch):
    """These shapes have few enough queries for the decode kernel: keep them on the flash forward."""
    monkeypatch.setattr(_cuda_config, "DECODE_MAX_QUERIES", 0)

OPTIONS = {
    "plain": {},
    "causal, beta, nvm": dict(causal=True, beta=0.4, nvm=True, tau=0.8),
    "bias, softcap, window, kv_lengths": dict(
        bias=np.random.default_rng(9).standard_normal((13, 37)), softcap=1.5, window_size=(11, 3),
        kv_lengths=[30, 37], beta=np.array([0.0, 0.5]),
    ),
    "dynamic window, alibi, aligned": dict(
        dynamic_window=enp.DynamicWindow(np.array([0.3, 0.6]), sharpness=3.0, threshold=0.1),
        alibi_slopes=[0.1, 0.3], kv_lengths=[25, 37], align="kv_lengths",
    ),
}


def inputs(dtype, Dv, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 2, 13, 6)).astype(dtype)
    k = rng.standard_normal((2, 2, 37, 6)).astype(dtype)
    v = rng.standard_normal((2, 2, 37, Dv)).astype(dtype)
    return q, k, v


# (query tile, key tile, Dv, options): lanes per row 4, 8, 1, 2, 4; with ACC_COLS = 8 the
# last three make 3, 2 and 2 passes over the keys, the last pass partial
GEOMETRIES = [
    (4, 16, 3, "plain"),
    (8, 32, 5, "causal, beta, nvm"),
    (12, 4, 21, "bias, softcap, window, kv_lengths"),
    (8, 8, 21, "dynamic window, alibi, aligned"),
    (4, 16, 40, "bias, softcap, window, kv_lengths"),
]


@pytest.mark.parametrize("block_q, block_k, Dv, name", GEOMETRIES)
def test_forward_geometries_match_reference(monkeypatch, block_q, block_k, Dv, name):
    monkeypatch.setattr(_cuda_config, "FORWARD_BLOCK_Q", block_q)
    monkeypatch.setattr(_cuda_config, "FORWARD_BLOCK_K", block_k)
    threads, tile = _plan.forward_tiles(8, 6, Dv)
    block_rows, tpr = _layouts.forward_geometry(threads, tile)
    assert (block_rows, tile) == (block_q, block_k)  # nothing shrunk: the geometry asked for runs
    assert tpr == block_k // _cuda_config.REG_N
    passes = -(-Dv // (tpr * _cuda_config.ACC_COLS))
    assert passes == {3: 1, 5: 1, 21: 3 if tpr == 1 else 2, 40: 2}[Dv]
    q, k, v = inputs(np.float64, Dv)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cuda", **OPTIONS[name])
    want_out, want_lse = reference.attention(q, k, v, **OPTIONS[name])
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12 * max(1.0, np.abs(want_out).max()))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=0, atol=1e-12 * np.abs(want_lse[finite]).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_is_bit_identical_across_runs(monkeypatch, dtype):
    monkeypatch.setattr(_cuda_config, "FORWARD_BLOCK_K", 16)  # four lanes per row: two shuffle steps
    q, k, v = inputs(dtype, 21, seed=1)
    opts = OPTIONS["bias, softcap, window, kv_lengths"]
    first = enp.attention(q, k, v, return_lse=True, backend="cuda", **opts)
    again = enp.attention(q, k, v, return_lse=True, backend="cuda", **opts)
    for a, b in zip(first, again):
        assert a.dtype == dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name, value", [("FORWARD_BLOCK_K", 12), ("FORWARD_BLOCK_K", 256), ("FORWARD_BLOCK_Q", 6)])
def test_forward_geometry_is_checked(monkeypatch, name, value):
    monkeypatch.setattr(_cuda_config, name, value)
    with pytest.raises(ValueError, match=name):
        _plan.forward_tiles(8, 8, 8)


def test_forward_tiles_shrink_the_larger_side_first(monkeypatch):
    from elastic_np.cuda._runtime import gpu as _host

    monkeypatch.setattr(_cuda_config, "MAX_SHARED_BYTES", 48 * 1024)
    monkeypatch.setattr(_cuda_config, "FORWARD_BLOCK_Q", 64)
    monkeypatch.setattr(_cuda_config, "FORWARD_BLOCK_K", 64)
    for itemsize, D in ((4, 64), (4, 128), (8, 64), (8, 128)):
        threads, tile = _plan.forward_tiles(itemsize, D, D)
        block_q, tpr = _layouts.forward_geometry(threads, tile)
        assert _layouts.forward_elements(threads, tile, D, D) * itemsize <= _host.shared_limit()
        assert block_q % _cuda_config.REG_M == 0 and tpr & (tpr - 1) == 0
        assert max(block_q, tile) <= 2 * min(block_q, tile)  # neither side shrunk alone


def test_default_geometry(monkeypatch):
    """The shipped tiles, ragged last tiles: 64 x 32 (8 lanes a row, 4 full warps) for a narrow value head."""
    import importlib

    defaults = importlib.reload(_cuda_config)  # undo small_tiles: the module's own values
    monkeypatch.setattr(_cuda_config, "MAX_SHARED_BYTES", 48 * 1024)  # the tiles without a GPU's opt-in
    for name in ("FORWARD_BLOCK_Q", "FORWARD_BLOCK_K"):
        monkeypatch.setattr(_cuda_config, name, getattr(defaults, name))
    assert _plan.forward_tiles(4, 4, 5) == (128, 32)  # one lane holds Dv = 5: FORWARD_MIN_BLOCK_K keys
    assert _plan.forward_tiles(8, 4, 5) == (128, 32)
    assert _plan.forward_tiles(4, 4, 72) == (256, 64)  # 72 columns in one pass: 16 lanes a row
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((1, 1, 70, 4)), rng.standard_normal((1, 1, 75, 4))
    opts = dict(causal=True, beta=0.25)
    for dtype, Dv, atol in ((np.float64, 5, 1e-12), (np.float32, 72, 2e-6)):
        v = rng.standard_normal((1, 1, 75, Dv))
        want_out, want_lse = reference.attention(q, k, v, **opts)
        out, lse = enp.attention(*(a.astype(dtype) for a in (q, k, v)), return_lse=True, backend="cuda", **opts)
        assert out.dtype == dtype
        np.testing.assert_allclose(out, want_out, rtol=0, atol=atol)
        np.testing.assert_allclose(lse, want_lse, rtol=0, atol=atol * max(1.0, np.abs(want_lse).max()))


def test_forward_key_tile_follows_the_value_head(monkeypatch):
    """Lanes a row: the fewest whose accumulators hold Dv in one pass, within the configured key tiles."""
    monkeypatch.setattr(_cuda_config, "FORWARD_BLOCK_Q", 64)
    monkeypatch.setattr(_cuda_config, "FORWARD_BLOCK_K", 64)
    monkeypatch.setattr(_cuda_config, "MAX_SHARED_BYTES", 227 * 1024)
    tiles = {Dv: _plan.forward_tiles(4, 64, Dv) for Dv in (1, 16, 64, 65, 128, 256)}
    assert tiles == {1: (128, 32), 16: (128, 32), 64: (128, 32), 65: (256, 64), 128: (256, 64), 256: (256, 64)}
    monkeypatch.setattr(_cuda_config, "FORWARD_MIN_BLOCK_K", 8)
    assert _plan.forward_tiles(4, 64, 16) == (32, 8)


def test_shared_limit(monkeypatch):
    from elastic_np.cuda._runtime import gpu as _host

    monkeypatch.setattr(_cuda_config, "MAX_SHARED_BYTES", 20000)
    assert _host.shared_limit() == 20000
    with pytest.raises(ValueError, match="20000 bytes"):
        _plan.forward_tiles(8, 4096, 4096)
    monkeypatch.setattr(_cuda_config, "MAX_SHARED_BYTES", None)
    if cuda.is_available():  # the device's opt-in maximum (227 KB on an H100)
        assert _host.shared_limit() >= _cuda_config.DEFAULT_SHARED_BYTES
    else:
        assert _host.shared_limit() == _cuda_config.DEFAULT_SHARED_BYTES


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][0].get("N", 12) <= 16]
                         + [n for n in MOD_CASES if MOD_CASES[n][0].get("N", 12) <= 16])
def test_flash_forward_on_the_decode_shaped_cases(name):
    """The case tables' shapes that `cuda.forward` sends to the decode kernel, through the flash forward."""
    shape, opts = CASES[name] if name in CASES else (MOD_CASES[name][0], MOD_CASES[name][1]())
    opts = case_options(name, shape) if name in CASES else opts
    q, k, v, _ = make_problem(21, **shape)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cuda", **opts)
    want_out, want_lse = reference.attention(q, k, v, **opts)
    assert_matches_oracle("out", out, want_out, np.float64)
    assert_matches_oracle("lse", lse, want_lse, np.float64)

