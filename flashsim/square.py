"""Square tiles for small SRAM (Saha & Ye). IN PROGRESS."""
def run_square(mc, Q, K, V, shape, tiles, scores):
    raise NotImplementedError("square: in progress")
def count_square(shape, tiles, b):
    raise NotImplementedError("square: in progress")
