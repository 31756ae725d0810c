"""Split-KV forward (flash-decoding). IN PROGRESS."""
def run_splitkv(mc, Q, K, V, shape, tiles, scores, *, num_splits):
    raise NotImplementedError("splitkv: in progress")
def count_splitkv(shape, tiles, b, *, num_splits):
    raise NotImplementedError("splitkv: in progress")
