"""headstart: train draft heads for speculative decoding and measure them with the engine that serves them."""

__version__ = "0.1.0"
