"""What a caller asks of a decode (`SamplingParams`) and what it gets back (`TokenEvent`, `Generation`).

The interface `hetero.serve` builds on; validated at the edge with
`ConfigError`, one line naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hetero.errors import ConfigError
from hetero.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; stop_token_ids None = the model's EOS / end-of-turn ids."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= float(self.temperature) <= 100.0:
            raise ConfigError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < float(self.top_p) <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer or None, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ConfigError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
                raise ConfigError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token as streamed: its id, the text it adds (may be "" while held back), its index."""

    token_id: int
    text: str
    index: int


@dataclass(frozen=True, slots=True)
class Generation:
    """A finished decode. `cache` is the prefill's cache, extended in place (all but the last token's K/V)."""

    tokens: tuple[int, ...]
    text: str
    finish_reason: Literal["stop", "length"]
    cache: KVCache
    decode_ms: float
    tokens_per_s: float
    accepted: int = 0  # draft tokens the target accepted
    drafted: int = 0  # draft tokens the target verified
    steps: int = 0  # target forward passes (one per token without speculation)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0
