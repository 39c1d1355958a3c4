"""Split a prompt into fixed-size chunks (mllm-NPU §3.2): every chunk has exactly C rows, so the
prebuilt fixed-shape graphs of length C serve all of them; the last chunk is padded and masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Chunk:
    """Chunk i of a prompt: rows [start, start + C) of the sequence, of which `n_valid` are real."""

    index: int  # i, 0-based
    start: int  # absolute position of the first row (includes the cached prefix P)
    n_valid: int  # 1..C; < C only for the last chunk, whose tail is padding


def check_chunk(chunk_len: object, context_length: int) -> int:
    """The chunk length C, validated: a positive integer no longer than the model's context (a longer C
    only pads every prompt, and its graphs' buffers grow with C)."""
    if not isinstance(chunk_len, int) or isinstance(chunk_len, bool) or chunk_len <= 0:
        raise ConfigError(f"chunk must be a positive integer, got {chunk_len!r}")
    if chunk_len > context_length:
        raise ConfigError(f"chunk must be at most the model's context length {context_length}, got {chunk_len}")
    return chunk_len


def plan_chunks(n_tokens: int, chunk_len: int, start: int = 0) -> list[Chunk]:
    """Chunks covering `n_tokens` new tokens that begin at absolute position `start`."""
    if chunk_len <= 0:
        raise ConfigError(f"chunk must be > 0, got {chunk_len}")
    if n_tokens <= 0:
        raise ConfigError(f"prompt must contain at least one token, got {n_tokens}")
    return [
        Chunk(i, start + off, min(chunk_len, n_tokens - off))
        for i, off in enumerate(range(0, n_tokens, chunk_len))
    ]


def padded_ids(ids: torch.Tensor, chunk: Chunk, chunk_len: int, first: int, pad_id: int = 0) -> torch.Tensor:
    """The C token ids of `chunk` (ids are the new tokens; `first` is the absolute position of ids[0])."""
    lo = chunk.start - first
    out = torch.full((chunk_len,), pad_id, dtype=ids.dtype)
    out[: chunk.n_valid] = ids[lo : lo + chunk.n_valid]
    return out
