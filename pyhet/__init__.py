"""pyhet: train CNNs with each conv layer's kernels split across heterogeneous devices."""

from . import ops

__version__ = "0.1.0"
__all__ = ["ops", "__version__"]
