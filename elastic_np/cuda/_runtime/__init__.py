"""What the rest of the CUDA backend stands on: the tunables, ``numba.cuda`` and the GPU, the simulator's gaps."""
