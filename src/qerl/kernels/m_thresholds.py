"""The token counts (M, the rows of an activation) that pick a kernel path: the one table.

Each kernel module reads its bound from here under its old name (w4_mma.MAX_M, moe_gemv.MAX_TOKENS, ...),
so a change of route is one line of this file; the figures that chose each are beside it.
"""

# dense 4-bit layers (kernels/mma_backend.py routes by M, humming's measured buckets aside)
W4_MMA_MAX_M = 64          # mma.sync, decode in registers, up to here; above, dequantize + cuBLAS (bench kernels)
W4_WGMMA_MIN_M = 9         # the Hopper wgmma kernel's smallest and largest M (its token tiles, w4_wgmma.TUNING)
W4_WGMMA_MAX_M = 256
# layers route M >= this (and <= W4_WGMMA_MAX_M) to wgmma, below it to mma.sync: on the H100, the 7B layer set
# took 159.7 µs there against 179.3 through mma.sync at M = 64, but 127.4 against 114.9 at M = 32
W4_WGMMA_ROUTE_MIN_M = 64
TRITON_FUSED_MAX_M = 16    # the Triton fused decode kernel beats dequantize + cuBLAS up to here (H200 sweep)
LORA_SHRINK_MAX_M = 16     # the LoRA shrink GEMV kernel (decode batches; also K <= 4096)
LORA_SHRINK_SPLIT_MAX_M = 256  # the split-K LoRA shrink's tiles reach this M (kernel capability, tested to here)
# ... and routes take it for M in [MIN, MAX] only. The shrink bench on the H100 at 3632e89 (scripts/profile_decode.py
# --shrink; the run's log was not kept, the figures are the session's notes): at M 1 the one-row kernel ran
# 3.1-4.3 µs a projection against split-K's 4.8-6.6; at M 16 split-K 5.0-6.7 against cuBLAS's 7.2-7.6, at M 64
# (down) 10.5 against 37.6; at M 128-256 cuBLAS 7.5-8.3 against split-K's 8-11 for q|k|v and down. To re-measure
# at the next GPU session (STEP=profile SHRINK=1 bash scripts/device.sh).
LORA_SHRINK_SPLIT_ROUTE_MIN_M = 2
LORA_SHRINK_SPLIT_ROUTE_MAX_M = 64

# MoE experts (kernels/experts_path.py)
MOE_GEMV_MAX_TOKENS = 64   # the grouped 4-bit GEMV: decode batches; above, the grouped path dequantizes the hit
                           # experts once each anyway (H100, Qwen3-30B-A3B layer: 0.98 ms at 64 tokens vs 102.4)
