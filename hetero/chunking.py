"""Split a prompt into chunks (mllm-NPU §3.2). Fixed-shape graphs of length C serve every chunk, the
last padded and masked; a backend whose graphs take any row count (`any_rows`) runs near-equal chunks
of at most C rows, each rounded up to ROW_ALIGN, so a short prompt is not padded to C.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hetero.errors import ConfigError

ROW_ALIGN = 16  # rows of a variable-length chunk are a multiple of this (few distinct shapes, aligned GEMMs)


@dataclass(frozen=True, slots=True)
class Chunk:
    """Chunk i of a prompt: rows [start, start + rows) of the sequence, of which `n_valid` are real."""

    index: int  # i, 0-based
    start: int  # absolute position of the first row (includes the cached prefix P)
    n_valid: int  # 1..rows; < rows only for the last chunk, whose tail is padding
    rows: int  # rows the subgraphs run on: C for fixed-shape graphs


def plan_chunks(n_tokens: int, chunk_len: int, start: int = 0, any_rows: bool = False) -> list[Chunk]:
    """Chunks covering `n_tokens` new tokens that begin at absolute position `start`.

    any_rows=False: chunks of exactly `chunk_len` rows. True: ⌈n/C⌉ near-equal chunks of at most C rows,
    each a multiple of ROW_ALIGN (300 tokens at C=256: 160 + 144, not 2 × 256).
    """
    if chunk_len <= 0:
        raise ConfigError(f"chunk must be > 0, got {chunk_len}")
    if n_tokens <= 0:
        raise ConfigError(f"prompt must contain at least one token, got {n_tokens}")
    if not any_rows:
        return [Chunk(i, start + off, min(chunk_len, n_tokens - off), chunk_len)
                for i, off in enumerate(range(0, n_tokens, chunk_len))]
    n_chunks = math.ceil(n_tokens / chunk_len)
    size = min(chunk_len, ROW_ALIGN * math.ceil(n_tokens / n_chunks / ROW_ALIGN))
    chunks, off = [], 0
    for i in range(n_chunks):
        n_valid = min(size, n_tokens - off)
        rows = min(chunk_len, ROW_ALIGN * math.ceil(n_valid / ROW_ALIGN))
        chunks.append(Chunk(i, start + off, n_valid, rows))
        off += n_valid
    return chunks


def padded_ids(ids: torch.Tensor, chunk: Chunk, first: int, pad_id: int = 0) -> torch.Tensor:
    """The `chunk.rows` token ids of `chunk` (ids are the new tokens; `first` is the absolute position of ids[0])."""
    lo = chunk.start - first
    out = torch.full((chunk.rows,), pad_id, dtype=ids.dtype)
    out[: chunk.n_valid] = ids[lo : lo + chunk.n_valid]
    return out
