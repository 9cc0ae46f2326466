"""Constants shared by the Triton decode and its host side (importable without Triton)."""

ASM_SHIFT = 7  # the PTX decode yields code·scale·2^-ASM_SHIFT for NVFP4; the epilogue multiplies it back
