"""Moved to :mod:`fastload.gpu.prefetch`; ``fastload.prefetch`` stays importable: it is that same module."""

import sys

from .gpu import prefetch as _moved

sys.modules[__name__] = _moved
