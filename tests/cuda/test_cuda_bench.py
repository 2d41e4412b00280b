"""The CUDA benchmark's results file and its command line, as far as they run without a GPU."""

import json

import pytest

pytest.importorskip("numba_cuda", reason="needs the cuda extra (numba-cuda)")

from elastic_np import cuda
from elastic_np.cli import _cuda, _cuda_bench

SHAPE = (4, 16, 4096, 64)
DECODE = (1, 32, 8, 1, 8192, 128)


def fake_timings(ours, theirs):
    return {
        "elastic_np": {"forward": ours, "forward+backward": 3 * ours},
        "torch": {"forward": theirs, "forward+backward": 2 * theirs},
        "tflops": {"elastic_np": {"forward": 10.0, "forward+backward": 8.0},
                   "torch": {"forward": 20.0, "forward+backward": 25.0}},
    }


def test_results_file_round_trip(tmp_path):
    machine = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "13.0", "numba_cuda": "0.30.4"}
    options = {"causal": True, "softcap": None, "alibi": False, "bias": None}
    decode = [(DECODE, {"elastic_np": 4e-4, "torch": 1e-4})]
    record = _cuda_bench.bench_record(SHAPE, options, fake_timings(0.02, 0.01), decode, machine, command="cmd")
    path = tmp_path / "h100.json"
    _cuda_bench.write_json(record, path)
    back = json.loads(path.read_text())
    assert back["kind"] == "cuda" and back["dtype"] == "float32" and back["command"] == "cmd"
    assert back["machine"] == machine
    assert back["config"] == {"B": 4, "H": 16, "N": 4096, "M": 4096, "D": 64, **options}
    assert back["results"]["elastic_np"]["forward"] == {"seconds": 0.02, "tflops": 10.0}
    assert back["results"]["torch"]["forward+backward"] == {"seconds": 0.02, "tflops": 25.0}
    assert back["speed_ratio"] == pytest.approx({"forward": 0.5, "forward+backward": 1 / 3})
    (entry,) = back["decode"]
    assert entry["shape"] == {"B": 1, "H": 32, "Hkv": 8, "N": 1, "M": 8192, "D": 128}
    assert entry["seconds"] == {"elastic_np": 4e-4, "torch": 1e-4}
    assert entry["speed_ratio"] == pytest.approx(0.25)


def test_decode_shapes_include_the_issue_shape():
    assert DECODE in _cuda_bench.DECODE_SHAPES


@pytest.mark.skipif(cuda.is_available(), reason="a CUDA GPU is usable here")
def test_bench_json_without_gpu_exits_with_a_clear_message(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "out.json"
    with pytest.raises(SystemExit) as info:
        _cuda.main(["--bench", "--json", str(path)])
    message = str(info.value.code)
    assert message.startswith("python -m elastic_np.cuda --bench:") and "GPU" in message
    assert not path.exists()


@pytest.mark.skipif(cuda.is_available(), reason="a CUDA GPU is usable here")
def test_bench_decode_without_gpu_raises_clear_error():
    import elastic_np as enp

    with pytest.raises(enp.BackendUnavailableError, match="GPU"):
        _cuda_bench.bench_decode(1, 2, 1, 1, 16, 8)


def test_json_needs_bench(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        _cuda.main(["--json", str(tmp_path / "x.json")])
    assert info.value.code == 2 and "--json needs --bench" in capsys.readouterr().err


def test_both_command_lines_run_one_benchmark(monkeypatch):
    from elastic_np import cli

    calls = []
    monkeypatch.setattr(_cuda_bench, "run", lambda shape, **options: calls.append((tuple(shape), options)))
    _cuda.main(["--bench", "--shape", "2", "4", "256", "32", "--causal", "--bias", "keys", "--json", "x.json"])
    argv = ["bench", "--gpu", "--batch", "2", "--heads", "4", "--seq", "256", "--dim", "32", "--causal",
            "--bias", "keys", "--json", "x.json"]
    assert cli.main(argv) == 0
    (shape, options), (gpu_shape, gpu_options) = calls
    assert shape == gpu_shape == (2, 4, 256, 32)
    assert gpu_options.pop("command") == "elastic-np " + " ".join(argv) and gpu_options.pop("repeat") is None
    want = {"causal": True, "softcap": None, "alibi": False, "bias": "keys", "json_path": "x.json"}
    assert options == gpu_options == want


def test_run_prints_the_table_and_writes_the_results_file(monkeypatch, tmp_path, capsys):
    """`run` end to end with the timing functions replaced: the file `bench_record` makes, the table of it."""
    machine = {"gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "driver": "13.0", "numba_cuda": "0.30.4"}
    monkeypatch.setattr(_cuda_bench, "bench", lambda B, H, N, D, **options: fake_timings(0.02, 0.01))
    monkeypatch.setattr(_cuda_bench, "bench_decode", lambda *shape: {"elastic_np": 4e-4, "torch": 1e-4})
    monkeypatch.setattr(_cuda_bench, "machine_info", lambda: machine)
    path = tmp_path / "h100.json"
    result = _cuda_bench.run(SHAPE, causal=True, json_path=str(path), command="cmd")
    assert result == fake_timings(0.02, 0.01)
    record = json.loads(path.read_text())
    options = {"causal": True, "softcap": None, "alibi": False, "bias": None}
    want = _cuda_bench.bench_record(SHAPE, options, result, [(s, {"elastic_np": 4e-4, "torch": 1e-4})
                                                              for s in _cuda_bench.DECODE_SHAPES], machine, command="cmd")
    assert record == json.loads(json.dumps(want))
    printed = capsys.readouterr().out
    assert _cuda_bench.format_table(record) in printed and "NVIDIA H100 80GB HBM3 (compute capability 9.0)" in printed
    assert f"wrote {path}" in printed
    _cuda_bench.run(SHAPE)  # without --json: no decode shapes, nothing written
    printed = capsys.readouterr().out
    assert "decoding" not in printed and "wrote" not in printed and "0.50" in printed
