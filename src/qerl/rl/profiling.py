"""Moved to qerl.train.profiling (the training shell under rl/ and sft/); this name is that same module."""
import sys

from ..train import profiling as _moved

sys.modules[__name__] = _moved
