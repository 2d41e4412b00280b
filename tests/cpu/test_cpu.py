"""The Numba CPU kernels against the float64 oracle: every option alone and combined.

float64 results must agree with `elastic_np.reference` to 1e-12 relative;
float32 results within twice the error of a float32 naive evaluation (and
1e-5 absolute on unit-scale inputs), by `oracle_checks.assert_matches_oracle`.
Most cases shrink the tile sizes (the ``small_tiles`` fixture) so that small
shapes still cross several query and key tiles. The other topics are in
``test_cpu_*.py``.
"""

import pytest

from elastic_np import cpu
from oracle_checks import BIASES, CASES, DTYPES, LAYOUTS, check_case, laid_out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_options(small_tiles, dtype, case):
    check_case(dtype, CASES[case])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_name", ["full", "nm", "bhn1", "b1n1", "1h1m-keypad", "1hnm"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bias_layouts(small_tiles, dtype, bias_name, layout):
    # With beta and NVM a bias constant along the keys changes the result
    # (softmax alone is blind to it): every layout must be read at its strides.
    bias = laid_out(BIASES[bias_name].astype(dtype), layout)
    check_case(dtype, dict(bias=bias, beta=[0.0, 0.3, 1.0, 2.5], nvm=True, tau=0.8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dq_shares_in_chunks(small_tiles, monkeypatch, dtype):
    # One key tile per chunk: the dq shares are summed over many chunks.
    monkeypatch.setattr(cpu._runtime.config, "DQ_SHARES_BYTES", 1)
    check_case(dtype, CASES["everything"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_gqa(small_tiles, dtype):
    check_case(dtype, dict(causal=True, nvm=True, tau=0.6), H=3, Hkv=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_query(small_tiles, dtype):
    check_case(dtype, dict(window_size=(3, 7), beta=1.0), H=4, Hkv=1)
