"""The scripts in ``benchmarks/`` run end to end on a tiny problem (their figures are not checked)."""

import json
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))

import score_modifiers  # noqa: E402


def test_score_modifiers_prints_every_case(capsys):
    score_modifiers.main(["--n", "64", "--heads", "2", "--dim", "16", "--rounds", "1", "--repeat", "1"])
    out = capsys.readouterr().out
    biases = ("bias (B,H,N,M)", "bias mT(B,H,N,M)", "bias (N,M)", "bias (B,1,1,M)")
    for variant in ("plain", "softcap", "alibi") + biases:
        assert f"\n{variant:<16} fwd+bwd" in out
    assert "extra / memory" in out
    # a least-disturbed figure on every line: 8 variants x 2 passes, 4 biases x 2 passes
    assert out.count("of the best rounds") == 16 + 8


def test_score_modifiers_cases_compute_the_same_work():
    variants, biases, cases = score_modifiers.make_cases(n=32, heads=2, dim=8)
    for name in biases:
        assert {(name, "read"), (name, "write"), (name, "fwd"), (name, "fwd+bwd")} <= set(cases)
    grads = cases[("bias (N,M)", "fwd+bwd")]()
    assert grads.dbias.shape == biases["bias (N,M)"].shape


def test_memory_work_reads_the_broadcast_bias_and_writes_its_shape():
    rng = np.random.default_rng(0)
    for shape in [(2, 3, 5, 7), (5, 7), (2, 1, 1, 7), (1, 3, 5, 7)]:
        c_order = rng.standard_normal(shape).astype(np.float32)
        along_queries = np.ascontiguousarray(c_order.mT).mT  # same values, read in memory order
        for bias in (c_order, along_queries):
            want = np.broadcast_to(bias.astype(np.float64), (2, 3, 5, 7)).sum()
            np.testing.assert_allclose(score_modifiers.read_bias(bias, 2, 3, 5), want, rtol=1e-6)
            written = score_modifiers.write_like(bias)
            assert written.shape == bias.shape and written.dtype == bias.dtype and (written == 1).all()


def test_median_interval_brackets_the_median_and_narrows_with_rounds():
    rng = np.random.default_rng(0)
    few = 1.1 + 0.1 * rng.standard_normal(5)
    many = 1.1 + 0.1 * rng.standard_normal(200)
    for values in (few, many):
        low, high = score_modifiers.median_interval(values)
        assert low <= np.median(values) <= high
        assert score_modifiers.median_interval(values) == (low, high)  # fixed seed
    assert np.subtract(*score_modifiers.median_interval(many)[::-1]) < np.subtract(
        *score_modifiers.median_interval(few)[::-1]
    )
    assert score_modifiers.median_interval([1.2]) == (1.2, 1.2)


def test_torch_adapter_overhead_prints_both_ratios(capsys):
    pytest.importorskip("torch")
    import torch_adapter_overhead

    torch_adapter_overhead.main(["--n", "32", "--heads", "2", "--dim", "8", "--rounds", "2", "--repeat", "1"])
    out = capsys.readouterr().out
    for variant in ("plain", "tau+beta"):
        assert f"  {variant:9s} adapter" in out
    assert out.count("adapter/direct median") == 2


def test_dask_scaling_prints_the_ratio_and_each_worker_peak(capsys):
    pytest.importorskip("distributed")
    import dask_scaling

    dask_scaling.main(["--n", "128", "--heads", "2", "--dim", "8", "--chunk", "64", "--rounds", "1",
                       "--repeat", "1", "--keys", "8192", "--key-chunk", "2048", "--memory-limit", "512"])
    out = capsys.readouterr().out
    assert "ratio cluster / direct over 1 rounds" in out and "ratio threads / direct" in out
    assert "completed in" in out and "finite: True" in out
    assert out.count("peak resident") == 2


def test_first_call_times_each_compile_without_what_it_compiled():
    import first_call
    from numba import njit

    @njit
    def inner_fn(x):
        return x + 1

    @njit
    def outer_fn(x):
        return inner_fn(x) * 2

    with first_call.CompileTimes() as times:
        assert outer_fn(1) == 4
    assert set(times.seconds) >= {"test_first_call_times_each_compile_without_what_it_compiled.<locals>.inner_fn",
                                  "test_first_call_times_each_compile_without_what_it_compiled.<locals>.outer_fn"}
    assert all(seconds > 0 for seconds in times.seconds.values())
    with first_call.CompileTimes() as again:
        outer_fn(2)  # compiled already: no event
    assert not again.seconds


def test_torch_compile_step_runs(capsys):
    pytest.importorskip("torch")
    import torch_compile_step

    torch_compile_step.main(["--seq", "16", "--rounds", "1", "--steps", "1"])
    out = capsys.readouterr().out
    assert "compiled / eager:" in out and "eager " in out


def test_transformers_decode_runs(capsys):
    pytest.importorskip("transformers")
    import transformers_decode

    transformers_decode.main(["--context", "64", "--llama-context", "32", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "eager / elastic_np:" in out and "sdpa / elastic_np:" in out and "attention calls" in out


def test_varlen_packed_runs(capsys):
    import varlen_packed

    varlen_packed.main(["--lengths", "40", "24", "16", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "padded / packed" in out and "forward+backward" in out


def test_layouts_prints_each_case_and_computes_the_same_values(capsys):
    import layouts

    layouts.main(["--n", "40", "--heads", "2", "--dim", "8", "--cache", "300", "--rounds", "2", "--repeat", "1"])
    out = capsys.readouterr().out
    for case in ("prefill fwd", "prefill bwd", "decode fwd"):
        assert f"\n{case:<14}" in out
    cases = layouts.make_cases(n=24, heads=2, dim=8, cache=50, dtype=np.float32)
    np.testing.assert_array_equal(cases["decode fwd", "bnhd"](), cases["decode fwd", "bhnd"]())
    assert cases["prefill fwd", "bnhd"]().transpose(0, 2, 1, 3).flags.c_contiguous


def test_transformers_packed_runs(capsys):
    pytest.importorskip("transformers")
    import transformers_packed

    transformers_packed.main(["--lengths", "24", "16", "8", "--layers", "1", "--rounds", "1"])
    out = capsys.readouterr().out
    for name in ("packed elastic_np", "padded elastic_np", "padded sdpa"):
        assert f"  {name:<18}" in out and "/ packed elastic_np" in out


def test_halves_prints_every_ratio(capsys):
    pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    import halves

    halves.main(["--cache", "64", "--n", "32", "--rounds", "2", "--repeat", "1", "--threads", "1"])
    out = capsys.readouterr().out
    for case, ratios in halves.RATIOS.items():
        assert f"\n{case}:" in out
        for num, den in ratios:
            assert f"  {num} / {den}: " in out


def test_paged_decode_prints_each_case(capsys):
    import paged_decode

    paged_decode.main(["--cache", "256", "--batch", "1", "2", "--block-sizes", "16", "128", "--rounds", "2",
                       "--repeat", "1", "--threads", "1"])
    out = capsys.readouterr().out
    for B in (1, 2):
        for block in (16, 128):
            assert f"\n{B:>3} {block:>6} " in out
    assert "MiB / " in out


def test_float32_extremes_prints_every_quantity(capsys):
    import float32_extremes

    # problems 4 to 6 of seed 0: NVM, the decode kernel, a dynamic window and a bias among them
    float32_extremes.main(["--problems", "3", "--first", "4"])
    out = capsys.readouterr().out
    for name in float32_extremes.QUANTITIES:
        assert f"\n{name:9s} " in out
    assert out.count("/3 ") == 7 and out.count("/1 ") == 2  # dsigma and dbias: the one problem with them
    assert out.rstrip().endswith("every quantity within the rule")
    float32_extremes.main(["--problem", "6"])
    assert capsys.readouterr().out.startswith("1 problems from 6 of seed 0")


def test_double_backward_prints_the_ratio_and_each_peak(capsys):
    import double_backward

    double_backward.main(["--n", "40", "--heads", "2", "--dim", "8", "--rounds", "2", "--repeat", "1",
                          "--threads", "1", "--memory-n", "32", "64"])
    out = capsys.readouterr().out
    for label in ("forward+backward", "hvp", "double backward"):
        assert f"\n  {label:<18} " in out
    assert "hvp / forward+backward: " in out
    assert "N =     32: double backward" in out and "N =     64: double backward" in out
    calls = double_backward.make_calls(24, 2, 8, causal=True)
    grads, second = calls["hvp"]()
    alone = calls["double backward"]()
    for a, b in zip(second, alone):
        np.testing.assert_array_equal(a, b)
    assert grads.dq.shape == second.dq.shape == (1, 2, 24, 8)


def test_thread_pool_prints_each_case_and_restores_the_pool(capsys, monkeypatch):
    import thread_pool
    from elastic_np.cpu._runtime import threads as _threads

    thread_pool.main(["--keys", "64", "128", "--rounds", "2", "--repeat", "1", "--gap", "0.0001"])
    out = capsys.readouterr().out
    for case in ("decode bfloat16 M=64", "decode bfloat16 M=128", "decode float32 M=128", "prefill", "backward"):
        assert f"\n{case}" in out
    assert "median of 1" in out and out.count(" (") >= 5
    assert all(m.run_tasks is _threads.run_tasks for m in thread_pool._KERNEL_MODULES)
    for module in thread_pool._KERNEL_MODULES:
        monkeypatch.setattr(module, "run_tasks", module.run_tasks)  # restored after the test
    monkeypatch.setattr(_threads, "thread_count", lambda: 2)
    monkeypatch.setattr(_threads.config, "SERIAL_WORK", 0)  # two parts on either
    call = thread_pool.make_calls([64])["decode bfloat16 M=64"]
    want = call()
    assert thread_pool.timed(thread_pool.executor_runner(2), call, 1, 0.0) > 0
    assert all(m.run_tasks is not _threads.run_tasks for m in thread_pool._KERNEL_MODULES)
    np.testing.assert_array_equal(call().view(np.uint16), want.view(np.uint16))  # the same bits on the executor


def test_interrupts_interrupts_a_long_call_in_a_process_of_its_own():
    import interrupts

    stopped, latency = interrupts.one_run(1, "forward", 16384, 1.0, np.random.default_rng(0))
    assert stopped and 0 <= latency < 1.0


def test_loaded_machine_prints_both_libraries_and_their_ratio(capsys, tmp_path):
    pytest.importorskip("torch")
    import loaded_machine

    path = tmp_path / "rounds.json"
    loaded_machine.main(["--rounds", "1", "--repeat", "1", "--load", "1", "--only", "float32 (4",
                         "--json", str(path)])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("float32 (4, 8, 128, 64)")]
    assert [row[5] for row in rows] == ["elastic_np", "torch"] and all(len(row) == 10 for row in rows)
    assert out.count("ours/torch") == 1  # one case, one ratio of ratios
    saved = json.loads(path.read_text())
    assert saved["load"] == 1 and len(saved["idle"]) == len(saved["loaded"]) == 1


def test_decode_products_prints_every_layout(capsys):
    import decode_products

    decode_products.main(["--rows", "4", "--keys", "32", "--reps", "2", "--repeat", "1"])
    out = capsys.readouterr().out
    for layout in ("float32   rows   4  contiguous", "4096 B apart", "4160 B apart", "2048 B apart", "2112 B apart"):
        assert layout in out
    assert out.count("Q K^T") == 6
    tiles = decode_products.layouts(np.float32, 8)
    a, b = tiles["contiguous"], tiles["4096 B apart"]
    assert a[0].strides[0] == 512 and b[0].strides[0] == 4096 and b[1] == 3 * 128


def test_openmp_neighbours_prints_both_situations_and_restores_the_setting(capsys):
    pytest.importorskip("torch")
    import openmp_neighbours

    from elastic_np.cpu._runtime import config as _config

    before = _config.QUIET_OPENMP_WORK
    openmp_neighbours.main(["--cache", "64", "--rounds", "2", "--gap", "0.001"])
    out = capsys.readouterr().out
    assert "64 keys" in out
    for where in ("after torch", "after a gap"):
        assert f"  {where:<12} asking" in out
    assert _config.QUIET_OPENMP_WORK == before


def test_call_overhead_prints_each_way_and_the_ratio(capsys, tmp_path):
    pytest.importorskip("torch")
    import call_overhead

    path = tmp_path / "rounds.json"
    call_overhead.main(["--rounds", "1", "--calls", "2", "--only", "64 keys", "--threads", "1", "--json", str(path)])
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith("decode, 8/2 heads, 64 keys")]
    assert len(row.split()) == 10  # the name's 5 words, three times and the ratio with its range
    assert set(json.loads(path.read_text())["rounds"]["decode, 8/2 heads, 64 keys"]) == {"numpy", "torch op", "sdpa"}


def test_transformers_generate_prints_both_and_their_ratio(capsys):
    pytest.importorskip("transformers")
    import transformers_generate

    transformers_generate.main(["--rounds", "1", "--tokens", "2", "--prompt", "3"])
    out = capsys.readouterr().out
    assert "elastic_np" in out and "sdpa " in out and out.count("sdpa / elastic_np: ") == 1
