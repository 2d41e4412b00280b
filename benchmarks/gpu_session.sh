#!/bin/bash
# The CUDA checks of a GPU session, in one run (about 8 minutes), keeping the log in $OUT (or ./gpu_out):
# 1. the tensor-core products of one warp against NumPy (the fragment layouts), the tensor-core forward's
#    and backward's tests (the backward's switch on, TC_BACKWARD),
# 2. the float32 rule with the float32 default on the tensor cores, forward and backward (TC_FLOAT32, TC_BACKWARD),
# 3. forward + backward with the SIMT and the tensor-core backward side by side with torch,
# 4. the benchmark that writes the results file (docs/performance/*-cuda.json),
# 5. the CUDA tests, for what time is left.
# benchmarks/cuda_forward_variants.py and cuda_decode_variants.py (the forward's tiles, the decode's
# splits) were measured in earlier sessions; run them by hand when those change.
# Run from the repository root; PYTHON (default python3) must have numba-cuda, torch with CUDA, pytest.
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
  $PY -c "import numpy, numba, numba_cuda, torch; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'torch', torch.__version__)"
  echo "== 1. one warp, the tensor-core forward and backward"
  timeout 150 $PY -m pytest -q -p no:cacheprovider -n 4 tests/cuda/test_sim_mma.py tests/cuda/test_sim_tc_forward.py tests/cuda/test_sim_tc_backward.py
  echo "== 2. the float32 rule with the float32 default on the tensor cores (3xTF32), forward and backward"
  timeout 120 $PY -c "import sys, pytest; sys.path[:0] = ['tests', 'tests/cuda']; from elastic_np.cuda import _config as c; c.TC_FLOAT32 = True; c.TC_BACKWARD = True; pytest.main(['-q', '-p', 'no:cacheprovider', '-rf', 'tests/cuda/test_sim_attention.py', 'tests/cuda/test_sim_options.py', 'tests/cuda/test_sim_lse_gradient.py', '-k', 'float32 and not decode'])" | grep -E "^FAILED|passed|failed|AssertionError: \('|worst"
  echo "== 3. backward variants"; timeout 150 $PY benchmarks/cuda_backward_variants.py "$OUT/cuda_backward_variants.json"
  echo "== 4. benchmark"; timeout 200 $PY -m elastic_np.cuda --bench --json "$OUT/cuda-bench.json"
  left=$(( ${SESSION_SECONDS:-480} - SECONDS )); [ $left -lt 60 ] && left=60
  echo "== 5. tests ($left s left)"; timeout ${TEST_SECONDS:-$left} $PY -m pytest -q -p no:cacheprovider -n 8 tests/cuda tests/torch/test_torch_cuda.py
} 2>&1 | tee "$OUT/gpu_session.log"
