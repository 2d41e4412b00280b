"""Device functions that every kernel family of the CUDA backend shares (their modules import ``numba.cuda``)."""
