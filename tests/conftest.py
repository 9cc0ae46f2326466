import os
import sys
from pathlib import Path

import torch as _torch

# Without a GPU, Triton kernels run in its interpreter; it must be chosen before any kernel is defined.
if not _torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference_ct.py, tiny_models.py


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
