"""The SIMT kernels: the flash forward, the backward and decoding, on register micro-tiles (every GPU)."""
