"""qerl: reinforcement learning of LLMs on 4-bit weights (QeRL, arXiv 2510.11696)."""

__version__ = "0.1.0"

import logging as _logging

# bitsandbytes >= 0.50 (imported by peft) looks for a CPU kernel on the Hugging Face hub when it is imported on an
# AVX512-BF16 CPU and logs a warning when it cannot have it (offline, untrusted); qerl never calls bitsandbytes' CPU
# GEMM, so that line is noise on every run's stderr
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
