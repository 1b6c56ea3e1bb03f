"""Using a trained network: class probabilities, and the loss and accuracy on labelled images.

Images go through the network in batches of the size the caller gives (training passes its own
batch, the memory the devices were sized for; Network.predict 256, Network.evaluate 64), each
prepared as it comes. Letters: x (N, C, H, W), y (N,) labels, M classes.
"""

from __future__ import annotations

import numpy as np

from .backends import numpy_ref as ref


def logits(net, x, batch_size: int, prepare=None):
    """x (N, C, H, W) float32 -> logits (N, M) float32, batch by batch; prepare(xb, first):
    each batch (its first image's index) as the network's input, where x is not that yet."""
    out = np.empty((len(x), net.shape.num_classes), np.float32)
    for first in range(0, len(x), batch_size):
        xb = x[first:first + batch_size]
        out[first:first + len(xb)] = net.forward(xb if prepare is None else prepare(xb, first))
    return out


def probabilities(net, x, batch_size: int, prepare=None):
    """x (N, C, H, W) -> softmax probabilities (N, M) float32; each row sums to 1."""
    return ref.softmax(logits(net, x, batch_size, prepare)).astype(np.float32)


def evaluate(net, x, y, batch_size: int) -> dict:
    """The mean cross-entropy loss, the accuracy and the accuracy of each class (None for a
    class with no image) on x (N, C, H, W) with labels y (N,)."""
    return score(logits(net, x, batch_size), y, net.shape.num_classes)


def score(z, y, M: int) -> dict:
    """evaluate() of logits z (N, M) already computed, with labels y (N,)."""
    y = np.asarray(y)
    with np.errstate(over="ignore", invalid="ignore"):   # overflowing logits: the loss says so
        loss, _ = ref.softmax_cross_entropy(z.astype(np.float64), y)
    pred = z.argmax(axis=1)
    right = pred == y
    per_class = []
    for c in range(M):
        n = int((y == c).sum())
        per_class.append(float(right[y == c].mean()) if n else None)
    return {"loss": float(loss), "accuracy": float(right.mean()) if len(y) else None,
            "per_class_accuracy": per_class, "images": int(len(y))}
