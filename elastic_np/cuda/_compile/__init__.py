"""Compiling the kernels without a GPU: every kernel by name, its PTX, and what its compiled code uses."""
