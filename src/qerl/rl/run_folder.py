"""Moved to qerl.train.run_folder (the training shell under rl/ and sft/); this name is that same module."""
import sys

from ..train import run_folder as _moved

sys.modules[__name__] = _moved
