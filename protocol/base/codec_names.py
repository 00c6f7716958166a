"""The names of the tensor codecs (`swarmloco.protocol.base.codecs`), torch-free, so a config names one without
importing torch; codecs.py checks at import time that its registry matches."""
from __future__ import annotations

CODEC_NAMES = ("fp32", "fp16", "bf16", "int8", "int4")


def check_codec_name(name: str) -> str:
    if name not in CODEC_NAMES:
        raise ValueError(f"codec: got {name!r}, allowed {', '.join(CODEC_NAMES)}")
    return name
