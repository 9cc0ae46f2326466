"""Moved to qerl.train.sampler (the training shell under rl/ and sft/); this name is that same module."""
import sys

from ..train import sampler as _moved

sys.modules[__name__] = _moved
