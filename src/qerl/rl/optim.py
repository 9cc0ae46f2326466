"""Moved to qerl.train.optim (the training shell under rl/ and sft/); this name is that same module."""
import sys

from ..train import optim as _moved

sys.modules[__name__] = _moved
