"""The double backward: the backward's tangent along the cotangent of its outputs, in two tiled passes.

Modules: ``double_backward`` (the host side), ``tangents`` (the direction
as the kernels read it, a tile's score tangent), ``tangent_rows`` (the query
pass), ``tangent_keys`` (the key pass). Nothing is imported here (see
`elastic_np.cpu._runtime`).
"""
