"""Hot-channel weight store (mllm-NPU §3.3, "Most outliers tend to appear in a small set of channel positions").

The shadow needs the float weight rows W_deq[:, c] of a site's outlier channels c. Only the hot channels'
rows stay in RAM; any other row is read on demand from a memory-mapped float32 file under the model's
cache entry (data and index written atomically under the entry's lock, with a content record checked at
first use: a damaged store is rebuilt with a warning). Layout: docs/design.md, "Outliers".
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hetero.errors import GraphCacheError
from hetero.outliers.plan import QuantPlan
from hetero.outliers.shadow import site_rows
from hetero.paths import atomic_path, cache_dir, entry_lock, forget, verify, write_record

log = logging.getLogger(__name__)

STORE_VERSION = 1


@dataclass(slots=True)
class StoreStats:
    """Row lookups served from RAM (hits) and from the disk file (misses)."""

    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else float("nan")


def _store_name(plan: QuantPlan) -> str:
    # the rows are the *dequantized* weights, so the key holds the weight granularity, range and scales
    # too (per-tensor/per-channel and 7/8-bit plans with the same shadow sites must not share a file)
    keys = ",".join(f"{l}/{s}" for l, s in plan.shadow_sites())
    qmax = getattr(plan, "weight_qmax", 127)
    h = hashlib.sha256(f"{STORE_VERSION}|{plan.model_fingerprint}|{plan.weight_granularity}|q{qmax}|{keys}".encode())
    for key in sorted(plan.weights):
        w = plan.weights[key]
        h.update(np.asarray(getattr(w, "scales", getattr(w, "scale", 0.0)), np.float32).tobytes())
    return h.hexdigest()[:12]


class HotChannelStore:
    """`ShadowRows` that keeps hot rows in RAM and reads the others from a memory-mapped file."""

    def __init__(self, plan: QuantPlan, directory: str | Path | None = None):
        self.plan = plan
        directory = Path(directory) if directory is not None else cache_dir() / "models" / plan.model_fingerprint
        stem = f"shadow_rows-{_store_name(plan)}"
        self.data_path, self.index_path = directory / f"{stem}.f32", directory / f"{stem}.json"
        names = [self.data_path.name, self.index_path.name]
        if verify(directory, names):
            try:
                with entry_lock(directory):
                    bad = verify(directory, names)  # another process may have written it meanwhile
                    if bad:
                        if self.data_path.exists() or self.index_path.exists():
                            log.warning("hot-channel store %s: %s; rebuilding it", self.data_path,
                                        "; ".join(map(str, bad)))
                        forget(directory, names)
                        self._write()
                        write_record(directory, names)
            except OSError as e:
                forget(directory, names)
                raise GraphCacheError(f"hot-channel store {self.data_path} cannot be written: {e.strerror or e}") from e
        index = json.loads(self.index_path.read_text())
        if index.get("version") != STORE_VERSION or self.data_path.stat().st_size != index["size_bytes"]:
            raise GraphCacheError(f"hot-channel store {self.data_path} is stale or truncated; delete it to rebuild")
        self._mm = np.memmap(self.data_path, dtype=np.float32, mode="r")
        self._where: dict[tuple[int, str], tuple[int, int, int]] = {
            (e["layer"], e["site"]): (e["offset"], e["in"], e["out"]) for e in index["sites"]}
        self._hot: dict[tuple[int, str], tuple[np.ndarray, torch.Tensor]] = {}
        for key in plan.shadow_sites():
            off, n_in, n_out = self._where[key]
            hot = np.array(plan.sites[key].hot_channels, dtype=np.int64)
            slot = np.full(n_in, -1, dtype=np.int64)  # channel -> row in the RAM block, -1 = on disk
            slot[hot] = np.arange(hot.size)
            block = self._site(off, n_in, n_out)[hot] if hot.size else np.zeros((0, n_out), np.float32)
            self._hot[key] = (slot, torch.from_numpy(np.ascontiguousarray(block)))
        self.stats = StoreStats()

    def _write(self) -> None:
        entries, offset = [], 0
        with atomic_path(self.data_path) as tmp, open(tmp, "wb") as f:
            for layer, site in self.plan.shadow_sites():
                rows = site_rows(self.plan, layer, site).numpy()
                f.write(rows.tobytes())
                entries.append({"layer": layer, "site": site, "offset": offset, "in": rows.shape[0], "out": rows.shape[1]})
                offset += rows.size
        index = {"version": STORE_VERSION, "model_fingerprint": self.plan.model_fingerprint, "sites": entries,
                 "size_bytes": offset * 4}
        with atomic_path(self.index_path) as tmp:
            tmp.write_text(json.dumps(index))

    def _site(self, offset: int, n_in: int, n_out: int) -> np.ndarray:
        return self._mm[offset : offset + n_in * n_out].reshape(n_in, n_out)

    def rows(self, layer: int, site: str, channels: torch.Tensor) -> torch.Tensor:
        """W_deqᵀ rows [k, Σout] of `channels`: hot ones from RAM, the others from the mmap file."""
        slot, block = self._hot[(layer, site)]
        ch = channels.numpy()
        pos = slot[ch]
        hot = pos >= 0
        self.stats.hits += int(hot.sum())
        self.stats.misses += int((~hot).sum())
        if hot.all():
            return block[torch.from_numpy(pos)]
        off, n_in, n_out = self._where[(layer, site)]
        out = np.empty((ch.size, n_out), dtype=np.float32)
        out[hot] = block.numpy()[pos[hot]]
        out[~hot] = self._site(off, n_in, n_out)[ch[~hot]]  # page-ins of cold rows (§3.3: rare)
        return torch.from_numpy(out)

    # -------------------------------------------------------------------------------- memory
    def ram_bytes(self) -> int:
        """Float weight rows held in RAM by this store."""
        return sum(block.numel() * 4 for _, block in self._hot.values())

    def full_copy_bytes(self) -> int:
        """What a full float copy of the same sites' weights would hold (the paper's baseline)."""
        return sum(n_in * n_out * 4 for (_, n_in, n_out) in self._where.values())
