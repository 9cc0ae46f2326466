"""Moved to qerl.train.checkpoints (the training shell under rl/ and sft/); this name is that same module."""
import sys

from ..train import checkpoints as _moved

sys.modules[__name__] = _moved
