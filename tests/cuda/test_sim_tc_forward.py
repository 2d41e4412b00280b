"""The tensor-core forward (`elastic_np.cuda._tensor_core.forward`) on the simulator or a GPU.

float64 (DMMA) against the oracle for every option alone and all combined,
on multi-block grids with 16-byte and element copies; ``precision="tf32"``
within its documented error bound; the float32 default's 3xTF32 forward
(``TC_FLOAT32``, off by default) against the oracle; the errors for a
``precision`` the problem cannot take.
"""

import numpy as np
import pytest
from oracle_checks import assert_matches_oracle, make_inputs
from test_sim_options import ALONE, M, alone, everything

import elastic_np as enp
from elastic_np import reference
from elastic_np.cuda._runtime import config as _cuda_config
from elastic_np.cuda._launch import plan as _plan

pytestmark = pytest.mark.usefixtures("small_tiles")

N = 37  # three blocks of 16 query rows under small_tiles, the last one partial


@pytest.fixture
def tensor_core_runs(monkeypatch):
    """The kernel keys the tensor-core forward launched, in order."""
    runs = []
    geometry = _plan.tensor_core_geometry

    def spy(itemsize, D, Dv, general=False):
        found = geometry(itemsize, D, Dv, general)
        runs.append(None if found is None else found[0])
        return found

    monkeypatch.setattr(_plan, "tensor_core_geometry", spy)
    monkeypatch.setattr(_cuda_config, "DECODE_MAX_QUERIES", 0)
    return runs


def forward_and_oracle(dtype, opts, seed=0, **shape):
    q, k, v, _ = make_inputs(dtype, seed=seed, **shape)
    out, lse = enp.attention(q, k, v, return_lse=True, backend="cuda", **opts)
    ref_out, ref_lse = reference.attention(*(a.astype(np.float64) for a in (q, k, v)),
                                           **{key: value for key, value in opts.items() if key != "precision"})
    return (q, k, v), (out, lse), (ref_out, ref_lse)


@pytest.mark.parametrize("name", ALONE[:-1])  # dlse is the backward's
def test_float64_each_option(tensor_core_runs, name):
    B, H = 2, 2
    opts = alone(name, B, H, N)
    _, (out, lse), (ref_out, ref_lse) = forward_and_oracle(np.float64, opts, seed=len(name), B=B, H=H, Hkv=H, N=N,
                                                           M=M, D=6, Dv=5)
    assert tensor_core_runs, "the tensor-core forward did not run"
    assert_matches_oracle("out", out, ref_out, np.float64)
    assert_matches_oracle("lse", lse, ref_lse, np.float64)


@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("bias", ["full", "broadcast"])
def test_float64_every_option_and_both_copies(tensor_core_runs, monkeypatch, bias, vector):
    monkeypatch.setattr(_cuda_config, "TC_VECTOR_COPY", vector)
    B, H = 2, 4
    opts = everything(bias, B, H, N)
    _, (out, lse), (ref_out, ref_lse) = forward_and_oracle(np.float64, opts, seed=3, B=B, H=H, Hkv=2, N=N, M=M,
                                                           D=8, Dv=12)
    assert tensor_core_runs == [(32, 64, True)]
    assert_matches_oracle("out", out, ref_out, np.float64)
    assert_matches_oracle("lse", lse, ref_lse, np.float64)


@pytest.mark.parametrize("opts", [{}, {"causal": True, "tau": 0.7}, {"window_size": (40, 3)}],
                         ids=["plain", "causal", "window"])
def test_float64_tiles_inside_the_band(tensor_core_runs, opts):
    """Whole 16 x 32 tiles that nothing masks (the product alone) beside cut ones."""
    _, (out, lse), (ref_out, ref_lse) = forward_and_oracle(np.float64, opts, seed=6, B=1, H=2, Hkv=1, N=48, M=96,
                                                           D=8, Dv=8)
    assert tensor_core_runs == [(32, 64, False)]
    assert_matches_oracle("out", out, ref_out, np.float64)
    assert_matches_oracle("lse", lse, ref_lse, np.float64)


@pytest.mark.parametrize("warps", [1, 2])
@pytest.mark.parametrize("shape", [dict(D=16, Dv=16), dict(D=20, Dv=136), dict(D=4, Dv=3)])
def test_geometries(tensor_core_runs, monkeypatch, shape, warps):
    """Heads narrower than a fragment, not a multiple of 8, wider than one pass of value columns (float32, 3xTF32)."""
    monkeypatch.setattr(_cuda_config, "TC_FORWARD_WARPS", warps)
    monkeypatch.setattr(_cuda_config, "TC_FLOAT32", True)
    opts = {"causal": True, "beta": 0.5}
    _, (out, lse), (ref_out, ref_lse) = forward_and_oracle(np.float32, opts, B=1, H=2, Hkv=1, N=N, M=M + 40,
                                                           **shape)
    assert tensor_core_runs and None not in tensor_core_runs
    assert np.abs(out - ref_out).max() <= 1e-5 and np.abs(lse - ref_lse).max() <= 1e-5


#: TF32's unit roundoff: inputs are rounded to 11 significant bits (nearest).
U_TF32 = 2.0**-11


def tf32_bound(q, k, v, opts):
    """The documented bound of ``precision="tf32"``: per row, of ``|out - oracle|`` and ``|lse - oracle|``.

    A score ``s_ij`` is off by at most ``d_i = (scale / tau) (2 u + D 2^-23) max_j sum_d |q_id k_jd|``
    (``u = 2^-11``; the soft-cap does not widen it); so are the logits, the
    weights ``p_ij`` by a factor within ``exp(2 d_i)``, and ``P V`` adds its
    own TF32 rounding: ``|out_i - oracle| <= (2 (exp(2 d_i) - 1) + 3 u + Dv 2^-23) sum_j p_ij |v_j|``
    and ``|lse_i - oracle| <= 2 d_i``.
    """
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    B, H, _, D = q.shape
    group = H // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scale = opts.get("scale", 1.0 / np.sqrt(D))
    tau = np.broadcast_to(np.asarray(opts.get("tau", 1.0), dtype=np.float64), (H,))
    magnitude = np.einsum("bhid,bhjd->bhij", np.abs(q), np.abs(k))
    d = (scale / tau)[None, :, None] * (2 * U_TF32 + D * 2.0**-23) * magnitude.max(axis=-1)
    identity = np.broadcast_to(np.eye(k.shape[2]), (B, k.shape[1], k.shape[2], k.shape[2]))
    plain = {key: value for key, value in opts.items() if key != "precision"}
    weights = reference.attention(q, k, identity, **plain)[0]  # out with v = I: the weights p_ij
    spread = np.einsum("bhij,bhjc->bhic", weights, np.abs(v)).max(axis=-1)
    out_bound = (2 * np.expm1(2 * d) + 3 * U_TF32 + v.shape[-1] * 2.0**-23) * spread
    return out_bound, 2 * d


@pytest.mark.parametrize("opts", [{}, {"causal": True, "tau": 0.5}, {"softcap": 2.0, "beta": 0.7}],
                         ids=["plain", "causal, tau", "softcap, beta"])
def test_tf32_within_its_bound(tensor_core_runs, opts):
    opts = {**opts, "precision": "tf32"}
    (q, k, v), (out, lse), (ref_out, ref_lse) = forward_and_oracle(np.float32, opts, seed=5, B=2, H=2, Hkv=1,
                                                                   N=N, M=M + 20, D=16, Dv=8)
    assert tensor_core_runs
    out_bound, lse_bound = tf32_bound(q, k, v, opts)
    out_err = np.abs(out.astype(np.float64) - ref_out).max(axis=-1)
    lse_err = np.abs(lse.astype(np.float64) - ref_lse)
    assert (out_err <= out_bound).all(), (out_err / out_bound).max()
    assert (lse_err <= lse_bound).all(), (lse_err / lse_bound).max()
    # and TF32 is what it computed: further from the oracle than float32 would be
    assert out_err.max() > 1e-5


def test_float32_default_takes_the_simt_kernel_unless_asked(tensor_core_runs, monkeypatch):
    q, k, v, _ = make_inputs(np.float32, B=1, H=1, Hkv=1, N=N, M=M, D=8, Dv=8)
    enp.attention(q, k, v, backend="cuda")
    assert tensor_core_runs == []
    monkeypatch.setattr(_cuda_config, "TC_FLOAT32", True)
    out = enp.attention(q, k, v, backend="cuda")
    assert tensor_core_runs == [(32, 64, False)]
    ref = reference.attention(*(a.astype(np.float64) for a in (q, k, v)))[0]
    assert np.abs(out - ref).max() < 1e-5


def test_precision_is_checked():
    q, k, v, _ = make_inputs(np.float64, B=1, H=1, Hkv=1, N=4, M=4, D=8, Dv=8)
    with pytest.raises(ValueError, match="`precision` in float64"):
        enp.attention(q, k, v, precision="tf32", backend="cuda")
    with pytest.raises(ValueError, match="does not take `precision`"):
        enp.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), precision="tf32",
                      backend="cpu")
    with pytest.raises(ValueError, match="`precision` must be None or 'tf32'"):
        enp.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), precision="highest",
                      backend="cuda")
