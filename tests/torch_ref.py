"""The torch.nn twin of a pyhet network, for the tests that compare the two (import it only
after pytest.importorskip("torch")).

The modules carry the names of pyhet's weight files (conv1..convN, fc1..fcM, fc), so a weight
file loads with a strict load_state_dict and no reshaping.
"""

import numpy as np
import torch


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
