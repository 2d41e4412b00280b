"""Every option alone and all of them combined, on both forward paths, on the CUDA simulator.

The table of issue 25's must-hold: each option of `elastic_np._contract._spec`
(``scale``, ``causal``, ``window_size``, ``kv_lengths``, ``align``, ``mask``,
``nvm``, ``tau``, ``beta``, ``dynamic_window``, ``softcap``,
``alibi_slopes``, ``bias`` full and broadcast) and the backward's ``dlse``,
alone and combined, in float64 (to 1e-12 of the scale) and in float32 (by
the float32 rule of `oracle_checks.assert_matches_oracle`), through the
flash forward (``N = 19`` queries) and the decode kernels (``N = 3``), then
the backward: ``out``, ``lse``, ``dq``, ``dk``, ``dv``, ``dtau``,
``dbeta``, and ``dsigma``/``dbias`` where they exist. ``align`` acts only
through the causal diagonal, the window or the dynamic window, so its case
has ``causal`` and ``kv_lengths`` too.

With ``small_tiles`` every kernel runs several blocks and a partial last
tile at these shapes: forward query tiles 8 + 8 + 3 and key tiles 8 + 8 + 7;
``dq`` 8-row tiles over 4-key tiles (5 + a partial one); ``dk``/``dv``
8-key tiles over 4-query tiles; the delta kernel 16 rows a block; the decode
kernel two key splits of 8-key tiles, its merge kernel 2 columns a thread
pass; a broadcast bias's ``dbias`` blocks 4 threads over 19 entries each.
The combined cases also check that a second run gives the same bits.
"""

import numpy as np
import pytest
from oracle_checks import check_case, make_dlse, make_inputs

import elastic_np as enp
from elastic_np.cuda._runtime import config as _cuda_config

pytestmark = pytest.mark.usefixtures("small_tiles")

M = 23
#: Queries per path: the flash forward (more than DECODE_MAX_QUERIES) or the decode kernels.
PATHS = {"flash": 19, "decode": 3}
DTYPES = [np.float64, np.float32]


def key_bias(H, seed):
    """A ``(1, H, 1, M)`` key bias with the last keys of head 0 removed (``-inf``): a broadcast ``dbias``."""
    bias = np.random.default_rng(seed).standard_normal((1, H, 1, M))
    bias[0, 0, 0, M - 5 :] = -np.inf
    return bias


def mask_of(B, N, seed):
    mask = np.random.default_rng(seed).random((B, 1, N, M)) < 0.7
    mask[0, 0, N // 2] = False  # a row that keeps nothing: lse = -inf where beta = 0
    return mask


def alone(name, B, H, N):
    """The option set ``name`` for a ``(B, H, N, M)`` problem."""
    return {
        "scale": lambda: {"scale": 0.6},
        "causal": lambda: {"causal": True},
        "window_size": lambda: {"window_size": (5, 2)},
        "kv_lengths": lambda: {"kv_lengths": [M, 7]},
        "align (with causal, kv_lengths)": lambda: {"kv_lengths": [M, 7], "align": "kv_lengths", "causal": True},
        "mask": lambda: {"mask": mask_of(B, N, 1)},
        "nvm": lambda: {"nvm": True},
        "tau": lambda: {"tau": np.array([0.6, 1.7])},
        "beta": lambda: {"beta": np.array([0.3, 1.2])},
        "dynamic_window": lambda: {
            "dynamic_window": enp.DynamicWindow(np.array([0.3, 0.6]), sharpness=3.0, threshold=0.1),
        },
        "softcap": lambda: {"softcap": 0.8},
        "alibi_slopes": lambda: {"alibi_slopes": np.array([0.25, 0.1])},
        "bias (B, H, N, M)": lambda: {"bias": np.random.default_rng(2).standard_normal((B, H, N, M))},
        "bias (1, H, 1, M)": lambda: {"bias": key_bias(H, 3)},
        "dlse": dict,
    }[name]()


ALONE = ["scale", "causal", "window_size", "kv_lengths", "align (with causal, kv_lengths)", "mask", "nvm", "tau",
         "beta", "dynamic_window", "softcap", "alibi_slopes", "bias (B, H, N, M)", "bias (1, H, 1, M)", "dlse"]


def everything(bias, B, H, N):
    """Every option at once, per-head and per-(batch, head) values, GQA, a full or a broadcast bias."""
    rng = np.random.default_rng(4)
    return {
        "scale": 0.8, "causal": True, "window_size": (12, 3), "kv_lengths": [M, 16], "align": "kv_lengths",
        "mask": mask_of(B, N, 5), "nvm": True, "tau": np.linspace(0.6, 1.6, H), "beta": np.linspace(0.0, 0.9, H),
        "dynamic_window": enp.DynamicWindow(rng.uniform(0.3, 0.8, (B, H)), sharpness=3.0, threshold=0.05),
        "softcap": 1.3, "alibi_slopes": rng.uniform(0.0, 0.2, (B, H)),
        "bias": rng.standard_normal((B, H, N, M)) if bias == "full" else key_bias(H, 6),
    }


def check_path(path, decode_splits):
    if path == "decode":
        assert decode_splits and decode_splits[-1] > 1  # the decode kernel ran, split-KV
    else:
        assert not decode_splits  # the flash forward ran


@pytest.mark.parametrize("name", ALONE)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_option_alone(decode_runs, dtype, path, name):
    B, H, N = 2, 2, PATHS[path]
    shape = {"B": B, "H": H, "Hkv": H, "N": N, "M": M, "D": 6, "Dv": 5}
    grads = check_case(dtype, alone(name, B, H, N), seed=len(name), backend="cuda", with_lse=name == "dlse",
                       **shape)[2]
    check_path(path, decode_runs)
    assert (grads.dsigma is not None) == (name == "dynamic_window")
    assert (grads.dbias is not None) == name.startswith("bias")


@pytest.mark.parametrize("bias", ["full", "broadcast"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_option_combined(decode_runs, dtype, path, bias):
    B, H, Hkv, N = 2, 4, 2, PATHS[path]
    shape = {"B": B, "H": H, "Hkv": Hkv, "N": N, "M": M, "D": 6, "Dv": 5}
    opts = everything(bias, B, H, N)
    out, lse, grads = check_case(dtype, opts, seed=7, backend="cuda", with_lse=True, **shape)
    check_path(path, decode_runs)
    assert grads.dsigma is not None and grads.dbias is not None
    # a second run, with the same inputs: the same bits
    q, k, v, dout = make_inputs(dtype, seed=7, **shape)
    again_out, again_lse = enp.attention(q, k, v, return_lse=True, backend="cuda", **opts)
    again = enp.attention_backward(dout, q, k, v, again_out, again_lse, dlse=make_dlse(dtype, q, 7), backend="cuda",
                                   **opts)
    assert out.tobytes() == again_out.tobytes() and lse.tobytes() == again_lse.tobytes()
    for field in ("dq", "dk", "dv", "dtau", "dbeta", "dsigma", "dbias"):
        np.testing.assert_array_equal(getattr(grads, field), getattr(again, field), err_msg=field)
        if field in ("dq", "dk", "dv", "dbias"):
            assert getattr(grads, field).tobytes() == getattr(again, field).tobytes(), field


def test_these_shapes_run_several_tiles_and_a_partial_last_one():
    """The docstring's geometry at these shapes, under ``small_tiles``, in both dtypes."""
    from elastic_np.cuda._launch import layouts as _layouts, plan as _plan

    assert _cuda_config.DECODE_MAX_QUERIES < PATHS["flash"] and PATHS["decode"] <= _cuda_config.DECODE_MAX_QUERIES
    N = PATHS["flash"]
    for itemsize in (4, 8):
        threads, tile = _plan.forward_tiles(itemsize, 6, 5)
        block_q, _ = _layouts.forward_geometry(threads, tile)
        assert (block_q, tile) == (8, 8) and N % block_q and M % tile and N > 2 * block_q and M > 2 * tile
        assert _plan.backward_tiles("dq", itemsize, 6, 5)[1:] == (8, 4) and M % 4 and M > 2 * 4
        assert _plan.backward_tiles("dkdv", itemsize, 6, 5)[1:] == (8, 4) and N % 4 and M % 8
        for group in (1, 2):  # the options alone, and combined (GQA)
            rows_blk, tpr = _plan.decode_geometry(group * PATHS["decode"], 6, 5, itemsize)
            block_k = tpr * _cuda_config.DECODE_REG_N
            n_split = _plan.decode_splits(2 * 2 * -(-(group * PATHS["decode"]) // rows_blk), M)
            assert n_split == 2 and M / n_split > block_k and M % block_k
    assert 2 * 2 * N > _cuda_config.DELTA_THREADS and (2 * 2 * N) % _cuda_config.DELTA_THREADS
    assert 5 % _cuda_config.DECODE_MERGE_THREADS and 5 > _cuda_config.DECODE_MERGE_THREADS
    assert (2 * N) % _cuda_config.DBIAS_THREADS  # the key bias's dbias: B N entries per bias entry
