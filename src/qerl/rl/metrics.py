"""Moved to qerl.train.metrics (the training shell under rl/ and sft/); this name is that same module."""
import sys

from ..train import metrics as _moved

sys.modules[__name__] = _moved
