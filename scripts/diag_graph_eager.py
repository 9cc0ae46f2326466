"""Which kernel choice makes CUDA-graph decode differ from eager decode (tests/test_rollout_gpu.py's first
nvfp4 check) on this card: the test under the default KernelSettings and with one choice switched off at a time.
Usage: python3 scripts/diag_graph_eager.py default|nolora|nohumming"""
import sys

import pytest

sys.path.insert(0, "src")
from qerl.kernels import settings  # noqa: E402

OFF = {"default": {}, "nolora": dict(lora_shrink_split=False, lora_expand_kernel=False), "nohumming": dict(humming=False)}
settings._CURRENT.set(settings.KernelSettings(**OFF[sys.argv[1]]))
sys.exit(pytest.main(["-q", "-x", "-p", "no:cacheprovider", "--tb=line", "tests/test_rollout_gpu.py", "-k",
                      "graphs_equal_eager and nvfp4"]))
