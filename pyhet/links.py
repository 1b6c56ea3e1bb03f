"""What a device's link to the master costs per step: the communication part of the cost model.

A device on another rank receives the layer input and returns its output slice (forward), then
receives its slice of the output gradient and returns its part of the input gradient (backward),
then gets the update's settings: three round trips a layer and step. So the link costs a fixed
part, whatever the device's share (the input x, and the input gradient dx of the same size where
the layer needs one, and six message latencies), and a part that grows with its kernels (each
kernel's output slice and its gradient). With a device's compute t(k) = overhead + k / speed,
its time for a layer over its link is

    t(k) = (overhead + fixed_bytes / bandwidth + 6 latency) + k (1 / speed + bytes_per_kernel / bandwidth)

which keeps the form overhead + k / speed that the partition minimises.

The links of several ranks are taken as independent, each at its rate with every rank's bytes
moving at once, one way at a time, where that is lower
(pyhet.transport.mpi.MasterLink.measure_links): their bytes may cross the master's one network
interface, which is not modelled beyond that.

Letters as in pyhet.geometry; N is the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

from .geometry import ConvGeometry

MESSAGES_PER_LAYER = 6   # forward, backward and update: a request and a reply each
FORWARD_MESSAGES = 2     # of which the forward's


@dataclass(frozen=True)
class Link:
    """A link as measured: one-way latency (s) and bandwidth (bytes/s; None when the measurement
    could not resolve it, a link too fast for the message size: its bytes are taken as free)."""
    latency_s: float
    bandwidth_bytes_per_s: float | None

    def seconds(self, nbytes: float, messages: int = 0) -> float:
        """Time to move nbytes in `messages` messages."""
        moving = 0.0 if not self.bandwidth_bytes_per_s else nbytes / self.bandwidth_bytes_per_s
        return messages * self.latency_s + moving


def link_cost(link: Link, g: ConvGeometry, N: int, need_dx: bool) -> tuple[float, float]:
    """(fixed seconds, seconds per kernel) of layer g's traffic over `link` in one step."""
    fixed, per_kernel = g.link_bytes(N, need_dx)
    return link.seconds(fixed, MESSAGES_PER_LAYER), link.seconds(per_kernel)


def link_phase_cost(link: Link, g: ConvGeometry, N: int, need_dx: bool) -> tuple:
    """link_cost by phase: ((fixed, per kernel) seconds of the forward, (fixed, per kernel) of
    the backward with the update); the phases add up to link_cost."""
    (f_fixed, f_per), (b_fixed, b_per) = g.link_bytes_phases(N, need_dx)
    return ((link.seconds(f_fixed, FORWARD_MESSAGES), link.seconds(f_per)),
            (link.seconds(b_fixed, MESSAGES_PER_LAYER - FORWARD_MESSAGES), link.seconds(b_per)))
