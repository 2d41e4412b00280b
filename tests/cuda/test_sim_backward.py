"""The FlashAttention-2 backward's geometry on the CUDA simulator: lanes, column passes, determinism.

``small_tiles`` runs the other tests with one lane per row (``dq``) and per
key (``dk``/``dv``); here the tiles give 2, 4 and 8 lanes, and head dims
wider than one pass of the ``ACC_COLS`` accumulators per lane, so the
kernels make several passes over the tiles, the last one partial (and, for
``dk``/``dv`` with ``D != Dv``, a pass with nothing left of the narrower head).
"""

import numpy as np
import pytest

import elastic_np as enp
from elastic_np.cuda._runtime import config as _cuda_config
from elastic_np import cuda
from test_sim_attention import (
    assert_float32_rule,
    assert_float64_close,
    bias_of,
    make_problem,
    run_cuda,
    run_reference,
)

pytestmark = pytest.mark.usefixtures("small_tiles")

OPTIONS = {
    "plain": lambda B, H, N, M: {},
    "full bias, softcap, causal window, beta": lambda B, H, N, M: dict(
        bias=bias_of((B, H, N, M), neg_inf=(0, 1, slice(0, 3), slice(None))), softcap=1.3, causal=True,
        window_size=(9, 1), beta=np.linspace(0.0, 0.6, H),
    ),
    "dynamic window, alibi, tau, kv_lengths": lambda B, H, N, M: dict(
        dynamic_window=enp.DynamicWindow(np.linspace(0.3, 0.7, B * H).reshape(B, H), sharpness=3.0, threshold=0.1),
        alibi_slopes=np.linspace(0.05, 0.3, H), tau=np.linspace(0.6, 1.5, H), kv_lengths=[M, 1][:B],
    ),
    "nvm, mask, key padding": lambda B, H, N, M: dict(
        nvm=True, mask=np.random.default_rng(2).random((B, 1, N, M)) < 0.75,
        bias=bias_of((B, 1, 1, M), neg_inf=(0, 0, 0, slice(M - 4, None))), kv_lengths=[M - 2, 0][:B],
    ),
}

# (dq rows, dq keys, dk/dv keys, dk/dv queries, D, Dv, options): lanes per row / key
# 2, 4, 8, 1, 2; the last two make 3 passes (D = 21 at 8 columns; D = 40 at 16)
GEOMETRIES = [
    (8, 8, 8, 8, 6, 5, "full bias, softcap, causal window, beta"),
    (4, 16, 4, 16, 6, 5, "dynamic window, alibi, tau, kv_lengths"),
    (8, 32, 8, 32, 6, 7, "nvm, mask, key padding"),
    (8, 4, 8, 4, 21, 13, "full bias, softcap, causal window, beta"),
    (12, 8, 12, 8, 40, 3, "dynamic window, alibi, tau, kv_lengths"),
]


def set_tiles(monkeypatch, dq_m, dq_n, dkdv_n, dkdv_m):
    for name, value in (("DQ_BLOCK_Q", dq_m), ("DQ_BLOCK_K", dq_n), ("DKDV_BLOCK_K", dkdv_n),
                        ("DKDV_BLOCK_Q", dkdv_m)):
        monkeypatch.setattr(_cuda_config, name, value)


@pytest.mark.parametrize("dq_m, dq_n, dkdv_n, dkdv_m, D, Dv, name", GEOMETRIES)
def test_backward_geometries_match_reference(monkeypatch, dq_m, dq_n, dkdv_n, dkdv_m, D, Dv, name):
    from elastic_np.cuda._launch import plan as _plan

    set_tiles(monkeypatch, dq_m, dq_n, dkdv_n, dkdv_m)
    assert _plan.backward_tiles("dq", 8, D, Dv)[1:] == (dq_m, dq_n)  # nothing shrunk
    assert _plan.backward_tiles("dkdv", 8, D, Dv)[1:] == (dkdv_n, dkdv_m)
    B, H, Hkv, N, M = 2, 4, 2, 19, 23
    q, k, v, dout = make_problem(7, B=B, H=H, Hkv=Hkv, N=N, M=M, D=D, Dv=Dv)
    opts = OPTIONS[name](B, H, N, M)
    assert_float64_close(run_cuda(q, k, v, dout, opts), run_reference(q, k, v, dout, opts))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_is_bit_identical_across_runs(monkeypatch, dtype):
    set_tiles(monkeypatch, 8, 8, 8, 16)
    q, k, v, dout = (a.astype(dtype) for a in make_problem(8, B=2, H=4, Hkv=1, N=18, M=21, D=6, Dv=5))
    opts = dict(OPTIONS["dynamic window, alibi, tau, kv_lengths"](2, 4, 18, 21), bias=bias_of((2, 4, 18, 21)))
    first = run_cuda(q, k, v, dout, opts)[2]
    again = run_cuda(q, k, v, dout, opts)[2]
    for name in ("dq", "dk", "dv", "dbias"):
        a, b = getattr(first, name), getattr(again, name)
        assert a.dtype == dtype and a.tobytes() == b.tobytes(), name
    for name in ("dtau", "dbeta", "dsigma"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name), err_msg=name)


@pytest.mark.parametrize("name, value", [("DQ_BLOCK_Q", 6), ("DQ_BLOCK_K", 2), ("DKDV_BLOCK_K", 10),
                                         ("DKDV_BLOCK_Q", 0)])
def test_backward_tiles_are_checked(monkeypatch, name, value):
    from elastic_np.cuda._launch import plan as _plan

    monkeypatch.setattr(_cuda_config, name, value)
    with pytest.raises(ValueError, match=name):
        _plan.backward_tiles("dq" if name.startswith("DQ") else "dkdv", 8, 8, 8)


def test_backward_tiles_shrink_to_fit(monkeypatch):
    from elastic_np.cuda._launch import layouts as _layouts, plan as _plan
    from elastic_np.cuda._runtime.gpu import shared_limit

    set_tiles(monkeypatch, 64, 32, 64, 32)
    for kind in ("dq", "dkdv"):
        for itemsize, D in ((4, 64), (4, 128), (8, 64), (8, 128), (8, 256)):
            threads, rows, cols = _plan.backward_tiles(kind, itemsize, D, D)
            size = _layouts.backward_elements(kind, rows, cols, D, D) * itemsize
            assert size <= shared_limit(), (kind, itemsize, D)
            assert rows % _cuda_config.REG_M == 0 and cols % _cuda_config.REG_N == 0
            assert threads == (rows // _cuda_config.REG_M) * (cols // _cuda_config.REG_N)
    with pytest.raises(ValueError, match="shared memory"):
        _plan.backward_tiles("dq", 8, 4096, 4096)


def test_default_geometry(monkeypatch):
    """The shipped backward tiles (8 lanes a row or key; float64 dq halves its rows), ragged last tiles."""
    import importlib

    from elastic_np.cuda._launch import plan as _plan

    defaults = importlib.reload(_cuda_config)  # undo small_tiles: the module's own values
    monkeypatch.setattr(_cuda_config, "MAX_SHARED_BYTES", 48 * 1024)  # the tiles without a GPU's opt-in
    for name in ("DQ_BLOCK_Q", "DQ_BLOCK_K", "DKDV_BLOCK_K", "DKDV_BLOCK_Q"):
        monkeypatch.setattr(_cuda_config, name, getattr(defaults, name))
    assert _plan.backward_tiles("dq", 4, 4, 5) == (128, 64, 32)  # float32: 64 rows x 32 keys
    assert _plan.backward_tiles("dq", 8, 4, 5) == (64, 32, 32)  # float64: 32 rows x 32 keys
    assert _plan.backward_tiles("dkdv", 8, 4, 5) == (128, 64, 32)  # 64 keys x 32 queries
    q, k, v, dout = make_problem(9, B=1, H=2, Hkv=1, N=70, M=75, D=4, Dv=5)
    opts = dict(causal=True, beta=0.25, softcap=2.0)
    assert_float64_close(run_cuda(q, k, v, dout, opts), run_reference(q, k, v, dout, opts))


@pytest.mark.skipif(not cuda.is_available(), reason="a GPU's opt-in past 48 KB of shared memory")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tiles_past_the_default_shared_memory(monkeypatch, dtype):
    """At D = 128 the default tiles need more than 48 KB: the launches opt in, and the results hold."""
    import importlib

    importlib.reload(_cuda_config)  # undo small_tiles: the shipped tiles, the GPU's limit
    sizes = cuda.dynamic_shared_bytes(128, 128, dtype)
    assert max(size for _, _, size in sizes.values()) > _cuda_config.DEFAULT_SHARED_BYTES
    q, k, v, dout = make_problem(4, B=1, H=4, Hkv=2, N=150, M=190, D=128, dtype=dtype)
    opts = dict(causal=True, beta=0.25, softcap=5.0, window_size=(90, -1))
    got = run_cuda(q, k, v, dout, opts)
    want = run_reference(*(a.astype(np.float64) for a in (q, k, v, dout)), opts)
    if dtype == np.float64:
        assert_float64_close(got, want)
    else:
        assert_float32_rule(got, q, k, v, dout, opts, want)
