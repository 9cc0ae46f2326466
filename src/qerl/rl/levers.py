"""Moved to qerl.train.levers (the training shell under rl/ and sft/); this name is that same module."""
import sys

from ..train import levers as _moved

sys.modules[__name__] = _moved
