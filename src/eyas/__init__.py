"""eyas: train EAGLE-3 speculative-decoding drafters, with crash-safe hidden-state extraction."""

__version__ = "0.1.0"
