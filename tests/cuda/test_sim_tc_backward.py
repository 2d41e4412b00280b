"""The tensor-core backward (`elastic_np.cuda._tensor_core.backward`) on the simulator or a GPU.

With ``TC_BACKWARD`` on: float64 (DMMA) within 1e-12 of the oracle and the
float32 default (3xTF32, with ``TC_FLOAT32``) within the float32 rule, for
each option the simple kernels take and all combined, grouped-query heads,
heads that are not a multiple of 8 or wider than 64, ``N != M``, multi-block
grids with 16-byte and element copies; the same bits run after run; and the
problems it leaves to the SIMT backward (the general pipeline,
``precision="tf32"``, heads over 128, ``TC_BACKWARD`` off).
"""

import numpy as np
import pytest
from test_sim_attention import assert_float32_rule, assert_float64_close, make_problem, run_cuda, run_reference

from elastic_np.cuda._launch import backward as _backward_launch
from elastic_np.cuda._runtime import config as _cuda_config

pytestmark = pytest.mark.usefixtures("small_tiles")

B, H, HKV = 2, 2, 1


@pytest.fixture
def tensor_core_backward(monkeypatch):
    """``TC_BACKWARD`` on (with ``small_tiles``' tiles); the kernel keys it launched, in order."""
    monkeypatch.setattr(_cuda_config, "TC_BACKWARD", True)
    monkeypatch.setattr(_cuda_config, "MAX_SHARED_BYTES", 64 * 1024)  # the float64 tiles of 64 columns
    monkeypatch.setattr(_cuda_config, "DECODE_MAX_QUERIES", 0)
    runs = []
    launch = _backward_launch._launch_tensor_cores

    def spy(p, opts, plan, arrays, grads):
        runs.append(tuple(key for key, _, _ in plan))
        return launch(p, opts, plan, arrays, grads)

    monkeypatch.setattr(_backward_launch, "_launch_tensor_cores", spy)
    return runs


N, M = 21, 27  # two tiles of 16 each way: every block of the grid but one is partial or past a range's end

OPTIONS = {
    "plain": {},
    "window, scale": {"window_size": (7, 3), "scale": 0.3},
    "causal window, tau, beta": {"causal": True, "window_size": (9, 0), "tau": np.linspace(0.6, 1.5, H),
                                 "beta": np.linspace(0.0, 0.6, H)},
    "kv_lengths": {"kv_lengths": [M - 5, 3], "causal": True, "tau": 1.7},
    "kv_lengths aligned": {"kv_lengths": [M, 0], "align": "kv_lengths", "causal": True},
}


def run_both(dtype, opts, seed=0, **shape):
    shape = {"B": B, "H": H, "Hkv": HKV, "N": N, "M": M, "D": 12, "Dv": 10, **shape}
    q, k, v, dout = make_problem(seed, dtype=dtype, **shape)
    got = run_cuda(q, k, v, dout, opts)
    want = run_reference(*(a.astype(np.float64) for a in (q, k, v, dout)), opts)
    return (q, k, v, dout), got, want


@pytest.mark.parametrize("name", list(OPTIONS))
def test_float64_each_option(tensor_core_backward, name):
    _, got, want = run_both(np.float64, OPTIONS[name], seed=len(name))
    assert tensor_core_backward == [(("dq", 16, 64), ("dkdv", 16, 64))]
    assert_float64_close(got, want)


@pytest.mark.parametrize("name", ["plain", "causal window, tau, beta", "kv_lengths"])
def test_float32_default_within_the_rule(tensor_core_backward, monkeypatch, name):
    monkeypatch.setattr(_cuda_config, "TC_FLOAT32", True)
    opts = OPTIONS[name]
    inputs, got, want = run_both(np.float32, opts, seed=len(name) + 1)
    assert tensor_core_backward == [(("dq", 16, 64), ("dkdv", 16, 64))]
    assert_float32_rule(got, *inputs, opts, want)


@pytest.mark.parametrize("shape, vector", [(dict(N=17, M=40, D=16, Dv=8), True), (dict(N=33, M=9, D=72, Dv=66), True),
                                           (dict(N=19, M=21, D=5, Dv=3), False), (dict(N=1, M=33, D=8, Dv=8), False)],
                         ids=["N < M, 16-byte copies", "N > M, wide heads", "narrow heads", "one query"])
def test_float64_geometries(tensor_core_backward, monkeypatch, shape, vector):
    monkeypatch.setattr(_cuda_config, "TC_VECTOR_COPY", vector)
    monkeypatch.setattr(_cuda_config, "MAX_SHARED_BYTES", 100 * 1024)  # 16 x 132 float64 rows for wide heads
    opts = {"causal": True, "tau": np.linspace(0.7, 1.2, H), "beta": 0.25}
    _, got, want = run_both(np.float64, opts, seed=7, **{"B": 1, **shape})
    width = 128 if max(shape["D"], shape["Dv"]) > 64 else 64
    assert tensor_core_backward == [(("dq", 16, width), ("dkdv", 16, width))]
    assert_float64_close(got, want)


def test_two_warps_a_block(tensor_core_backward, monkeypatch):
    monkeypatch.setattr(_cuda_config, "TC_BACKWARD_WARPS", 2)
    monkeypatch.setattr(_cuda_config, "MAX_SHARED_BYTES", 100 * 1024)
    _, got, want = run_both(np.float64, {"causal": True, "window_size": (20, 2)}, seed=9, B=1, N=40, M=45)
    assert tensor_core_backward == [(("dq", 16, 64), ("dkdv", 16, 64))]
    assert_float64_close(got, want)


def test_tiles_of_eight(tensor_core_backward, monkeypatch):
    """One fragment of keys (dq) or queries (dk/dv) a tile: the float64 dk/dv kernel of 128-column heads."""
    monkeypatch.setattr(_cuda_config, "TC_BACKWARD_TILES", dict.fromkeys(_cuda_config.TC_BACKWARD_TILES, 8))
    _, got, want = run_both(np.float64, {"causal": True, "beta": 0.5}, seed=4, B=1, N=19, M=23)
    assert tensor_core_backward == [(("dq", 8, 64), ("dkdv", 8, 64))]
    assert_float64_close(got, want)


def test_same_bits_every_run(tensor_core_backward, monkeypatch):
    monkeypatch.setattr(_cuda_config, "TC_FLOAT32", True)
    q, k, v, dout = make_problem(11, B=1, H=2, Hkv=1, N=20, M=20, D=8, dtype=np.float32)
    opts = {"causal": True, "tau": 0.8}
    first = run_cuda(q, k, v, dout, opts)[2]
    second = run_cuda(q, k, v, dout, opts)[2]
    for name in ("dq", "dk", "dv", "dtau", "dbeta"):
        assert np.array_equal(getattr(first, name), getattr(second, name)), name
    assert len(tensor_core_backward) == 2


def test_empty_sides(tensor_core_backward):
    """No queries: dk and dv are zeros; no keys: dq is."""
    for shape in (dict(N=0, M=20), dict(N=20, M=0)):
        _, got, want = run_both(np.float64, {}, seed=3, B=1, **shape)
        assert_float64_close(got, want)


@pytest.mark.parametrize("case", ["general pipeline", "tf32", "off", "heads over 128"])
def test_left_to_the_simt_backward(tensor_core_backward, monkeypatch, case):
    opts, shape, dtype = {"causal": True}, {}, np.float64
    if case == "general pipeline":
        opts = {"softcap": 2.0}
    elif case == "tf32":
        opts, dtype = {"precision": "tf32"}, np.float32
    elif case == "off":
        monkeypatch.setattr(_cuda_config, "TC_BACKWARD", False)
    else:
        shape = dict(D=136, Dv=8)
    q, k, v, dout = make_problem(2, dtype=dtype, **{"B": 1, "H": 2, "Hkv": 1, "N": 9, "M": 9, "D": 8, **shape})
    grads = run_cuda(q, k, v, dout, opts)[2]
    assert tensor_core_backward == []
    assert np.isfinite(grads.dq).all()
