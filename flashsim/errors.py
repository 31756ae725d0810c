"""Typed errors. Each message says how to fix the input."""


class SRAMOverflowError(ValueError):
    """No tile of the requested algorithm fits in the given SRAM.

    ``minimum_bytes`` is the smallest SRAM size (bytes) that holds the algorithm's
    footprint with 1×1 tiles.
    """

    def __init__(self, message: str, minimum_bytes: int | None = None):
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
