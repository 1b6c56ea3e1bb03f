"""The torch.nn twin of a pyhet network, for the tests that compare the two (import it only
after pytest.importorskip("torch")).

The modules carry the names of pyhet's weight files (conv1..convN, fc1..fcM, fc), so a weight
file loads with a strict load_state_dict and no reshaping.
"""

from contextlib import contextmanager

import numpy as np
import torch

WEIGHT_RTOL = 1e-4    # each weight within 1e-4 of its parameter's largest entry


class TorchNet(torch.nn.Module):
    """conv blocks (Conv2d -> ReLU -> optional MaxPool2d) -> flatten -> (Linear -> ReLU)* ->
    Linear, as the pyhet.geometry.NetGeometry `shape` describes."""

    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        for g in shape.blocks:
            setattr(self, g.name, torch.nn.Conv2d(g.C, g.K, (g.R, g.S), stride=g.stride,
                                                  padding=g.pad))
        for name, f_in, f_out in shape.fc_layers():
            setattr(self, name, torch.nn.Linear(f_in, f_out))

    def forward(self, x):
        F = torch.nn.functional
        for g in self.shape.blocks:
            x = F.relu(getattr(self, g.name)(x))
            if g.has_pool:
                x = F.max_pool2d(x, g.pool, g.pool_stride)
        x = torch.flatten(x, 1)
        for name, _, _ in self.shape.fc_layers()[:-1]:
            x = F.relu(getattr(self, name)(x))
        return self.fc(x)


def torch_model(shape, params):
    """The torch model holding `params` (float32 arrays in PyTorch's layout; other entries of
    a weight file, such as its "arch" string, are left out), loaded strictly and without
    reshaping."""
    model = TorchNet(shape)
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in params.items()
                           if np.asarray(v).dtype == np.float32}, strict=True)
    return model


def torch_params(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@contextmanager
def torch_settings():
    """One thread, float32, deterministic kernels; restored afterwards."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)


def torch_step(model, opt, x, y):
    """One SGD step; returns (logits before the step, loss) as NumPy."""
    opt.zero_grad()
    logits = model(torch.from_numpy(x))
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y), reduction="mean")
    loss.backward()
    opt.step()
    return logits.detach().numpy().copy(), loss.item()


def assert_close_weights(got, want, where=""):
    """max |got - want| <= WEIGHT_RTOL * max |want|, for every parameter, in the same order."""
    assert list(got) == list(want)
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == np.float32, (where, k)
        scale = float(np.abs(want[k]).max())
        err = float(np.abs(got[k].astype(np.float64) - want[k]).max())
        assert err <= WEIGHT_RTOL * scale, f"{where} {k}: max error {err:.3g}, max |w| {scale:.3g}"
