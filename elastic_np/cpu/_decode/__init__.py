"""The decode kernels: a few queries per sequence against a long, possibly paged, key and value cache.

Modules: ``plan`` (which kernel, its tiles and key splits), ``decode``
(the kernels and the merge of their splits), ``tiles`` (where a task finds
its key and value rows), ``products`` (the stacked-rows kernel's products,
reading the cache in place). Nothing is imported here (see
`elastic_np.cpu._runtime`).
"""
