"""Split a prompt into chunks (mllm-NPU §3.2). Fixed-shape graphs of length C serve every chunk, the
last padded and masked; a backend whose graphs take any row count (`any_rows`) runs near-equal chunks
of at most C rows, each rounded up to ROW_ALIGN, so a short prompt is not padded to C.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sys

import numpy as np

from hetero.errors import ConfigError

ROW_ALIGN = 16  # rows of a variable-length chunk are a multiple of this (few distinct shapes, aligned GEMMs)


@dataclass(frozen=True, slots=True)
class Chunk:
    """Chunk i of a prompt: rows [start, start + rows) of the sequence, of which `n_valid` are real."""

    index: int  # i, 0-based
    start: int  # absolute position of the first row (includes the cached prefix P)
    n_valid: int  # 1..rows; < rows only for the last chunk, whose tail is padding
    rows: int  # rows the subgraphs run on: C for fixed-shape graphs


def token_ids(ids: object, vocab: int) -> np.ndarray:
    """Token ids at the API edge as a 1-D int64 numpy array: a list/tuple/range of ints, or a 1-D numpy or torch
    integer array of any width (uint16 included); each in [0, vocab). Anything else (None, text, floats, bools,
    generators, a 2-D batch even of one row, ids past the vocabulary) is a ConfigError saying what was expected."""
    what = "ids must be token ids (a list of ints, or a 1-D numpy/torch integer array)"
    if isinstance(ids, (str, bytes)):
        raise ConfigError(f"{what}, got {type(ids).__name__}: tokenize the text first, e.g. model.tokenizer(text)['input_ids']")
    torch = sys.modules.get("torch")  # a torch tensor can only come from a process that imported torch
    if isinstance(ids, (list, tuple, range)):
        flat = ids
        if len(ids) and isinstance(ids[0], (list, tuple)):  # a batch: one prompt is ids[0]
            raise ConfigError(f"ids must be 1-D token ids [n], got a list of {len(ids)} list(s): pass one prompt's ids"
                              f"{', ids[0]' if len(ids) == 1 else ''}")
        for j, v in enumerate(flat):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ConfigError(f"{what}; element {j} is {type(v).__name__} {v!r}")
            if not 0 <= v < vocab:
                raise ConfigError(f"token id {v} at index {j} is out of range [0, {vocab})")
        a = np.array([int(v) for v in flat], dtype=np.int64)
    elif isinstance(ids, np.ndarray) or (torch is not None and isinstance(ids, torch.Tensor)):
        a = ids.numpy(force=True) if not isinstance(ids, np.ndarray) else ids
        if a.dtype.kind not in "iu":
            raise ConfigError(f"{what}, got an array of dtype {ids.dtype}: token ids are integers")
        a = a.astype(np.int64, copy=False)
    else:
        raise ConfigError(f"{what}, got {type(ids).__name__}" + (" (materialize it: list(ids))"
                                                                 if hasattr(ids, "__next__") else ""))
    if a.ndim != 1:
        raise ConfigError(f"ids must be 1-D token ids [n], got shape {tuple(a.shape)}"
                          + (": pass one prompt's ids, ids[0]" if a.ndim == 2 and a.shape[0] == 1 else ""))
    if a.size == 0:
        raise ConfigError("ids is empty: the prompt must contain at least one token")
    bad = np.flatnonzero((a < 0) | (a >= vocab))
    if bad.size:
        j = int(bad[0])
        raise ConfigError(f"token id {int(a[j])} at index {j} is out of range [0, {vocab})")
    return a


def check_chunk(chunk_len: object, context_length: int) -> int:
    """The chunk length C, validated: a positive integer no longer than the model's context (a longer C
    only pads every prompt, and its graphs' buffers grow with C)."""
    if not isinstance(chunk_len, int) or isinstance(chunk_len, bool) or chunk_len <= 0:
        raise ConfigError(f"chunk must be a positive integer, got {chunk_len!r}")
    if chunk_len > context_length:
        raise ConfigError(f"chunk must be at most the model's context length {context_length}, got {chunk_len}")
    return chunk_len


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


MIN_CHUNK = 8  # rows below which a chunk's GEMMs are too thin to be worth a lane of their own


def lane_chunk(n_tokens: int, chunk: int, lanes: int) -> int:
    """The chunk length for a prompt of `n_tokens` on `lanes` lanes: at most the runtime's `chunk`, and short enough
    that the prompt has a multiple of `lanes` chunks of equal length (each lane as many: 40 tokens → 20 + 20, not
    32 + 8), but not below `MIN_CHUNK` (a prompt of fewer than 2·8 tokens is one chunk)."""
    if n_tokens <= 0 or chunk <= 0 or lanes <= 0:
        raise ConfigError(f"n_tokens, chunk and lanes must be > 0, got {n_tokens}, {chunk}, {lanes}")
    n_chunks = lanes * math.ceil(n_tokens / (lanes * chunk))
    return min(chunk, max(MIN_CHUNK, math.ceil(n_tokens / n_chunks)))


OVERSIZE = 1.5  # a balanced chunk may hold up to this many times the runtime's C rows (the first ones of a prompt)


def balanced_chunks(n_tokens: int, chunk: int, lanes: int, start: int = 0, per_key: float = 0.0) -> list[Chunk]:
    """`n_tokens` new rows from position `start` cut into chunks of equal work, as many as the lanes share evenly
    (`lane_chunk`'s count, more where one would exceed `OVERSIZE`·C rows). A row at position p costs 1 + per_key·p
    (its attention grows with the keys before it), so later chunks are shorter: with equal chunks the lane holding
    the later ones finishes last (1024 tokens in 4 chunks: 5 blocks of attention on one lane, 3 on the other), and in
    the wavefront each chunk's layer waits for the one before it. Measured at 1024 / 2048 tokens: 0.95 / 0.96× the
    time of equal chunks (304 + 272 + 240 + 208 rows instead of 4 × 256); capped at C instead (more, shorter chunks)
    0.98 / 0.97×. Boundaries fall on multiples of `MIN_CHUNK` where chunks are long."""
    first = lane_chunk(n_tokens, chunk, lanes)
    n_chunks = math.ceil(n_tokens / first)
    if n_chunks == 1 or per_key <= 0:
        return plan_chunks(n_tokens, first, start, any_rows=True)

    def work(p: float) -> float:  # the cost of rows start..start+p, relative to a row with no keys
        return p + per_key * ((start + p) ** 2 - start**2) / 2

    while True:
        align = MIN_CHUNK if n_tokens >= 8 * MIN_CHUNK * n_chunks else 1  # (short chunks: rounding would unbalance them)
        total, bounds = work(n_tokens), [0]
        for k in range(1, n_chunks):  # work(b) = k/n of the total: the quadratic's positive root
            target = total * k / n_chunks
            b = (math.sqrt((1 + per_key * start) ** 2 + 2 * per_key * target) - 1 - per_key * start) / per_key
            bounds.append(min(n_tokens - 1, max(bounds[-1] + 1, align * round(b / align))))
        bounds.append(n_tokens)
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        if max(sizes) <= OVERSIZE * chunk or n_chunks >= n_tokens:
            break
        n_chunks += lanes  # the first chunk would exceed C: more chunks, still a multiple of the lanes
    return [Chunk(i, start + a, b - a, b - a) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


@dataclass(frozen=True, slots=True)
class ChunkRule:
    """How a runtime cuts every prompt (`hostplan.HostPlan.chunks`): the one place its chunk length C lives.
    lanes 0: chunks of at most C rows (`plan_chunks`); lanes k ≥ 1: a wavefront's chunks of equal work for k lanes,
    up to `OVERSIZE`·C rows each (`balanced_chunks`), which is why the buffers hold `max_rows`, not C."""

    chunk: int  # C
    lanes: int = 0
    per_key: float = 0.0  # a row's attention cost per key it attends (`balanced_chunks`); 0: equal chunks

    def __post_init__(self) -> None:
        if not isinstance(self.chunk, int) or isinstance(self.chunk, bool) or self.chunk <= 0:
            raise ConfigError(f"chunk must be a positive integer, got {self.chunk!r}")
        if self.lanes < 0 or self.per_key < 0:
            raise ConfigError(f"lanes and per_key must be >= 0, got {self.lanes}, {self.per_key}")

    @property
    def max_rows(self) -> int:
        """The most rows one chunk of this rule holds."""
        return math.floor(OVERSIZE * self.chunk) if self.lanes else self.chunk

    def cut(self, n_tokens: int, start: int, any_rows: bool) -> list[Chunk]:
        """The chunks of `n_tokens` new tokens from position `start` (any_rows: the backend's graphs take any row
        count, so a plain rule's chunks are not padded to C)."""
        if self.lanes:
            return balanced_chunks(n_tokens, self.chunk, self.lanes, start, self.per_key)
        return plan_chunks(n_tokens, self.chunk, start, any_rows)

    def describe(self) -> str:
        if not self.lanes:
            return f"C={self.chunk}, chunks of at most {self.chunk} rows"
        return (f"C={self.chunk}, a multiple of {self.lanes} chunks of equal work (attention {self.per_key:g} of a "
                f"row's cost per key), up to {self.max_rows} rows ({OVERSIZE}·C)")


def padded_ids(ids: np.ndarray, chunk: Chunk, first: int, pad_id: int = 0) -> np.ndarray:
    """The `chunk.rows` token ids of `chunk` (ids are the new tokens; `first` is the absolute position of ids[0])."""
    lo = chunk.start - first
    out = np.full((chunk.rows,), pad_id, dtype=ids.dtype)
    out[: chunk.n_valid] = ids[lo : lo + chunk.n_valid]
    return out
