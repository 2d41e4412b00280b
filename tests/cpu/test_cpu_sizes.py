"""The CPU kernels on sizes that are not multiples of the tile, degenerate lengths and empty rows."""

import numpy as np
import pytest

import elastic_np as enp
from oracle_checks import DTYPES, check_case


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
