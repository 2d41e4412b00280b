"""asv benchmarks of elastic_np: oracles, CPU and CUDA kernels, NumPy and torch baselines."""
