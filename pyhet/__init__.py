"""pyhet: train CNNs with each conv layer's kernels split across heterogeneous devices.

    import pyhet
    with pyhet.Network("32C5-P2-64C5-P2", input_shape=(1, 28, 28), num_classes=10,
                       devices="cpu:1,cpu:1") as net:
        net.fit(x, y, steps=300)
        probs = net.predict(x_test)
        net.save("w.npz")
    net = pyhet.load("w.npz", devices="cpu:1")

See README.md for the network notation, the device SPEC and the weight files.
"""

from . import errors, ops
from .api import Network, load
from .data import Dataset, load_dataset

__version__ = "0.1.0"
__all__ = ["Network", "load", "load_dataset", "Dataset", "errors", "ops", "__version__"]
