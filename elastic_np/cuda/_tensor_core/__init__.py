"""The tensor-core kernels: the forward and backward on ``mma.sync`` (sm_80 and later), and their products."""
