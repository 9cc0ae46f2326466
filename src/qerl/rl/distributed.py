"""Moved to qerl.train.distributed (the training shell under rl/ and sft/); this name is that same module."""
import sys

from ..train import distributed as _moved

sys.modules[__name__] = _moved
