"""The host side of the kernels: the entry points, the option arrays, the kernel choices, the launches."""
