"""The entry points: validate once, then hand the problem to a backend (`elastic_np.attention` and the rest)."""
