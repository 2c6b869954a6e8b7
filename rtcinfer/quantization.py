"""FlashInfer's `flashinfer.quantization` names that rtcinfer has: the mask bit packing
(rtcinfer/decode.py says why)."""

from .bitpack import packbits, segment_packbits

__all__ = ["packbits", "segment_packbits"]
