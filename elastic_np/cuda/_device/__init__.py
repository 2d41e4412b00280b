"""The device functions every kernel family shares: option indices, score, online softmax, tiles, copies."""
