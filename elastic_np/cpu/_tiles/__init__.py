"""What one task does to a tile: the single-threaded primitives and the steps every CPU kernel shares.

Modules: ``simd`` (the target's vector width, ``compile_for``), ``products``,
``exp``, ``tanh``, ``transpose`` (the primitives), ``calls`` (the primitives
behind C entry points), ``amx`` (AMX tiles from compiled code), ``scalar``,
``halves`` (bfloat16 and float16 storage), ``operands`` (the arrays as the
kernels read them), ``logits`` (a tile's logits), ``online_softmax`` (the
online softmax's steps, for every forward kernel). Nothing is imported here
(see `elastic_np.cpu._runtime`).
"""
