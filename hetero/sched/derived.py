"""A profile derived from mllm-NPU's published figures: Snapdragon 8 Gen 3 (Xiaomi 14), Qwen1.5-1.8B.

Nothing here ran on a phone: every number below is arithmetic on the paper's text plus the stated
assumptions, and the profile says ``method: derived, simulated: true``. `DERIVATION` is stored in the
JSON; hetero/profiles/README.md repeats it. Regenerate with ``python -m hetero.sched.derived``.
"""

from __future__ import annotations

from hetero.paths import PROFILES_DIR
from hetero.sched.profile import CostEntry, Profile, save_profile

# Qwen1.5-1.8B (HF config): 24 layers, hidden 2048, 16 heads x 128 (MHA: 16 KV heads), FFN 5504.
N_LAYERS, HIDDEN, FFN = 24, 2048, 5504
NPU_MS_256 = 315.0  # §3.4: "with a prompt length of 256 ... NPU execution takes 315ms,
CPU_MS_256 = NPU_MS_256 / 2  # about twice that of the CPU"
KV_SHARE_256 = 0.5  # assumption A2 below
SHADOW_SHARE = 0.02  # assumption A3 below
# Assumption A1: NPU per-token latency vs chunk length, relative to C=256 (the qualitative shape of
# Fig. 8: per-token cost falls with C and flattens at 256, the paper's chosen chunk length).
NPU_PER_TOKEN_REL = {32: 2.0, 64: 1.5, 128: 1.2, 256: 1.0, 512: 0.95}
CHUNK_LENS = (32, 64, 128, 256, 512)
KV_POINTS = (1024, 4096, 16384)

DERIVATION = f"""\
Derived from mllm-NPU (arXiv 2407.05858) text; Snapdragon 8 Gen 3 (Xiaomi 14), Qwen1.5-1.8B (24 layers,
hidden 2048, MHA 16x128, FFN 5504), W8A8 linears on the Hexagon NPU, float attention on the CPU.
(1) §3.4: for a 256-token prompt the NPU takes 315 ms, about 2x the CPU -> per layer at C=256 the NPU
    takes 315/24 = 13.125 ms and the CPU 157.5/24 = 6.5625 ms.
(2) NPU time split between `qkv` and `o_ffn` by weight MACs per token: qkv 3*2048^2 = 12.58M,
    o_ffn 2048^2 + 3*2048*5504 = 38.01M -> qkv 24.9% (3.264 ms), o_ffn 75.1% (9.861 ms) at C=256.
(3) CPU time is all in `attn` (RoPE, K/V write, attention, quantize; outliers pruned, §3.3). A1-A3:
    A1 NPU per-token latency relative to C=256: {NPU_PER_TOKEN_REL} (shape of Fig. 8, not its values).
    A2 at C=256, kv_len=256, {KV_SHARE_256:.0%} of `attn` grows with kv_len (QK^T and PV are C*kv*hidden
       MACs each), the rest is per token: attn(C, kv) = a*C + b*C*kv, a*256 = b*256*256 = 3.281 ms.
    A3 `shadow` (kept outlier channels of one layer, §3.3) = {SHADOW_SHARE:.0%} of the per-token CPU part.
(4) Caveat: §4.2 reports >1000 tokens/s at 1024 tokens, faster than (1) allows for the NPU alone
    (4 x 315 ms = 1.26 s); absolute times here follow (1). Schedules depend on the ratios.
"""


def derive_8gen3_profile() -> Profile:
    """Build the derived Snapdragon 8 Gen 3 / Qwen1.5-1.8B profile (see DERIVATION)."""
    npu_layer_us = NPU_MS_256 / N_LAYERS * 1e3
    qkv_macs, offn_macs = 3 * HIDDEN * HIDDEN, HIDDEN * HIDDEN + 3 * HIDDEN * FFN
    qkv_us_256 = npu_layer_us * qkv_macs / (qkv_macs + offn_macs)
    offn_us_256 = npu_layer_us - qkv_us_256
    cpu_layer_us = CPU_MS_256 / N_LAYERS * 1e3
    a_per_token = cpu_layer_us * (1 - KV_SHARE_256) / 256  # µs per query token
    b_per_pair = cpu_layer_us * KV_SHARE_256 / (256 * 256)  # µs per (query, key) pair
    costs = []
    for c in CHUNK_LENS:
        scale = c / 256 * NPU_PER_TOKEN_REL[c]
        costs.append(CostEntry("qkv", "npu", c, ((0, qkv_us_256 * scale),)))
        costs.append(CostEntry("o_ffn", "npu", c, ((0, offn_us_256 * scale),)))
        kvs = sorted({c, *KV_POINTS})
        costs.append(CostEntry("attn", "cpu", c, tuple((kv, a_per_token * c + b_per_pair * c * kv) for kv in kvs)))
        costs.append(CostEntry("shadow", "cpu", c, ((0, SHADOW_SHARE * a_per_token * c),)))
    meta = {
        "device": "Qualcomm Snapdragon 8 Gen 3 (Xiaomi 14): Hexagon NPU + Kryo CPU",
        "backend": {"npu": "QNN HTP (as in the paper)", "cpu": "mllm CPU backend (as in the paper)"},
        "versions": {"paper": "mllm-NPU, arXiv 2407.05858 v1/v2"},
        "date": "2024 (paper); derived 2025",
        "model": {"name": "Qwen1.5-1.8B", "hidden": HIDDEN, "ffn": FFN, "n_heads": 16, "n_kv_heads": 16},
        "derivation": DERIVATION,
        "notes": "simulated: no run on the device produced these numbers",
    }
    return Profile(name="snapdragon_8gen3_qwen1.5-1.8b", method="derived", simulated=True, costs=tuple(costs),
                   n_layers=N_LAYERS, metadata=meta)


if __name__ == "__main__":

    out = PROFILES_DIR / "snapdragon_8gen3_qwen1.5-1.8b.json"
    print(save_profile(derive_8gen3_profile(), out))
