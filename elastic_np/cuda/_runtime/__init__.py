"""What the rest of the CUDA backend stands on: the tunables, ``numba.cuda`` on first use, the GPU's limits, the simulator's stand-ins."""
