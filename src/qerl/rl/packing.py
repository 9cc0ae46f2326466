"""Moved to qerl.train.packing; kept only for bench/'s imports until they point there (issue 48: then delete)."""
import sys

from ..train import packing as _moved

sys.modules[__name__] = _moved
