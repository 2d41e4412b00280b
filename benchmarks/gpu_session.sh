#!/bin/bash
# The CUDA checks of a GPU session, in one run (about 8 minutes), keeping the log in $OUT (or ./gpu_out):
# 1. the tensor-core products of one warp against NumPy (the fragment layouts), the tensor-core forward's tests,
# 2. the tensor-core forward's tile choices side by side with torch,
# 3. the float32 rule with the float32 default on the tensor cores (TC_FLOAT32),
# 4. the benchmark that writes the results file (docs/performance/*-cuda.json),
# 5. the decode's split settings, its kernels against the copy rate, and a cProfile of its host time,
# 6. the CUDA tests, for what time is left.
# Run from the repository root; PYTHON (default python3) must have numba-cuda, torch with CUDA, pytest.
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
  $PY -c "import numpy, numba, numba_cuda, torch; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'torch', torch.__version__)"
  echo "== 1. one warp, the tensor-core forward"
  timeout 120 $PY -m pytest -q -p no:cacheprovider -n 4 tests/cuda/test_sim_mma.py tests/cuda/test_sim_tc_forward.py
  echo "== 2. forward variants"; timeout 150 $PY benchmarks/cuda_forward_variants.py "$OUT/cuda_forward_variants.json"
  echo "== 3. the float32 rule with the float32 default on the tensor cores (3xTF32)"
  timeout 100 $PY -c "import sys, pytest; sys.path[:0] = ['tests', 'tests/cuda']; from elastic_np.cuda import _config as c; c.TC_FLOAT32 = True; pytest.main(['-q', '-p', 'no:cacheprovider', '-rf', 'tests/cuda/test_sim_attention.py', 'tests/cuda/test_sim_options.py', 'tests/cuda/test_sim_lse_gradient.py', '-k', 'float32 and not decode'])" | grep -E "^FAILED|passed|failed|AssertionError: \('|worst"
  echo "== 4. benchmark"; timeout 200 $PY -m elastic_np.cuda --bench --json "$OUT/cuda-bench.json"
  echo "== 5. decode variants"; timeout 90 $PY benchmarks/cuda_decode_variants.py "$OUT/cuda_decode_variants.json" | head -60
  left=$(( ${SESSION_SECONDS:-480} - SECONDS )); [ $left -lt 60 ] && left=60
  echo "== 6. tests ($left s left)"; timeout ${TEST_SECONDS:-$left} $PY -m pytest -q -p no:cacheprovider -n 8 tests/cuda tests/test_torch_cuda.py
} 2>&1 | tee "$OUT/gpu_session.log"
