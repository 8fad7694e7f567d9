"""Re-export of the decoder registry, which moved to ``moecompress.decoders`` so the plan schema can ask
``has_decoder`` without importing the runtime."""

from ..decoders import get_decoder, has_decoder, register_decoder

__all__ = ["get_decoder", "has_decoder", "register_decoder"]
