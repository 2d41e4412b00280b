"""The prefill kernels: the forward (plain and on AMX tiles), the backward, the plan both read.

Modules: ``plan`` (the options as the kernels read them, for every kernel
of the package), ``forward``, ``forward_amx``, ``backward``, ``key_tiles``
(the backward's key tiles, shared with the double backward's key pass),
``dbias`` (where the bias's gradient goes). Nothing is imported here (see
`elastic_np.cpu._runtime`).
"""
