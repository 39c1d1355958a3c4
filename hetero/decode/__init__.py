"""Decoding on hetero's own KV cache, with token-tree speculation (LLMCad §3). See `generate.py`."""

from hetero.decode.generate import SPECULATE, Decoding, generate, stream
from hetero.decode.params import Generation, SamplingParams, TokenEvent

__all__ = ["SPECULATE", "Decoding", "Generation", "SamplingParams", "TokenEvent", "generate", "stream"]
