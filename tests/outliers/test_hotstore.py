"""Hot-channel weight store: RAM hits, mmap misses, same rows (hetero/outliers/hotstore.py)."""

from __future__ import annotations

import numpy as np
import torch

from hetero.outliers.hotstore import HotChannelStore
from hetero.weights import SITES
from hetero.outliers.plan import plan_from_scales
from hetero.outliers.shadow import QuantizedBackend, site_rows


def test_hits_misses_and_rows(tiny, tmp_path):
    scales = {(l, s): 0.05 for l in range(2) for s in SITES}
    plan = plan_from_scales(tiny, scales, {(1, "down_in"): (9, 4, 100)})
    # plan_from_scales makes every listed channel hot; keep only channel 9 hot
    from dataclasses import replace

    plan.sites[(1, "down_in")] = replace(plan.sites[(1, "down_in")], n_hot=1)
    store = HotChannelStore(plan, tmp_path)
    assert store.data_path.is_file() and store.index_path.is_file()
    full = site_rows(plan, 1, "down_in")
    got = store.rows(1, "down_in", torch.tensor([9, 100, 4, 0]))
    assert torch.equal(got, full[[9, 100, 4, 0]])
    assert (store.stats.hits, store.stats.misses) == (1, 3)
    assert store.ram_bytes() == full.shape[1] * 4
    assert store.full_copy_bytes() == full.numel() * 4
    # the cold rows really come from the file on disk
    raw = np.fromfile(store.data_path, dtype=np.float32).reshape(full.shape)
    assert np.array_equal(raw, full.numpy())
    # a second store reuses the file
    mtime = store.data_path.stat().st_mtime_ns
    assert HotChannelStore(plan, tmp_path).data_path.stat().st_mtime_ns == mtime


def test_backend_with_store_equals_dense(tiny, ids, tmp_path):
    scales = {(l, s): 0.01 for l in range(2) for s in SITES}
    plan = plan_from_scales(tiny, scales, {k: (3,) for k in scales})
    from hetero.model import forward

    dense = forward(tiny.config, tiny.weights, ids, backend=QuantizedBackend(tiny.config, tiny.weights, plan))[0]
    store = HotChannelStore(plan, tmp_path)
    stored = forward(tiny.config, tiny.weights, ids, backend=QuantizedBackend(tiny.config, tiny.weights, plan, rows=store))[0]
    assert torch.equal(dense, stored)
    assert store.stats.hits > 0 and store.stats.misses > 0


def test_store_file_depends_on_weight_granularity(tiny, tmp_path):
    # the rows are dequantized weights: a per-tensor and a per-channel plan with the same shadow sites
    # must not share a file (they did, and the per-channel path read per-tensor rows)
    scales = {(l, s): 0.05 for l in range(2) for s in SITES}
    shadow = {(1, "down_in"): (9, 4)}
    stores = {wg: HotChannelStore(plan_from_scales(tiny, scales, shadow, weight_granularity=wg), tmp_path)
              for wg in ("channel", "tensor")}
    assert stores["channel"].data_path != stores["tensor"].data_path
    assert HotChannelStore(plan_from_scales(tiny, scales, shadow, weight_qmax=63), tmp_path).data_path \
        != stores["channel"].data_path  # 7-bit (the CPU lane's) vs the default 8-bit weights
    for wg, store in stores.items():
        assert torch.equal(store.rows(1, "down_in", torch.tensor([9, 0])), site_rows(store.plan, 1, "down_in")[[9, 0]])
