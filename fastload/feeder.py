"""Moved to :mod:`fastload.gpu.feeder`; ``fastload.feeder`` stays importable: it is that same module."""

import sys

from .gpu import feeder as _moved

sys.modules[__name__] = _moved
