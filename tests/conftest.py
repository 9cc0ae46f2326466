import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference_ct.py, tiny_models.py


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
