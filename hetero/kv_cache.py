"""The KV cache: preallocated once, written chunk by chunk through views (Transformer-Lite §2.4).

Per layer l: k[l], v[l] are [n_kv, capacity, D]; positions 0..length-1 hold real tokens. Chunk i writes
rows [start, start + n_valid) in place (padded rows never); attention reads through `layer(l)` views.

The cache owns its rules: `length` is read-only, and only its verbs move it: `advance` (a prefill or a
decode step committed rows written past the end), `accept_path` (the accepted path of a verified token
tree), `write_span` (a restore copied K/V in), `truncate` (roll back). `read_span` copies positions out.

A sliding-window layer (window W) keeps only its window: its rows hold positions base..base+rows-1, base moved
forward by `place` before a write (the last W - 1 positions before the write moved back to row 0 once the rows in
use would pass W - 1 + max(rows written, ROOM)). So it holds at most W - 1 + max(C, ROOM) positions (pages past
them are never written: `np.empty` commits none), and a chunk's attention reads W - 1 + C keys instead of every
earlier one (ONNX Runtime's GroupQueryAttention computes every score up to the chunk and masks the window after:
bench/results/window_layout.md). Its positions before base are gone: a roll-back or read that needs them is
refused (ConfigError). `full_history=True` keeps every position of every layer (serve's prefix store can branch
at any position, so it keeps them all).
"""

from __future__ import annotations

import numpy as np

from hetero import buffers
from hetero.config import ModelConfig
from hetero.errors import ConfigError

# Rows of headroom a windowed layer keeps past its window before moving its last W - 1 positions back to row 0:
# one-row decode steps then move W - 1 rows once every ROOM steps (~2 rows a step at W = 512).
ROOM = 256


class KVCache:
    """K/V of every layer for one conversation; `length` real positions, room for `capacity`."""

    def __init__(self, cfg: ModelConfig, capacity: int, dtype: np.dtype | type = np.float32,
                 full_history: bool = False):
        if capacity <= 0:
            raise ConfigError(f"KV cache capacity must be > 0, got {capacity}")
        self.config = cfg
        self.full_history = full_history
        # per layer: its window when it keeps only that (0: every position), the position its row 0 holds, and
        # the most rows it has written (the memory it holds)
        self.windows = (0,) * cfg.n_layers if full_history else tuple(cfg.windows)
        self._base = [0] * cfg.n_layers
        self._high = [0] * cfg.n_layers
        # `buffers.recycled` (aligned for the graphs' kernels): pages are only committed when a chunk writes them, so a
        # cache sized for the whole context costs memory in proportion to what is used; a dropped cache's mappings
        # serve the next one of its size, without committing their pages again
        self.k = buffers.recycled((cfg.n_layers, cfg.n_kv_heads, capacity, cfg.head_dim), dtype)
        self.v = buffers.recycled(self.k.shape, dtype)
        self._length = 0

    @property
    def length(self) -> int:
        """Positions 0..length-1 hold real tokens (moved only by the verbs below)."""
        return self._length

    def fork(self) -> "KVCache":
        """An independent copy (same capacity, the valid positions copied): prefill into one, keep the other."""
        twin = KVCache(self.config, self.capacity, self.k.dtype, self.full_history)
        twin.copy_of(self)
        return twin

    def copy_of(self, src: "KVCache") -> None:
        """Hold what `src` (same layout) holds: its committed positions of every layer, its windowed layers' bases."""
        if src.k.shape[:2] != self.k.shape[:2] or src.k.shape[3] != self.k.shape[3] or src.windows != self.windows:
            raise ConfigError("copy_of: the caches differ in layout")
        self.reserve(src.length - self._length)
        for layer in range(self.config.n_layers):
            b = src.base(layer)
            self.k[layer, :, : src.length - b] = src.k[layer, :, : src.length - b]
            self.v[layer, :, : src.length - b] = src.v[layer, :, : src.length - b]
            self._base[layer], self._high[layer] = b, src.length - b
        self._length = src.length

    def base(self, layer: int) -> int:
        """The position that row 0 of `layer` holds (0 unless the layer keeps only its window): position p is row
        p - base of `layer`'s views."""
        return self._base[layer]

    def place(self, layer: int, start: int, n: int) -> int:
        """Make room in `layer` for positions start..start+n-1 (about to be written, as rows start - base..), whose
        queries read back to start - W + 1; returns the layer's base. A windowed layer moves its last W - 1
        positions before `start` to row 0 when its rows in use would pass W - 1 + max(n, ROOM)."""
        w = self.windows[layer]
        return self._place(layer, max(0, start - w + 1) if w else 0, start, n)

    def _place(self, layer: int, lo: int, start: int, n: int) -> int:
        """Keep positions lo..start-1 of `layer`, make room for start..start+n-1; returns its base."""
        w, b = self.windows[layer], self._base[layer]
        if lo < start and lo < b:
            raise ConfigError(f"layer {layer} keeps positions from {b} on (window {w}): positions from {lo} are "
                              f"gone (roll back or continue only within the window)")
        if w and (start < b or start + n - b > w - 1 + max(n, ROOM)):
            keep = start - lo
            if keep:  # the last positions before `start` that its queries read, back to row 0
                for t in (self.k, self.v):
                    t[layer, :, :keep] = t[layer, :, lo - b : start - b].copy()
            self._base[layer] = b = lo
        if start + n - b > self.capacity:
            raise ConfigError(f"positions up to {start + n} exceed the cache capacity {self.capacity}")
        self._high[layer] = max(self._high[layer], start + n - b)
        return b

    def resumable(self, length: int) -> bool:
        """Whether the cache can continue from `length` (0 <= length <= self.length): every windowed layer still
        holds the positions a query at `length` reads (`truncate` to it is allowed)."""
        return 0 <= length <= self._length and all(
            b <= max(0, length - w + 1) for w, b in zip(self.windows, self._base) if w)

    def held_bytes(self) -> int:
        """Bytes of K/V rows the cache has written (the memory it holds): every layer's most rows in use."""
        return 2 * sum(self._high) * self.config.n_kv_heads * self.config.head_dim * self.k.itemsize

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Whole-capacity views [n_kv, capacity, D] of one layer: attention writes and reads through these."""
        return self.k[layer], self.v[layer]

    def keys_values(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The valid part [n_kv, length, D] of one layer (views, no copy); refused for a windowed layer that no
        longer holds position 0 (`full_history` keeps it)."""
        if self._base[layer]:
            raise ConfigError(f"layer {layer} keeps only its window of {self.windows[layer]} positions (from "
                              f"{self._base[layer]} on): its earlier K/V are gone (a cache with full_history keeps them)")
        return self.k[layer, :, : self.length], self.v[layer, :, : self.length]

    def reserve(self, n_new: int) -> None:
        """Make room for `n_new` more positions; grows (one copy) only if the capacity is exceeded."""
        need = self.length + n_new
        if need <= self.capacity:
            return
        if need > self.config.context_length:
            raise ConfigError(
                f"prompt: {self.length} cached + {n_new} new tokens exceed the model's context length "
                f"{self.config.context_length}"
            )
        grown = min(self.config.context_length, max(need, 2 * self.capacity))
        k = buffers.recycled((*self.k.shape[:2], grown, self.k.shape[3]), self.k.dtype)
        v = buffers.recycled(k.shape, k.dtype)
        for layer, b in enumerate(self._base):  # the rows in use of each layer (a windowed one's: its window)
            rows = max(0, self.length - b)
            k[layer, :, :rows] = self.k[layer, :, :rows]
            v[layer, :, :rows] = self.v[layer, :, :rows]
        self.k, self.v = k, v

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (e.g. to roll back a turn)."""
        if not 0 <= length <= self.length:
            raise ConfigError(f"truncate length must be in [0, {self.length}], got {length}")
        if not self.resumable(length):
            raise ConfigError(f"cannot roll back to {length}: the windowed layers keep positions from "
                              f"{max(self._base)} on (`KVCache.resumable`)")
        self._length = length

    def advance(self, n: int) -> None:
        """Commit `n` rows already written at positions length..length+n-1 (a prefill, a decode step)."""
        if n < 0 or self._length + n > self.capacity:
            raise ConfigError(f"advance by {n} from {self._length}: must be >= 0 and stay within the capacity "
                              f"{self.capacity}")
        self._length += n

    def keep_rows(self, start: int, rows: list[int]) -> None:
        """Move rows start+rows[i] to start+i in every layer (the accepted path of a verified token tree)."""
        if rows != list(range(len(rows))):
            for b in set(self._base):  # layers with one base at a time (usually: the global, the windowed ones)
                layers = [i for i, x in enumerate(self._base) if x == b]
                every = len(layers) == len(self._base)
                idx = np.asarray(rows, dtype=np.int64) + start - b
                for t in (self.k, self.v):
                    if every:
                        t[:, :, start - b : start - b + len(rows)] = t[:, :, idx]
                    else:
                        for layer in layers:
                            t[layer, :, start - b : start - b + len(rows)] = t[layer, :, idx]

    def accept_path(self, rows: list[int]) -> None:
        """A verified token tree was written from position `length`: keep its accepted path `rows` (tree
        nodes, root first) as the next len(rows) positions and commit them."""
        start = self._length
        self.keep_rows(start, rows)
        self.advance(len(rows))

    def read_span(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of positions [a, b) of every layer, [L, n_kv, b-a, D] each; only committed positions."""
        if not 0 <= a <= b <= self._length:
            raise ConfigError(f"read_span [{a}, {b}) must lie within the {self._length} committed positions")
        if a < max(self._base):
            raise ConfigError(f"read_span from {a}: the windowed layers keep positions from {max(self._base)} on "
                              f"(a cache with full_history keeps them all)")
        if not any(self._base):
            return self.k[:, :, a:b].copy(), self.v[:, :, a:b].copy()
        k = np.stack([self.k[i, :, a - x : b - x] for i, x in enumerate(self._base)])
        v = np.stack([self.v[i, :, a - x : b - x] for i, x in enumerate(self._base)])
        return k, v

    def write_span(self, a: int, k: np.ndarray, v: np.ndarray) -> None:
        """Copy K/V [L, n_kv, n, D] into positions [a, a+n) and commit up to there; `a` must not leave a gap
        (a <= length), and positions past a+n are forgotten (the cache holds a prefix)."""
        n = k.shape[2]
        if not 0 <= a <= self._length:
            raise ConfigError(f"write_span at {a} would leave a gap after the {self._length} committed positions")
        self.reserve(a + n - self._length)
        end = a + n
        for layer, w in enumerate(self.windows):
            # a windowed layer keeps what a query at `end` reads: earlier positions from end - W + 1, the span's
            # last W - 1
            lo = max(0, end - w + 1) if w else 0
            first = max(a, lo)
            b = self._place(layer, lo, first, end - first)
            self.k[layer, :, first - b : end - b] = k[layer, :, first - a :]
            self.v[layer, :, first - b : end - b] = v[layer, :, first - a :]
        self._length = end

    def nbytes(self, tokens: int | None = None) -> int:
        """Bytes of K/V for `tokens` positions (default: the committed ones)."""
        n = self._length if tokens is None else tokens
        return 2 * self.config.n_layers * self.config.n_kv_heads * n * self.config.head_dim * self.k.itemsize


def check_cache(cache: object, cfg: ModelConfig, dtype: np.dtype | type = np.float32) -> KVCache:
    """`cache` if it is a KVCache that fits a runtime of `cfg` (layout and dtype, not only the type);
    else a ConfigError saying what came and what was needed."""
    if not isinstance(cache, KVCache):
        raise ConfigError(f"cache must be a hetero.KVCache (Runtime.new_cache() or a PrefillResult.cache), "
                          f"got {type(cache).__name__}")
    want = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, np.dtype(dtype))
    got = (cache.k.shape[0], cache.k.shape[1], cache.k.shape[3], cache.k.dtype)
    if got != want:
        raise ConfigError(f"cache is from another model or runtime: {got[0]} layers x {got[1]} KV heads x "
                          f"{got[2]} dims {got[3]}, this runtime needs {want[0]} x {want[1]} x {want[2]} {want[3]}")
    return cache
