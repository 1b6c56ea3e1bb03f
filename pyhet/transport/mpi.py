"""Devices on other MPI ranks, over mpi4py (imported only under mpiexec).

Rank 0 is the master: it runs the training loop and holds, for every device placed on another
rank, a RemoteDevice: a Device whose shard messages (load, read back, drop, forward, backward,
update) travel to that rank and back. Every other rank serves its devices: ordinary Devices with
their own worker threads, whose shards (weights, biases, momentum) stay on that rank for the
whole run. Only arrays travel, as raw buffers (no pickling): a message is one int64 header (the
operation, then each array's dtype and shape) followed by one buffer per non-empty array. Every
reply to a device's request ends with the seconds the device computed for it, so the master can
tell compute from link time.

Routing: the requests of device i go on tag 10 + 2i and its replies on tag 11 + 2i, so the
requests of one device are answered in order and several devices' messages never mix. A serving
rank reads each request whole (header, then its arrays on the same tag) before the next header,
so an any-tag receive always meets a header. At its end the master dismisses every other rank
(tag 9), which waits for that in Python once its devices are closed, or from the start where it
holds none.

Waiting costs no core: waiting for a message to begin (a header) polls a non-blocking request
with short sleeps (MPI implementations busy-poll inside blocking calls, which would take a core
from the devices' threads), each a sixteenth of the time waited so far (20 us to 2 ms), so that
a reply is seen at most about 6% (or 2 ms) after it came. Once a message is under way, its
buffers are polled without sleeping on a fast link, since a large transfer advances only while
both sides call into MPI (MPICH moves it through shared memory in chunks); on a slow one, with
pauses of a small share of the time the transfer should take (see transfer_pause), so that it
does not keep a core. Every wait on the master has a deadline (--timeout), after which the rank
is named in the error.

Letters as in pyhet.geometry.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings

import numpy as np

from ..devices import (Device, SharedCol, gather, group_gradients, make_devices,
                       shared_im2col, shared_input_grad)
from ..errors import DeviceError, UsageError, shown, warn
from ..geometry import ConvGeometry
from ..links import Link
from ..optim import SGDConfig
from ..specs import DeviceSpec, check_threads, compute_threads, for_rank, parse_devices
from ..workers import Worker
from . import DEFAULT_TIMEOUT

try:
    from mpi4py import MPI
except ImportError as e:  # a launcher started us, but this Python has no mpi4py
    raise DeviceError(f"this run was started by mpiexec with several ranks, but mpi4py is not "
                      f"installed ({e}); install it with pip install '.[mpi]' in pyhet's "
                      f"source folder") from None

if MPI.Query_thread() < MPI.THREAD_MULTIPLE:  # devices' worker threads send and receive at once
    raise DeviceError("the MPI library gives no MPI_THREAD_MULTIPLE support, which pyhet's "
                      "devices on other ranks need (MPICH and Open MPI builds have it)")

# ================================================================================================
# Messages: lists of arrays (None travels as an empty slot)

MAX_ARRAYS = 12
HEADER = 2 + 10 * MAX_ARRAYS        # op, count, then (dtype code, ndim, 8 dims) per array
DTYPES = [None, np.float32, np.float64, np.int64, np.int32, np.uint8]
OPS = ("ok", "error", "load", "get", "drop", "forward", "backward", "stage", "free", "close",
       "hello", "reshard", "group_forward", "group_backward", "commit", "bye", "sink", "source")
TAG_HELLO, TAG_ECHO, TAG_BYE, TAG_BASE = 5, 7, 9, 10


def request_tag(device: int) -> int:
    return TAG_BASE + 2 * device


def reply_tag(device: int) -> int:
    return TAG_BASE + 2 * device + 1


def device_of(tag: int) -> int:
    """The device whose requests travel on `tag`."""
    return (tag - TAG_BASE) // 2


def text(s: str) -> np.ndarray:
    return np.frombuffer(s.encode(), np.uint8).copy()


def untext(a) -> str:
    return bytes(np.asarray(a, np.uint8)).decode()


# the largest message measure_links tries where the layer input's moving time is lost in noise
MEASURE_MAX_BYTES = 64 << 20

# Polling a message that may be long in coming: each sleep a share of the time waited so far,
# so that a reply is seen at most that share late (a pause that grew by half each poll saw it
# up to half the wait late: on the default network's few-millisecond phases, a step under
# mpiexec took 26-29 ms against 23-24 ms), between a floor and a ceiling (an idle rank wakes
# 500 times a second).
PATIENT_SHARE = 1 / 16
PATIENT_MIN_S = 20e-6
PATIENT_MAX_S = 2e-3


def wait(req, timeout=None, on_timeout=None, status=None, patient=True, pause=0.0):
    """Poll a non-blocking request until it completes; after `timeout` seconds raise
    DeviceError(on_timeout()). patient: sleep between polls, for a message that may be long in
    coming, a share of the time waited so far (PATIENT_SHARE, from PATIENT_MIN_S to
    PATIENT_MAX_S); else sleep `pause` seconds between polls (0: only yield the core), for a
    transfer that is under way."""
    start = time.monotonic()
    if patient:
        pause = PATIENT_MIN_S
    while not (req.Test(status) if status is not None else req.Test()):
        waited = time.monotonic() - start
        if timeout is not None and waited > timeout:
            req.Cancel()
            err = DeviceError(on_timeout())
            # a rank that does not answer cannot be closed, and the job cannot end without it:
            # the run ends (pyhet.failover does not move its kernels)
            err.ends_run = True
            raise err
        if patient:
            pause = min(PATIENT_MAX_S, max(PATIENT_MIN_S, waited * PATIENT_SHARE))
        time.sleep(pause)


# Pacing the polls of a transfer under way. A large transfer over a slow link would otherwise
# keep a core polling for its whole length, a core that the devices of this machine need. The
# pause is a small share of the time the transfer should take at the fastest rate seen so far
# from this peer, so polling at most delays its end by that share; the kernel's socket buffers
# keep the link busy meanwhile. A link of PACE_FAST_RATE or more (shared memory, a fast
# network) is never paced, nor a transfer whose pause would be under PACE_MIN_S: shared memory
# moves only while both sides poll. The rate is timed on receives (a send may complete as soon
# as its bytes are in the socket's buffer) of at least PACE_MIN_BYTES; an estimate too high only
# shortens the pauses.
PACE_SHARE = 1 / 64
PACE_MIN_S = 100e-6
PACE_MAX_S = 1e-3
PACE_FAST_RATE = 1e9          # bytes/s
PACE_MIN_BYTES = 256 << 10


def transfer_pause(nbytes: int, rate: float | None) -> float:
    """Seconds to sleep between polls of a transfer of nbytes from or to a peer whose fastest
    receive seen ran at `rate` bytes/s (None: none seen yet, poll without sleeping)."""
    if not rate or rate >= PACE_FAST_RATE:
        return 0.0
    pause = min(PACE_MAX_S, PACE_SHARE * nbytes / rate)
    return pause if pause >= PACE_MIN_S else 0.0


class Peer:
    """Messages to and from one other rank, and the bytes they moved."""

    def __init__(self, comm, rank: int, timeout=None, on_timeout=None):
        self.comm, self.rank = comm, rank
        self.timeout, self.on_timeout = timeout, on_timeout
        self.sent = self.received = 0
        self.rate: float | None = None    # the fastest receive seen, bytes/s (pacing polls)
        self._rate_lock = threading.Lock()  # the devices' worker threads share a peer
        self.link: Link | None = None     # as measured by MasterLink.measure_links
        self._until = threading.local()   # a request's deadline, per worker thread
        self.silent = False               # it did not answer within timeout: not asked again

    @contextlib.contextmanager
    def request(self):
        """One request and its reply, within `timeout` together (not each message in turn: a
        stalled rank was named after twice the time --timeout gives)."""
        self._until.t = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            yield
        finally:
            self._until.t = None

    def _left(self):
        """The seconds the message under way may take: the request's time left, or timeout."""
        until = getattr(self._until, "t", None)
        return self.timeout if until is None else max(0.0, until - time.monotonic())

    def _wait(self, req, status=None, patient=True):
        self._watch(wait, req, self._left(), self.on_timeout, status, patient)

    def _watch(self, wait_for, *args, **kwargs):
        """wait_for(*args), remembering a rank that did not answer in time (silent): closing
        its devices would only wait for it again."""
        try:
            wait_for(*args, **kwargs)
        except DeviceError as e:
            if getattr(e, "ends_run", False):
                self.silent = True
            raise

    def _transfer(self, req, nbytes: int, timed: bool = False):
        """Wait for a transfer of nbytes that is under way, polls paced by the rate seen;
        timed: a receive, whose rate counts."""
        start = time.perf_counter()
        self._watch(wait, req, self._left(), self.on_timeout, patient=False,
                    pause=transfer_pause(nbytes, self.rate))
        took = time.perf_counter() - start
        if timed and nbytes >= PACE_MIN_BYTES and took > 0:
            with self._rate_lock:
                self.rate = max(self.rate or 0.0, nbytes / took)

    def send(self, tag: int, op: str, arrays=(), patient: bool = True):
        # native byte order and contiguous, before anything goes out (a buffer that could not
        # be sent after its header would leave the peer reading the wrong message)
        arrays = [None if a is None else np.ascontiguousarray(a, a.dtype.newbyteorder("="))
                  for a in arrays]
        if len(arrays) > MAX_ARRAYS:
            raise ValueError(f"a message holds at most {MAX_ARRAYS} arrays, got {len(arrays)}")
        header = np.zeros(HEADER, np.int64)
        header[0], header[1] = OPS.index(op), len(arrays)
        for i, a in enumerate(arrays):
            if a is None:
                continue
            if a.ndim > 8 or a.dtype.type not in DTYPES:
                raise ValueError(f"cannot send an array of {a.dtype} and shape {a.shape}")
            d = header[2 + 10 * i: 12 + 10 * i]
            d[0], d[1] = DTYPES.index(a.dtype.type), a.ndim
            d[2:2 + a.ndim] = a.shape
        reqs = [(self.comm.Isend(header, dest=self.rank, tag=tag), 0)]
        for a in arrays:
            if a is not None and a.size:
                reqs.append((self.comm.Isend(a, dest=self.rank, tag=tag), a.nbytes))
                self.sent += a.nbytes
        self._wait(reqs[0][0], patient=patient)   # the peer may be busy before it looks
        for r, nbytes in reqs[1:]:
            self._transfer(r, nbytes)             # it is reading this message now

    def receive(self, tag: int, patient: bool = True):
        """(op, arrays, tag) of the next message on `tag` (MPI.ANY_TAG: whichever comes).
        patient: sleep while waiting for it to begin (else only yield the core)."""
        header = np.empty(HEADER, np.int64)
        status = MPI.Status()
        self._wait(self.comm.Irecv(header, source=self.rank, tag=tag), status, patient)
        tag = status.Get_tag()
        arrays = []
        for i in range(int(header[1])):
            d = header[2 + 10 * i: 12 + 10 * i]
            if d[0] == 0:
                arrays.append(None)
                continue
            a = np.empty(tuple(int(v) for v in d[2:2 + int(d[1])]), DTYPES[int(d[0])])
            if a.size:
                self._transfer(self.comm.Irecv(a, source=self.rank, tag=tag), a.nbytes,
                               timed=True)
                self.received += a.nbytes
            arrays.append(a)
        return OPS[int(header[0])], arrays, tag


def geometry_arrays(g: ConvGeometry):
    return [text(g.name), np.array([g.C, g.H, g.W, g.K, g.R, g.S, g.stride, g.pad, g.pool,
                                    g.pool_stride], np.int64)]


def geometry_of(name, values) -> ConvGeometry:
    return ConvGeometry(untext(name), *(int(v) for v in values))


# ================================================================================================
# The master's side


class RemoteDevice(Device):
    """A device on another rank, seen from the master: each shard message is sent to that rank
    and its reply awaited (on this device's own worker thread, like any Device's work). Emulated
    slowness (@S) is applied on the device's own rank; the busy time measured here includes the
    messages, and each reply says how long the rank computed (compute_s)."""

    def __init__(self, name: str, spec: DeviceSpec, index: int, peer: Peer):
        self.index, self.peer = index, peer
        self.siblings: dict = {}  # index -> RemoteDevice: the devices of the same rank
        self._rank_s = 0.0        # the rank's compute time in the replies of the work under way
        self._group_share = None  # (busy, compute) of this device in a group's message
        self._closed = False
        super().__init__(name, spec, backend=peer)   # the link stands where a backend would be

    emulates = False   # its own rank applies the @S slowness
    in_this_process = False

    @property
    def shares_host_memory(self) -> bool:
        return False

    @property
    def group(self) -> str | None:
        """The cpu devices of one rank share their im2col and input gradient on that rank."""
        return f"rank {self.peer.rank}" if self.spec.kind == "cpu" else None

    @property
    def link(self) -> Link | None:
        return self.peer.link

    def _account(self, busy: float) -> tuple:
        if self._group_share is not None:
            share, self._group_share = self._group_share, None
            return share
        took, self._rank_s = self._rank_s, 0.0
        return busy, min(took, busy)

    def _request(self, op: str, arrays=()):
        """(reply arrays, seconds computed on the rank: one per device the request was for)."""
        with self.peer.request():
            self.peer.send(request_tag(self.index), op, arrays)
            reply, out, _ = self.peer.receive(reply_tag(self.index))
        if reply == "error":
            raise DeviceError(untext(out[0]))
        return out[:-1], out[-1]     # every reply ends with the rank's compute time

    def _call(self, op: str, arrays=()):
        out, seconds = self._request(op, arrays)
        self._rank_s += float(seconds[0])
        return out

    # --- the Device messages ------------------------------------------------------------------

    def load_shard(self, layer: str, g: ConvGeometry, w, b, vw=None, vb=None):
        self._call("load", [text(layer), *geometry_arrays(g), w, b, vw, vb])

    def get_shard(self, layer: str, lo=None, hi=None, momentum: bool = True):
        span = None if lo is None else np.array([lo, hi], np.int64)
        # without momentum, only the weights cross the link (half the bytes)
        w, b, vw, vb = self._call("get", [text(layer), span,
                                          None if momentum else np.zeros(1, np.int64)])
        return w, b, vw, vb

    def reshard(self, layer: str, keep_lo: int, keep_hi: int, before=None, after=None):
        # a missing part travels as four empty slots; a part's w is never None
        parts = [v for p in (before, after) for v in (p if p is not None else (None,) * 4)]
        self._call("reshard", [text(layer), np.array([keep_lo, keep_hi], np.int64), *parts])

    def drop_shard(self, layer: str):
        self._call("drop", [text(layer)])

    def conv_forward(self, layer: str, x, shared=None):
        return self._call("forward", [text(layer), x])[0]

    def conv_backward(self, layer: str, dout, dx_mode: str):
        if dx_mode == "shared":
            raise DeviceError(f"device {self.name} on rank {self.peer.rank} cannot share host "
                              f"memory with the master")
        return self._call("backward", [text(layer), dout, text(dx_mode)])[0]

    # --- a group of this rank's cpu devices, as one message (sent by its first device) -------
    # plan: one row (device index, kernels, c0, c1) per member, in device order; the members'
    # kernel ranges are consecutive, and (c0, c1) is each one's share of the input channels.

    def group_forward(self, layer: str, x, plan, need_dx: bool):
        """x (N, C, H, W) -> the members' outputs joined, (N, sum k, PH, PW). need_dx: whether
        the layer's backward will make its input gradient (the group then packs only the
        forward's operand, SharedCol.dw_from_fwd)."""
        (out,) = self._group("group_forward", layer,
                             [text(layer), x, plan, np.array([need_dx], np.int64)], plan)
        return out

    def group_backward(self, layer: str, dout, plan, need_dx: bool):
        """dout (N, sum k, PH, PW), the members' slices -> their summed part of dx (N, C, H, W),
        or None when the layer needs none."""
        (dx,) = self._group("group_backward", layer,
                            [text(layer), dout, plan, np.array([need_dx], np.int64)], plan)
        return dx

    def _group(self, op, layer, arrays, plan):
        """Send a group's request; count each member's compute on the rank, plus the time the
        message and the rank's hand-offs took (common to all), as its busy time."""
        t0 = time.perf_counter()
        out, seconds = self._request(op, arrays)
        common = max(0.0, time.perf_counter() - t0 - float(seconds.max()))
        for (index, *_), took in zip(plan, seconds):
            share = (float(took) + common, float(took))
            if index == self.index:
                self._group_share = share
            else:
                self.siblings[int(index)].credit(layer, *share)
        return out

    def sgd_stage(self, layer: str, cfg: SGDConfig):
        self._call("stage", [text(layer), np.array([cfg.lr, cfg.momentum, cfg.weight_decay])])

    def commit_stage(self, layer: str):
        """Sent by the master directly (this device's worker is idle then)."""
        self._request("commit", [text(layer)])

    def free_memory(self):
        free = self._call("free")[0]
        return None if free is None else int(free[0])

    def close(self):
        """Close the device on its rank (which ends once all its devices are closed); once."""
        if self._closed:
            return
        self._closed = True
        if self.peer.silent:   # it did not answer before: the job is ended by the caller
            super().close()
            return
        timeout, self.peer.timeout = self.peer.timeout, min(self.peer.timeout or 30.0, 30.0)
        try:
            self.submit("close", self._call, "close").result()
        except DeviceError:
            pass   # the rank is gone or silent: the job is ended by the caller
        finally:
            self.peer.timeout = timeout
            super().close()


class MasterLink:
    """Rank 0's view of the job: the devices of every rank (local ones made here, the others as
    RemoteDevices), learnt by a hello from each rank at start-up."""

    def __init__(self, comm, specs: list[DeviceSpec], timeout: float = DEFAULT_TIMEOUT,
                 spec_text: str | None = None):
        """spec_text: the --devices SPEC as given, which every rank must have been given too
        (mpiexec -n 1 ... : -n 1 ... with other options is refused)."""
        self.comm, self.size = comm, comm.Get_size()
        self.peers = {r: Peer(comm, r, timeout, self._timeout_text(r))
                      for r in range(1, self.size)}
        self.ranks_devices = {0: [str(s) for s in for_rank(specs, 0)]}
        hosts = {0: host_of(for_rank(specs, 0))}
        for r, peer in self.peers.items():   # each rank says which devices it made
            op, arrays, _ = peer.receive(TAG_HELLO)
            if op == "error":
                raise DeviceError(f"rank {r}: {untext(arrays[0])}")
            self.ranks_devices[r] = untext(arrays[0]).split(",") if arrays[0] is not None else []
            if len(arrays) > 1 and arrays[1] is not None:   # what the rank warns of
                warn(f"rank {r}: {untext(arrays[1])}")
            if len(arrays) > 2 and arrays[2] is not None:
                hosts[r] = untext(arrays[2])
            if spec_text is not None and len(arrays) > 3 and arrays[3] is not None and \
                    untext(arrays[3]) != spec_text:
                raise UsageError(f"rank {r} was started with --devices "
                                 f"{shown(untext(arrays[3]))}, rank 0 with {shown(spec_text)}: "
                                 f"start every rank with the same command (mpiexec -n R "
                                 f"pyhet ...)")
        for line in shared_host_warnings(hosts):
            warn(line)
        self.hosts = hosts
        # ... and learns the index of its first device in the job (devices follow rank order)
        first = len(self.ranks_devices[0])
        for r, peer in self.peers.items():
            if self.ranks_devices[r]:
                peer.send(TAG_HELLO, "ok", [np.array([first], np.int64)])
            first += len(self.ranks_devices[r])

    def measure_links(self, nbytes: int, rounds: int = 5, together: bool = True) -> dict:
        """{rank: {"latency_s", "bandwidth_bytes_per_s", "shared_bandwidth_bytes_per_s",
        "message_bytes"}} of each rank that holds devices: the best of `rounds` round trips
        (after one to warm up) of 8 bytes and of `nbytes` (a layer input) there and back, and
        where that one's moving time is lost in the trips' noise, of 4 and 16 times as many bytes
        (up to MEASURE_MAX_BYTES). A figure the timing cannot resolve even so (a fast link) is
        None. Where `together` and two or more ranks' bandwidths were resolved, their bytes are
        timed once more, all at once and one way at a time (_trips_together), as a step moves a
        layer's input to every rank at once and their outputs back: their bytes may cross one
        interface (the master's), which a link timed alone cannot see. Each rank's message then
        takes about as long as the others' would alone, and its bytes there and back over the
        time the round took until the last rank's had come, out and in, the median over the
        rounds, are its shared bandwidth (None where that was too fast to time): a step's phase
        waits for every rank. The link the cost model takes (peer.link) has the lower of its
        two figures."""
        out, sizes = {}, {}
        small = np.zeros(1, np.float64)
        for r, peer in self.peers.items():
            if not self.ranks_devices[r]:
                continue

            def best_trip(a) -> float:
                best = float("inf")
                for i in range(rounds + 1):
                    t0 = time.perf_counter()
                    with peer.request():
                        peer.send(TAG_ECHO, "ok", [a], patient=False)
                        peer.receive(TAG_ECHO, patient=False)
                    if i:
                        best = min(best, time.perf_counter() - t0)
                return best

            latency = best_trip(small)
            # a moving time lost in the trips' noise (a busy machine) read a rate-limited link
            # as one too fast to time, which costs nothing: a message 4 and 16 times larger
            # is tried before the figure is left None
            for scale in (1, 4, 16):
                if scale > 1 and nbytes * scale > MEASURE_MAX_BYTES:
                    break
                big = np.zeros(max(1, nbytes * scale // 4), np.float32)
                trip = best_trip(big)
                moving = trip - latency
                if moving > 0.05 * trip:
                    break
            out[r] = {"latency_s": latency / 2,
                      "bandwidth_bytes_per_s": (2 * big.nbytes / moving
                                                if moving > 0.05 * trip else None),
                      "shared_bandwidth_bytes_per_s": None,
                      "message_bytes": int(max(1, nbytes // 4) * 4)}   # the layer input's
            sizes[r] = big.size
            peer.link = Link(out[r]["latency_s"], out[r]["bandwidth_bytes_per_s"])
        timed = [r for r in out if out[r]["bandwidth_bytes_per_s"]]
        if together and len(timed) > 1:
            # messages that would take each link alone as long as the longest of the trips
            # above (float32 there and back: 8 bytes a number), so that the transfers of a
            # round end about together where the interface is not shared: where it is, none of
            # them then moves its last part alone, faster than it would beside the others
            # (none above MEASURE_MAX_BYTES: a capped one would end early and be charged the
            # others' time)
            moving = min(max(8 * sizes[r] / out[r]["bandwidth_bytes_per_s"] for r in timed),
                         min(2 * MEASURE_MAX_BYTES / out[r]["bandwidth_bytes_per_s"]
                             for r in timed))
            sizes = {r: max(1, int(out[r]["bandwidth_bytes_per_s"] * moving / 8))
                     for r in timed}
            trips = self._trips_together(sizes, rounds)
            # each round's moving time out, until the last rank's bytes came, and in, until
            # the last rank's came back, each transfer less its own latency there and back (a
            # near rank is not charged a far one's)
            spans = []
            for i in range(rounds):
                ways = [(max(trips[r][i][w] - 2 * out[r]["latency_s"] for r in timed),
                         max(trips[r][i][w] for r in timed)) for w in (0, 1)]
                spans.append((ways[0][0] + ways[1][0], ways[0][1] + ways[1][1]))
            for r in timed:   # rounds whose moving time stands out of the trips' noise
                rates = [8 * sizes[r] / t for t, trip in spans if t > 0.05 * trip]
                if 2 * len(rates) > len(spans):
                    shared = float(np.median(rates))
                    out[r]["shared_bandwidth_bytes_per_s"] = shared
                    if shared < out[r]["bandwidth_bytes_per_s"]:
                        self.peers[r].link = Link(out[r]["latency_s"], shared)
        return out

    def _trips_together(self, sizes: dict, rounds: int) -> dict:
        """{rank: [(seconds out, seconds in) of each round]} of `rounds` rounds (after one to
        warm up), in each of which every rank is sent sizes[rank] float32 numbers at once (a
        thread each; it answers with a short message), and then, when all have answered, every
        rank sends that many back at once. A step moves its bytes so, one way at a time (a
        layer's input out to every rank, their outputs back): timed as round trips that start
        together, a rank whose message arrived first would send its answer back beside the
        others' messages still going out, and two ranks through a 1 Gbit/s interface came out
        at 73 MB/s each, more than the interface carries one way."""
        barrier = threading.Barrier(len(sizes))
        trips = {r: None for r in sizes}
        failed = []

        def run(r):
            peer, a = self.peers[r], np.zeros(sizes[r], np.float32)
            count = np.array([sizes[r]], np.int64)
            try:
                for _ in range(rounds + 1):
                    took = []
                    for op, arrays in (("sink", [a]), ("source", [count])):
                        barrier.wait()
                        t0 = time.perf_counter()
                        with peer.request():
                            peer.send(TAG_ECHO, op, arrays, patient=False)
                            peer.receive(TAG_ECHO, patient=False)
                        took.append(time.perf_counter() - t0)
                    if trips[r] is not None:
                        trips[r].append(tuple(took))
                    else:       # the warm-up round
                        trips[r] = []
            except threading.BrokenBarrierError:
                pass                  # another rank's trip failed, or the wait was interrupted
            except BaseException as e:  # noqa: BLE001 (raised again by the caller)
                failed.append(e)
                barrier.abort()

        threads = [threading.Thread(target=run, args=(r,), name=f"pyhet-link-{r}")
                   for r in sizes]
        try:
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.05)
        except BaseException:
            # Ctrl-C: the others stop at their next round (each trip ends within --timeout)
            barrier.abort()
            for t in threads:
                if t.ident is not None:   # started
                    t.join()
            raise
        if failed:
            raise failed[0]
        return trips

    def _timeout_text(self, rank):
        def text_():
            devices = ", ".join(self.ranks_devices.get(rank, [])) or "no devices"
            return (f"rank {rank} ({devices}) did not answer within {self.peers[rank].timeout:g} "
                    f"s (--timeout): it stopped or its link failed")
        return text_

    def devices(self, specs: list[DeviceSpec]) -> list[Device]:
        """Every device of the job in rank order, named d0, d1, ..."""
        local = for_rank(specs, 0)
        out = make_devices(local, [f"d{i}" for i in range(len(local))])
        crowded = master_crowded(self.hosts)
        for d in out:
            d.crowded = crowded
        index = len(local)
        try:
            for r in range(1, self.size):
                siblings = {}
                for spec_text in self.ranks_devices[r]:
                    spec = _spec_of(spec_text, r)
                    out.append(RemoteDevice(f"d{index}", spec, index, self.peers[r]))
                    out[-1].on_master_machine = same_machine(self.hosts, r)
                    out[-1].crowded = out[-1].on_master_machine and crowded
                    siblings[index] = out[-1]
                    out[-1].siblings = siblings
                    index += 1
        except BaseException:
            for d in out:
                d.close()
            raise
        return out

    def idle_ranks(self) -> list[int]:
        """The ranks other than the master that hold no device (they have nothing to do)."""
        return [r for r, devs in self.ranks_devices.items() if r and not devs]



def host_of(specs: list[DeviceSpec]) -> str:
    """What a rank tells the master of its machine: "name<TAB>threads<TAB>its cores" (the
    threads its devices compute with there, pyhet.specs.compute_threads; the cores it may run
    on, as a comma list), so that ranks on one machine can be told apart from ranks on
    several."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        cores = list(range(os.cpu_count() or 1))
    threads = compute_threads(specs)
    return f"{MPI.Get_processor_name()}\t{threads}\t{','.join(map(str, cores))}"


def same_machine(hosts: dict[int, str], rank: int) -> bool:
    """Whether rank `rank` runs on the master's machine, by the names of host_of(); where a
    rank did not say (a rank of another version), taken as yes."""
    try:
        return hosts[rank].split("\t")[0] == hosts[0].split("\t")[0]
    except (KeyError, IndexError, AttributeError):
        return True


def _machines(hosts: dict[int, str]) -> dict[str, list]:
    """{machine name: [(rank, cpu threads, {cores})]} of host_of()'s lines (a rank of another
    version, whose line does not parse, left out: its machine is not known)."""
    by_name: dict[str, list] = {}
    for rank, said in sorted(hosts.items()):
        try:
            name, threads, cores = said.split("\t")
            by_name.setdefault(name, []).append((rank, int(threads),
                                                 {int(c) for c in cores.split(",") if c}))
        except ValueError:
            continue
    return by_name


def _crowded(ranks: list) -> bool:
    """Whether ranks of one machine ((rank, threads, cores) of _machines) ask for more cpu
    threads than the cores they may run on, together."""
    total = sum(t for _, t, _ in ranks)
    return len(ranks) > 1 and total > len(set().union(*(c for _, _, c in ranks)))


def master_crowded(hosts: dict[int, str]) -> bool:
    """Whether the master's machine is crowded (_crowded): the devices there take turns on
    its cores (pyhet.calibrate times their splits as a step runs them)."""
    ranks = next((r for r in _machines(hosts).values() if any(k == 0 for k, _, _ in r)), [])
    return _crowded(ranks)


def shared_host_warnings(hosts: dict[int, str]) -> list[str]:
    """A line for each machine whose ranks' devices together ask for more threads than the
    cores those ranks may run on (each rank checks its own alone). hosts: {rank: host_of()}."""
    out = []
    for name, ranks in _machines(hosts).items():
        total = sum(t for _, t, _ in ranks)
        cores = len(set().union(*(c for _, _, c in ranks)))
        if _crowded(ranks):
            who = ", ".join(str(r) for r, _, _ in ranks)
            out.append(f"ranks {who} on {name} ask for {total} cpu threads in all but run on "
                       f"{cores} cores there: they will compete for them")
    return out


def dismiss(comm, timeout: float | None = DEFAULT_TIMEOUT) -> None:
    """The master's last word to every other rank, once training is over: each waits for it in
    Python, where SIGINT and SIGTERM are still handled, rather than in MPI_Finalize (where
    Python's handlers are gone), and answers it. A rank that does not answer within `timeout`
    (stopped, or gone) is a DeviceError naming it: MPI_Finalize would wait for it without end,
    so the caller ends the job (MPI_Abort)."""
    told = []
    for r in range(1, comm.Get_size()):
        peer = Peer(comm, r, timeout, lambda r=r: (
            f"rank {r} did not answer the end of the job within {timeout:g} s (--timeout): it "
            f"is stopped or gone"))
        peer.send(TAG_BYE, "bye")
        told.append(peer)
    for peer in told:
        peer.receive(TAG_BYE)


def _spec_of(spec_text: str, rank: int) -> DeviceSpec:
    (spec,) = parse_devices(spec_text)
    return spec if spec.rank == rank else DeviceSpec(spec.kind, spec.arg, spec.speed, rank)


# ================================================================================================
# A serving rank


def serve(comm, specs: list[DeviceSpec], spec_text: str | None = None) -> None:
    """Make this rank's devices, tell the master (and the --devices SPEC this rank was given,
    spec_text, which the master checks against its own), and run their shard messages until
    the master closes them all; then (or at once, for a rank with no devices) wait for its
    dismiss."""
    rank = comm.Get_rank()
    master = Peer(comm, 0)
    mine = for_rank(specs, rank)
    try:
        with warnings.catch_warnings(record=True) as said:   # a serving rank says nothing
            warnings.simplefilter("always")                    # itself: the master passes its
            check_threads(mine, master=False)                  # warnings on
        devices = make_devices(mine)
    except Exception as e:
        master.send(TAG_HELLO, "error", [text(str(e))])
        raise
    master.send(TAG_HELLO, "hello", [text(",".join(str(s) for s in mine)) if mine else None,
                                     text("; ".join(str(w.message) for w in said))
                                     if said else None, text(host_of(mine)),
                                     None if spec_text is None else text(spec_text)])
    if not devices:
        master.receive(TAG_BYE)   # idle till the master is done (see dismiss)
        master.send(TAG_BYE, "bye")
        return
    # this rank's devices, by their index (and name) in the job, which the master gives
    _, (first,), _ = master.receive(TAG_HELLO)
    first = int(first[0])
    for i, d in enumerate(devices):
        d.name = f"d{first + i}"
    by_index = {first + i: d for i, d in enumerate(devices)}
    open_ = set(by_index)
    # a group's request waits on its members' workers, so it runs on a thread of its own
    groups = Worker("pyhet-group")
    buffers: dict = {}    # the group's shared im2col matrix (a SharedCol), per layer
    told = False          # the master's dismiss came
    try:
        while open_:
            op, arrays, tag = master.receive(MPI.ANY_TAG)
            if tag == TAG_BYE:               # the master is done (it closed what it could)
                told = True
                break
            if tag == TAG_ECHO:              # the master measures the link
                master.send(TAG_ECHO, "ok", _echo(op, arrays))
                continue
            index = device_of(tag)
            device = by_index[index]
            if op == "close":
                device.close()
                master.send(reply_tag(index), "ok", [np.zeros(1)])
                open_.discard(index)
                continue
            if op.startswith("group_"):
                groups.submit(_handle_group, by_index, buffers, op, arrays).add_done_callback(
                    lambda f, i=index: _reply_group(master, i, f))
                continue
            if op == "drop":   # the group's arrays of that layer go with it (a trial's too),
                # on the thread that uses them, after the group requests handed to it
                groups.submit(drop_group_arrays, buffers, untext(arrays[0]))
            device.submit(op, _handle, device, op, arrays).add_done_callback(
                lambda f, i=index, d=device: _reply(master, i, f, d))
    finally:
        groups.shutdown(wait=True)
        for d in devices:
            d.close()
    if not told:
        master.receive(TAG_BYE)   # every device closed (or failed): wait for the master's end
    master.send(TAG_BYE, "bye")   # the master waits for every rank's answer (see dismiss)


def _echo(op: str, arrays) -> list:
    """A rank's answer to the master's timing of its link: the message back ("ok"), nothing
    ("sink": the bytes came), or as many float32 zeros as asked ("source"; at most
    MEASURE_MAX_BYTES)."""
    if op == "sink":
        return []
    if op == "source":
        return [np.zeros(min(int(arrays[0][0]), MEASURE_MAX_BYTES // 4), np.float32)]
    return arrays


def _handle(device: Device, op: str, a):
    """Run one request on the device (on its worker thread); returns the reply's arrays."""
    layer = untext(a[0]) if a else None
    if op == "load":
        device.load_shard(layer, geometry_of(a[1], a[2]), a[3], a[4], a[5], a[6])
        return []
    if op == "get":
        span = a[1] if len(a) > 1 and a[1] is not None else (None, None)
        momentum = len(a) < 3 or a[2] is None     # a third array: the weights alone
        return list(device.get_shard(layer, *(None if v is None else int(v) for v in span),
                                     momentum))
    if op == "reshard":
        part = (lambda p: None if p[0] is None else tuple(p))
        device.reshard(layer, int(a[1][0]), int(a[1][1]), part(a[2:6]), part(a[6:10]))
        return []
    if op == "drop":
        device.drop_shard(layer)
        return []
    if op == "forward":
        return [device.conv_forward(layer, a[1])]
    if op == "backward":
        return [device.conv_backward(layer, a[1], untext(a[2]))]
    if op == "stage":
        lr, momentum, weight_decay = (float(v) for v in a[1])
        device.sgd_stage(layer, SGDConfig(lr, momentum, weight_decay))
        return []
    if op == "commit":
        device.commit_stage(layer)
        return []
    if op == "free":
        free = device.free_memory()
        return [None if free is None else np.array([free], np.int64)]
    raise DeviceError(f"unknown request {op!r}")


def drop_group_arrays(buffers: dict, layer: str) -> None:
    """Forget a group's shared arrays of `layer` (keys (layer, what)); other layers' stay."""
    for key in [k for k in buffers if k[0] == layer]:
        del buffers[key]


def _handle_group(by_index, buffers, op: str, a):
    """Run a group's request on its members (this rank's cpu devices) as the master's own cpu
    devices run theirs: one shared im2col (packed), a channel-split input gradient (and weight
    gradient, from the forward's packed operand, in a layer with an input gradient; the
    members' dy in one array).
    Returns (reply arrays, seconds each member computed)."""
    layer, plan = untext(a[0]), a[2]
    members = {n: by_index[int(row[0])] for n, row in enumerate(plan)}
    shares = {n: (int(row[2]), int(row[3])) for n, row in enumerate(plan) if row[3] > row[2]}
    g = members[0].geometry(layer)
    before = {n: d.busy_s for n, d in members.items()}

    if op == "group_forward":
        x = a[1]
        shared = buffers.setdefault((layer, "col"), SharedCol()).prepare(
            g.col_shape(x.shape[0]), {d: int(plan[n, 1]) for n, d in members.items()},
            x.shape, dw_from_fwd=bool(a[3][0]))
        shared_im2col(members, {n: int(plan[n, 1]) for n in members}, x, g, shared, tag=layer)
        outs = gather([d.submit(f"{layer} forward", d.conv_forward, layer, x, shared, tag=layer)
                       for d in members.values()])
        result = [np.concatenate(outs, axis=1)]
    elif op == "group_backward":
        dout, need_dx = a[1], bool(a[3][0])
        edges = np.concatenate([[0], np.cumsum(plan[:, 1])]).astype(int)
        shared = buffers[(layer, "col")]
        # as the master's group: the members' dy in one array, and their weight gradient made
        # with the input gradient from the forward's packed operand where only it was packed
        dy_all = dw_all = None
        if need_dx and len(members) > 1:
            dy_all, dw_all = group_gradients(buffers, layer, g, dout.shape[0], int(edges[-1]),
                                             shared)

        def rows_of(a, n):
            return () if a is None else (a[edges[n]:edges[n + 1]],)

        parts = gather([d.submit(f"{layer} backward", d.conv_backward, layer,
                                 dout[:, edges[n]:edges[n + 1]],
                                 "shared" if need_dx else "none",
                                 *(rows_of(dy_all, n) + rows_of(dw_all, n)), tag=layer)
                        for n, d in members.items()])
        dx = None
        if need_dx:
            # the forward's im2col matrix is read by no one now: dcol takes its place
            dcol = shared.col
            dx = np.empty(g.x_shape(dout.shape[0]), np.float32)
            shared_input_grad(members, shares, parts, dcol, dx, g, tag=layer,
                              dw=None if dw_all is None else (
                                  [dw_all[edges[n]:edges[n + 1]] for n in members],
                                  shared.fwd))
        result = [dx]
    else:
        raise DeviceError(f"unknown request {op!r}")
    return result, np.array([d.busy_s - before[n] for n, d in members.items()])


def _reply_group(master: Peer, index: int, future):
    try:
        result, seconds = future.result()
        master.send(reply_tag(index), "ok", result + [seconds])
    except Exception as e:
        master.send(reply_tag(index), "error", [text(str(e))])


def _reply(master: Peer, index: int, future, device: Device):
    """Send a request's result, and the seconds the device computed for it (its worker runs this
    callback right after the work, before any other)."""
    try:
        master.send(reply_tag(index), "ok", future.result() + [np.array([device.last_busy_s])])
    except Exception as e:
        master.send(reply_tag(index), "error", [text(str(e))])
