"""The KV cache: preallocated once, written chunk by chunk through views (Transformer-Lite §2.4).

Per layer l: k[l], v[l] are [n_kv, capacity, D]; positions 0..length-1 hold real tokens. Chunk i writes
rows [start, start + n_valid) in place (padded rows never); attention reads through `layer(l)` views.

The cache owns its rules: `length` is read-only, and only its verbs move it: `advance` (a prefill or a
decode step committed rows written past the end), `accept_path` (the accepted path of a verified token
tree), `write_span` (a restore copied K/V in), `truncate` (roll back). `read_span` copies positions out.
"""

from __future__ import annotations

import torch

from hetero.config import ModelConfig
from hetero.errors import ConfigError


class KVCache:
    """K/V of every layer for one conversation; `length` real positions, room for `capacity`."""

    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype = torch.float32):
        if capacity <= 0:
            raise ConfigError(f"KV cache capacity must be > 0, got {capacity}")
        self.config = cfg
        # torch.empty: pages are only committed when a chunk writes them, so a cache sized for the
        # whole context costs memory in proportion to what is used.
        self.k = torch.empty(cfg.n_layers, cfg.n_kv_heads, capacity, cfg.head_dim, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self._length = 0

    @property
    def length(self) -> int:
        """Positions 0..length-1 hold real tokens (moved only by the verbs below)."""
        return self._length

    def fork(self) -> "KVCache":
        """An independent copy (same capacity, the valid positions copied): prefill into one, keep the other."""
        twin = KVCache(self.config, self.capacity, self.k.dtype)
        twin.write_span(0, self.k[:, :, : self.length], self.v[:, :, : self.length])
        return twin

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole-capacity views [n_kv, capacity, D] of one layer: attention writes and reads through these."""
        return self.k[layer], self.v[layer]

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The valid part [n_kv, length, D] of one layer (views, no copy)."""
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
        k = torch.empty(*self.k.shape[:2], grown, self.k.shape[3], dtype=self.k.dtype)
        v = torch.empty_like(k)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (e.g. to roll back a turn)."""
        if not 0 <= length <= self.length:
            raise ConfigError(f"truncate length must be in [0, {self.length}], got {length}")
        self._length = length

    def advance(self, n: int) -> None:
        """Commit `n` rows already written at positions length..length+n-1 (a prefill, a decode step)."""
        if n < 0 or self._length + n > self.capacity:
            raise ConfigError(f"advance by {n} from {self._length}: must be >= 0 and stay within the capacity "
                              f"{self.capacity}")
        self._length += n

    @torch.inference_mode()
    def keep_rows(self, start: int, rows: list[int]) -> None:
        """Move rows start+rows[i] to start+i in every layer (the accepted path of a verified token tree)."""
        if rows != list(range(len(rows))):
            idx = torch.tensor(rows, dtype=torch.long) + start
            self.k[:, :, start : start + len(rows)] = self.k[:, :, idx]
            self.v[:, :, start : start + len(rows)] = self.v[:, :, idx]

    def accept_path(self, rows: list[int]) -> None:
        """A verified token tree was written from position `length`: keep its accepted path `rows` (tree
        nodes, root first) as the next len(rows) positions and commit them."""
        start = self._length
        self.keep_rows(start, rows)
        self.advance(len(rows))

    def read_span(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of positions [a, b) of every layer, [L, n_kv, b-a, D] each; only committed positions."""
        if not 0 <= a <= b <= self._length:
            raise ConfigError(f"read_span [{a}, {b}) must lie within the {self._length} committed positions")
        return self.k[:, :, a:b].clone(), self.v[:, :, a:b].clone()

    @torch.inference_mode()
    def write_span(self, a: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy K/V [L, n_kv, n, D] into positions [a, a+n) and commit up to there; `a` must not leave a gap
        (a <= length), and positions past a+n are forgotten (the cache holds a prefix)."""
        n = k.shape[2]
        if not 0 <= a <= self._length:
            raise ConfigError(f"write_span at {a} would leave a gap after the {self._length} committed positions")
        self.reserve(a + n - self._length)
        self.k[:, :, a : a + n] = k
        self.v[:, :, a : a + n] = v
        self._length = a + n

    def nbytes(self, tokens: int | None = None) -> int:
        """Bytes of K/V for `tokens` positions (default: the committed ones)."""
        n = self._length if tokens is None else tokens
        return 2 * self.config.n_layers * self.config.n_kv_heads * n * self.config.head_dim * self.k.element_size()


def check_cache(cache: object, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> KVCache:
    """`cache` if it is a KVCache that fits a runtime of `cfg` (layout and dtype, not only the type);
    else a ConfigError saying what came and what was needed."""
    if not isinstance(cache, KVCache):
        raise ConfigError(f"cache must be a hetero.KVCache (Runtime.new_cache() or a PrefillResult.cache), "
                          f"got {type(cache).__name__}")
    want = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype)
    got = (cache.k.shape[0], cache.k.shape[1], cache.k.shape[3], cache.k.dtype)
    if got != want:
        raise ConfigError(f"cache is from another model or runtime: {got[0]} layers x {got[1]} KV heads x "
                          f"{got[2]} dims {got[3]}, this runtime needs {want[0]} x {want[1]} x {want[2]} {want[3]}")
    return cache
