"""Split a prompt into fixed-size chunks (mllm-NPU §3.2): every chunk has exactly C rows, so the
prebuilt fixed-shape graphs of length C serve all of them; the last chunk is padded and masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hetero.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Chunk:
    """Chunk i of a prompt: rows [start, start + C) of the sequence, of which `n_valid` are real."""

    index: int  # i, 0-based
    start: int  # absolute position of the first row (includes the cached prefix P)
    n_valid: int  # 1..C; < C only for the last chunk, whose tail is padding


def token_ids(ids: object, vocab: int) -> torch.Tensor:
    """Token ids at the API edge as a 1-D int64 tensor: a list/tuple/range of ints, or a numpy or torch
    integer array of any width (uint16 included), 1-D or [1, n]; each in [0, vocab). Anything else (None,
    text, floats, bools, generators, ids past the vocabulary) is a ConfigError saying what was expected."""
    what = "ids must be token ids (a list of ints, or a 1-D numpy/torch integer array)"
    if isinstance(ids, (str, bytes)):
        raise ConfigError(f"{what}, got {type(ids).__name__}: tokenize the text first, e.g. model.tokenizer(text)['input_ids']")
    if isinstance(ids, (list, tuple, range)):
        flat = ids[0] if len(ids) == 1 and isinstance(ids[0], (list, tuple)) else ids
        for j, v in enumerate(flat):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ConfigError(f"{what}; element {j} is {type(v).__name__} {v!r}")
            if not 0 <= v < vocab:
                raise ConfigError(f"token id {v} at index {j} is out of range [0, {vocab})")
        t = torch.tensor([int(v) for v in flat], dtype=torch.int64)
    elif isinstance(ids, (np.ndarray, torch.Tensor)):
        kind = ids.dtype.kind if isinstance(ids, np.ndarray) else \
            ("b" if ids.dtype == torch.bool else "f" if ids.dtype.is_floating_point or ids.dtype.is_complex else "i")
        if kind not in "iu":
            raise ConfigError(f"{what}, got an array of dtype {ids.dtype}: token ids are integers")
        a = ids.numpy(force=True) if isinstance(ids, torch.Tensor) and ids.dtype != torch.int64 else ids
        if isinstance(a, np.ndarray):
            a = np.asarray(a)
            if a.size and (a.min() < 0 or a.max() >= vocab):
                j = int(np.flatnonzero((a.reshape(-1) < 0) | (a.reshape(-1) >= vocab))[0])
                raise ConfigError(f"token id {a.reshape(-1)[j]} at index {j} is out of range [0, {vocab})")
            t = torch.from_numpy(a.astype(np.int64, copy=False))
        else:
            t = a
    else:
        raise ConfigError(f"{what}, got {type(ids).__name__}" + (" (materialize it: list(ids))"
                                                                 if hasattr(ids, "__next__") else ""))
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ConfigError(f"ids must be a 1-D sequence of token ids, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ConfigError("ids is empty: the prompt must contain at least one token")
    bad = ((t < 0) | (t >= vocab)).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        raise ConfigError(f"token id {int(t[j])} at index {j} is out of range [0, {vocab})")
    return t


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
