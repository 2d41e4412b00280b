"""The scripts in ``benchmarks/`` run end to end on a tiny problem (their figures are not checked)."""

import json
import os
import re
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))

import score_modifiers  # noqa: E402

#: A printed ratio: its median, then its range over the rounds, ``r [lo-hi]`` or ``r (lo-hi)``.
RATIO = r"(\d+\.\d+) [\[(](?:range )?(\d+\.\d+)-(\d+\.\d+)[\])]"


def _ratio(out, label):
    """The median, least and largest of the ratio printed after ``label``."""
    found = re.search(re.escape(label) + r":?\s*" + RATIO, out)
    assert found, f"no ratio after {label!r} in {out!r}"
    median, low, high = (float(x) for x in found.groups())
    assert 0 < low <= median <= high, (label, median, low, high)
    return median, low, high


def _ms(out, label):
    """The milliseconds printed after ``label`` (the first such line), and their decimals."""
    found = re.search(re.escape(label) + r"\s+(\d+\.(\d+)) ms", out)
    assert found, f"no time after {label!r} in {out!r}"
    return float(found.group(1)), len(found.group(2))


def _assert_one_round(ratio):
    """A ratio of one round: its median is its range."""
    median, low, high = ratio
    assert median == low == high, ratio


def _assert_two_rounds(ratio, decimals=2):
    """A ratio of two rounds: its median is the mean of the two, its least and largest."""
    median, low, high = ratio
    assert abs(median - (low + high) / 2) <= 10.0**-decimals, ratio


def _assert_quotient(ratio, num, den, decimals=2):
    """``ratio`` (printed to ``decimals`` places) is ``num / den``, two times as printed (value, decimals)."""
    (n, n_places), (d, d_places) = num, den
    n_half, d_half, r_half = 0.5 * 10.0**-n_places, 0.5 * 10.0**-d_places, 0.5 * 10.0**-decimals
    low = (n - n_half) / (d + d_half)
    high = (n + n_half) / (d - d_half) if d > d_half else np.inf
    assert low - r_half <= ratio <= high + r_half, (ratio, num, den)


def test_score_modifiers_prints_every_case(capsys):
    score_modifiers.main(["--n", "64", "--heads", "2", "--dim", "16", "--rounds", "1", "--repeat", "1"])
    out = capsys.readouterr().out
    biases = ("bias (B,H,N,M)", "bias mT(B,H,N,M)", "bias (N,M)", "bias (B,1,1,M)")
    for variant in ("plain", "softcap", "alibi") + biases:
        assert f"\n{variant:<16} fwd+bwd" in out
    assert "extra / memory" in out
    # a least-disturbed figure on every line: 8 variants x 2 passes, 4 biases x 2 passes
    assert out.count("of the best rounds") == 16 + 8
    rows = re.findall(r"\n(.{16}) (fwd\+bwd|fwd)\s+(\d+\.\d+)  (\d+\.\d+)-(\d+\.\d+) \(median (\d+\.\d+), 95% "
                      r"(\d+\.\d+)-(\d+\.\d+)\); of the best rounds (\d+\.\d+)", out)
    assert len(rows) == 16
    for variant, kind, seconds, *ratios in rows:
        # one round: its ratio to plain is the range, the median, the interval and the best round's
        assert float(seconds) >= 0 and len(set(ratios)) == 1, (variant, kind)
        if variant.strip() == "plain":
            assert ratios[0] == "1.000", kind


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
    assert out.count("adapter/direct median") == 2
    for variant in ("plain", "tau+beta"):
        (line,) = [line for line in out.splitlines() if line.startswith(f"  {variant:9s} adapter")]
        assert _ms(line, "adapter")[0] >= 0 and _ms(line, "direct")[0] >= 0, line
        _assert_two_rounds(_ratio(line, "adapter/direct median"), decimals=3)


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
    ratio = _ratio(out, "compiled / eager")
    _assert_one_round(ratio)
    _assert_quotient(ratio[0], _ms(out, "  compiled"), _ms(out, "  eager"), decimals=3)


def test_transformers_decode_runs(capsys):
    pytest.importorskip("transformers")
    import transformers_decode

    transformers_decode.main(["--context", "64", "--llama-context", "32", "--rounds", "1"])
    out = capsys.readouterr().out
    gpt_oss, llama, calls = out.split("gpt-oss-style")[1], *out.split("Llama-style")[1].split("attention calls")
    for block, name in ((gpt_oss, "eager"), (llama, "sdpa"), (calls, "sdpa")):
        ratio = _ratio(block, f"{name} / elastic_np")
        _assert_one_round(ratio)
        _assert_quotient(ratio[0], _ms(block, f"  {name}"), _ms(block, "  elastic_np"))
    for name in ("elastic_np", "sdpa"):  # a step's attention calls are a part of the step
        assert _ms(calls, f"  {name}")[0] <= _ms(llama, f"  {name}")[0], name


def test_varlen_packed_runs(capsys):
    import varlen_packed

    varlen_packed.main(["--lengths", "40", "24", "16", "--rounds", "1"])
    out = capsys.readouterr().out
    for what in ("forward", "forward+backward"):
        (line,) = [line for line in out.splitlines() if line.split()[:1] == [what]]
        ratio = _ratio(line, "padded / packed")
        _assert_one_round(ratio)
        _assert_quotient(ratio[0], _ms(line, "padded"), _ms(line, "packed"))
    # the two calls compute the same: the packed tokens' outputs are the padded batch's unpadded rows
    lengths = [40, 24, 16]
    cases = varlen_packed.calls(lengths, heads=2, dim=8)
    padded, packed = cases["padded", "forward"](), cases["packed", "forward"]()
    assert packed.shape == (sum(lengths), 2, 8) and padded.shape == (3, 2, 40, 8)
    start = 0
    for s, n in enumerate(lengths):
        np.testing.assert_allclose(packed[start:start + n], padded[s, :, :n].transpose(1, 0, 2),
                                   rtol=1e-5, atol=1e-6)
        start += n


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
    packed = _ms(out, "  packed elastic_np")
    for name in ("packed elastic_np", "padded elastic_np", "padded sdpa"):
        (line,) = [line for line in out.splitlines() if line.startswith(f"  {name:<18} ")]
        ratio = _ratio(line, "/ packed elastic_np")
        _assert_one_round(ratio)
        _assert_quotient(ratio[0], _ms(line, name), packed)
        if name == "packed elastic_np":  # its own time
            assert ratio[0] == 1.0, line


def test_halves_prints_every_ratio(capsys):
    pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    import halves

    halves.main(["--cache", "64", "--n", "32", "--rounds", "2", "--repeat", "1", "--threads", "1"])
    out = capsys.readouterr().out
    for case, ratios in halves.RATIOS.items():
        block = out.split(f"\n{case}:")[1]
        for num, den in ratios:
            _assert_two_rounds(_ratio(block, f"  {num} / {den}"))
    # every call of a case computes the same attention, to its dtype's precision
    for calls in (halves.decode_calls(64), halves.prefill_calls(32, causal=True)):
        want = np.asarray(calls["elastic_np float32"](), dtype=np.float64)
        for label, call in calls.items():
            got = call()
            got = got.float().numpy() if hasattr(got, "numpy") else np.asarray(got, dtype=np.float32)
            eps = 2.0**-8 if "bfloat16" in label else 2.0**-11 if "float16" in label else 2.0**-23
            np.testing.assert_allclose(got, want, rtol=0, atol=8 * eps * np.abs(want).max(), err_msg=label)


@pytest.mark.parametrize("per_head, dtype, size, keys", [([], "float32", 4, 256), (["--per-head"], "float32", 4, 256),
                                                         ([], "int8", 1, 1024)],
                         ids=["pages", "pages stored per head", "int8"])
def test_paged_decode_prints_each_case(capsys, per_head, dtype, size, keys):
    import paged_decode

    paged_decode.main(["--cache", str(keys), "--batch", "1", "2", "--block-sizes", "16", "128", "--rounds", "2",
                       "--repeat", "1", "--threads", "1", "--dtype", dtype, *per_head])
    out = capsys.readouterr().out
    assert ("pages stored per head" in out) == bool(per_head) and dtype in out
    for B in (1, 2):
        for block in (16, 128):
            (line,) = [line for line in out.splitlines() if line.startswith(f"{B:>3} {block:>6} ")]
            figures = re.fullmatch(rf"{B:>3} {block:>6}\s+(\d+\.\d+)\s+(\d+\.\d+)\s+{RATIO}\s+(\d+\.\d+) MiB / "
                                   r"(\d+) MiB", line)
            contiguous, paged, ratio, low, high, peak, cache = (float(x) for x in figures.groups())
            assert contiguous >= 0 and paged >= 0, line
            _assert_two_rounds((ratio, low, high))
            # the keys and values of B sequences, 8 heads of 128 entries; the pages read in place
            assert cache == 2 * B * keys * 8 * 128 * size / 2**20 and 0 < peak < cache, line


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
    assert row.split()[8] == "-"  # no floor for a forward alone
    assert len(row.split()) == 11  # the name's 5 words, four times and the ratio with its range
    assert set(json.loads(path.read_text())["rounds"]["decode, 8/2 heads, 64 keys"]) == {"numpy", "torch op", "sdpa"}
    call_overhead.main(["--rounds", "1", "--calls", "2", "--only", "fwd + bwd", "--threads", "1", "--json", str(path)])
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("16 x 16 causal, fwd + bwd")]
    assert float(row.split()[-3]) > 0  # the floor's time
    assert set(json.loads(path.read_text())["rounds"]["16 x 16 causal, fwd + bwd"]) == {
        "numpy", "torch op", "sdpa", "floor"}


def test_the_autograd_floor_hands_back_gradients_of_the_inputs_shapes():
    torch = pytest.importorskip("torch")
    import call_overhead

    q, k, v = (np.full((1, 2, 3, 4), value, np.float32) for value in (1.0, 2.0, 3.0))
    floor = call_overhead.autograd_floor(torch, (q, np.zeros((1, 2, 3), np.float32)), (q, k, v))
    qt, kt, vt = (torch.zeros(1, 2, 3, 4, requires_grad=True) for _ in range(3))
    out, lse = floor.apply(qt, kt, vt, None)
    out.sum().backward()
    assert out.shape == (1, 2, 3, 4) and lse.shape == (1, 2, 3)
    assert [float(t.grad[0, 0, 0, 0]) for t in (qt, kt, vt)] == [1.0, 2.0, 3.0]


def test_backward_overhead_times_both_ways_and_puts_the_backwards_own_back(capsys, tmp_path):
    import backward_overhead
    from elastic_np._api import plans
    from elastic_np.cpu._prefill import backward

    sink, expected = backward.sink_gradient, plans.BackwardPlan._expected
    path = tmp_path / "rounds.json"
    backward_overhead.main(["--rounds", "1", "--calls", "2", "--json", str(path)])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("8 heads, ")]
    assert len(rows) == 4
    for row in rows:  # off, on, their ratio and its range
        off, on, ratio, span = row.split()[-4:]
        assert float(ratio) == pytest.approx(float(off) / float(on), abs=0.01) and span.startswith("(")
    assert set(json.loads(path.read_text())["rounds"]["8 heads, 16 x 16, D = 64: backward"]) == {"on", "off"}
    assert backward.sink_gradient is sink and plans.BackwardPlan._expected is expected


def test_transformers_generate_prints_both_and_their_ratio(capsys):
    pytest.importorskip("transformers")
    import transformers_generate

    transformers_generate.main(["--rounds", "1", "--tokens", "2", "--prompt", "3"])
    out = capsys.readouterr().out
    assert out.count("sdpa / elastic_np: ") == 1
    ratio = _ratio(out, "sdpa / elastic_np")
    _assert_one_round(ratio)
    _assert_quotient(ratio[0], _ms(out, "sdpa"), _ms(out, "elastic_np"))
    # both ways generate the same tokens: the same work timed
    import torch

    model = transformers_generate.tiny_llama()
    prompt = torch.randint(0, 1000, (1, 3), generator=torch.Generator().manual_seed(1))
    _, ours = transformers_generate.generate(model, "elastic_np", prompt, 2)
    _, sdpa = transformers_generate.generate(model, "sdpa", prompt, 2)
    assert ours.shape == (1, 5) and torch.equal(ours, sdpa)


def test_transformers_generate_times_each_attention_call_and_restores_the_registry(capsys):
    transformers = pytest.importorskip("transformers")
    import transformers_generate

    registry = transformers.AttentionInterface._global_mapping
    transformers_generate.main(["--rounds", "1", "--tokens", "2", "--prompt", "3"])  # registers elastic_np
    before = {way: registry[way] for way in ("elastic_np", "sdpa")}
    capsys.readouterr()
    transformers_generate.main(["--rounds", "2", "--tokens", "2", "--prompt", "3", "--per-call"])
    out = capsys.readouterr().out
    calls = re.findall(r"(\d+\.\d) us an attention call \(median of (\d+)\), (\d+)% of the generation", out)
    # 2 rounds of 2 tokens, a prefill and a decoding step, through 2 layers: 8 calls each way
    assert len(calls) == 2 and all(float(us) > 0 and n == "8" and 0 < int(share) < 100 for us, n, share in calls)
    # not the timers: transformers' own sdpa, and the function `register` made (each main registers its own)
    assert registry["sdpa"] is before["sdpa"]
    assert registry["elastic_np"].__qualname__ == before["elastic_np"].__qualname__ == "register.<locals>.attention"


def test_paged_step_prints_both_times_and_their_ratio(capsys):
    import paged_step

    from elastic_np._api import paged_plans

    paged_step.main(["--rounds", "2", "--calls", "3", "--sequences", "3"])
    line = capsys.readouterr().out.strip()
    figures = re.fullmatch(r"paged decoding step, 3 sequences: in full (\d+\.\d) us, looked up (\d+\.\d) us; "
                           r"in full / looked up (\d+\.\d\d) \((\d+\.\d\d)-(\d+\.\d\d)\)", line)
    assert figures, line
    full, looked, ratio, low, high = (float(x) for x in figures.groups())
    assert full > 0 and looked > 0 and low <= ratio <= high, line
    assert paged_plans.PLANS  # the looked-up calls had a plan to look up


def test_quantized_decode_prints_every_goal(capsys):
    import quantized_decode

    quantized_decode.main(["--cache", "64", "--rounds", "2", "--repeat", "1", "--threads", "1"])
    out = capsys.readouterr().out
    for num, den, goal in quantized_decode.GOALS:
        _assert_two_rounds(_ratio(out, f"{num} / {den}"))
        assert f"(goal >= {goal})" in out
    for label in ("bfloat16", "float32", "int8", "float8_e4m3fn"):
        _ms(out, label)
        _assert_two_rounds(_fraction_of_read(out, label))
    assert "peak extra memory (tracemalloc): int8" in out


def _fraction_of_read(out, label):
    """The fraction of the streaming read printed on ``label``'s line."""
    found = re.search(r"^\s+" + re.escape(label) + r"\s.*GB/s\s+" + RATIO + " of the read", out, re.M)
    assert found, f"no fraction of the read for {label!r} in {out!r}"
    median, low, high = (float(x) for x in found.groups())
    assert 0 < low <= median <= high, (label, median, low, high)
    return median, low, high


def test_quantized_decode_with_group_scales_sets_them_beside_per_head_ones(capsys):
    import quantized_decode

    quantized_decode.main(["--cache", "64", "--rounds", "2", "--repeat", "1", "--threads", "1", "--scale", "group"])
    out = capsys.readouterr().out
    _assert_two_rounds(_ratio(out, "int8/head / int8"))
    _ms(out, "int8/head")
    assert _fraction_of_read(out, "read") == (1.0, 1.0, 1.0)  # the read against itself


def test_quantized_prefill_prints_each_cache_against_float32(capsys):
    import quantized_prefill

    quantized_prefill.main(["--queries", "20", "--keys", "40", "--rounds", "2", "--repeat", "1", "--threads", "1"])
    out = capsys.readouterr().out
    for label in ("float32", "int8/head", "int8/group"):
        _ms(out, label)
        _assert_two_rounds(_prefill_ratio(out, label))
    assert _prefill_ratio(out, "float32") == (1.0, 1.0, 1.0)


def _prefill_ratio(out, label):
    """The time over the float32 call's printed on ``label``'s line."""
    found = re.search(r"^\s+" + re.escape(label) + r"\s.*/ float32: " + RATIO, out, re.M)
    assert found, f"no ratio for {label!r} in {out!r}"
    return tuple(float(x) for x in found.groups())


def test_variants_prints_the_comparisons_asked_for(capsys):
    import variants

    # one case (each compiles kernels of its own); the others are the same code with other functions
    variants.main(["--length", "40", "--rounds", "1", "--repeat", "1", "--threads", "1", "--cases", "softcap"])
    printed = capsys.readouterr().out
    assert "softcap (1, 8, 40, 40)" in printed and "window" not in printed and "documents" not in printed
    assert printed.count("user / ") == 2 and set(variants.comparisons(8, 8, ()).keys()) == set()
