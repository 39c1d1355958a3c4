"""The KV cache: preallocated once, written chunk by chunk through views (Transformer-Lite §2.4).

Per layer l: k[l], v[l] are [n_kv, capacity, D]; positions 0..length-1 hold real tokens. Chunk i writes
rows [start, start + n_valid) in place (padded rows never); attention reads through `layer(l)` views and
the runtime advances `length` once a whole prefill has finished.
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
        self.length = 0

    def fork(self) -> "KVCache":
        """An independent copy (same capacity, the valid positions copied): prefill into one, keep the other."""
        twin = KVCache(self.config, self.capacity, self.k.dtype)
        twin.k[:, :, : self.length] = self.k[:, :, : self.length]
        twin.v[:, :, : self.length] = self.v[:, :, : self.length]
        twin.length = self.length
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
        self.length = length

    @torch.inference_mode()
    def keep_rows(self, start: int, rows: list[int]) -> None:
        """Move rows start+rows[i] to start+i in every layer (the accepted path of a verified token tree)."""
        if rows != list(range(len(rows))):
            idx = torch.tensor(rows, dtype=torch.long) + start
            self.k[:, :, start : start + len(rows)] = self.k[:, :, idx]
            self.v[:, :, start : start + len(rows)] = self.v[:, :, idx]

    def nbytes_used(self) -> int:
        return 2 * self.k[:, :, : self.length].numel() * self.k.element_size()


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
