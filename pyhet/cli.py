"""The command line: ``pyhet train``, ``evaluate``, ``predict``, ``devices``, ``plan``,
``bench``.

Errors in the user's input end the command with one line on stderr and exit status 2 for
usage errors (argparse's own included), 1 for the rest; no traceback unless --debug.
"""

from __future__ import annotations

from . import __version__, _loading_interrupted

try:   # (Ctrl-C while these load: pyhet._loading_interrupted)
    import argparse
    import errno
    import importlib
    import json
    import math
    import os
    import re
    import signal
    import sys
    import time
    import traceback
    import warnings

    import numpy as np

    from . import arch, files, plan
    from .api import load
    from .checkpoint import DEFAULT_KEEP
    from .data import input_shape_of, name_problem, read_images
    from .errors import (ArchitectureError, DataError, DeviceSpecError, Interrupted,
                         OutputError, PyhetError, UsageError, brief, say, shown)
    from .images import channel_last_message, looks_channel_last
    from .model import read_weight_file, write_npz
    from .optim import SGDConfig
    from .report import calibrate_ranks, calibrate_spec, describe_devices
    from .specs import check_ranks, cuda_device_count, for_rank, parse_devices
    from .train import TrainConfig, check_file_destination, check_memory, host_devices, train
    from .transport import DEFAULT_TIMEOUT, end_job_unstarted, launched_rank, launched_size
except KeyboardInterrupt:
    _loading_interrupted()
    raise

EXIT_ERROR, EXIT_USAGE = 1, 2
BENCHMARKS = ("gemm", "step", "scaling", "bandwidth", "ranks", "paper", "plan", "pair")


class Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line (argparse prints the usage block first): the
    command, what was wrong, and where the options are listed. Exit status 2."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        # a value that starts with a minus and a digit is a value, not an option: argparse's
        # own rule takes only plain numbers so, and `--master-link -1gbit` said "expected one
        # argument" where the option's check says what a bandwidth must be (no option here
        # looks like a number)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def parse_args(self, args=None, namespace=None):
        args, extras = self.parse_known_args(args, namespace)
        if extras:   # said by the command they were given to, not by pyhet
            extra = " ".join(extras)
            getattr(args, "command_parser", self).error(
                f"unrecognized arguments: {extra if len(extra) <= 200 else shown(extra, 200)}")
        return args

    def parse_known_args(self, args=None, namespace=None):
        args, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            # `--steps=--`: argparse drops the `--` and stores [] without calling the option's
            # type, so no check of it ran (a traceback later, or the default used silently)
            value = getattr(args, action.dest, None)
            if action.nargs is None and action.option_strings and (
                    type(action) is argparse._StoreAction and value == []
                    or type(action) is argparse._AppendAction and isinstance(value, list)
                    and [] in value):
                self.error(f"argument {'/'.join(action.option_strings)}: expected one "
                           f"argument, got '--'")
        return args, extras

    def _check_value(self, action, value):
        # argparse's message quotes the whole value: a long one made a line of kilobytes
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentError(action, f"invalid choice: {shown(value)} (choose from "
                                         f"{', '.join(map(repr, action.choices))})")

    def error(self, message):
        where = self.prog if "--help" in self._option_string_actions else self.prog.split()[0]
        line = f"{self.prog}: error: {brief(message)} (see {where} --help)"
        if launched_size() > 1 and not _mpi_started():   # every rank parses: see there
            refused_before_mpi(line, EXIT_USAGE)
            self.exit(EXIT_USAGE)
        self.exit(EXIT_USAGE, line + "\n")


OUT_OF_MEMORY = "out of memory: the network, the batch or the data is too large for this machine"

# a rank other than 0 refused before MPI starts waits this long for rank 0 to end the job
OTHER_RANK_WAIT_S = 5.0


def refused_before_mpi(line: str, status: int, detail: str = "") -> None:
    """Under mpiexec, a command line refused (or a run failed) before MPI starts in this rank.
    Rank 0 says why and asks the launcher to end the job (end_job_unstarted). Another rank,
    given the same command line, is ended with it meanwhile, having said nothing: it first
    waits a moment (OTHER_RANK_WAIT_S). One that is still there after it was refused alone
    (mpiexec's A : B form gave it another command line, or its machine lacks mpi4py): it says
    why, naming its rank, and ends the job itself, which rank 0 would otherwise wait for in
    MPI's start-up until --timeout. detail (--debug's traceback) comes before the line, from
    the rank that says it only."""
    rank = launched_rank()
    if rank != 0:
        time.sleep(OTHER_RANK_WAIT_S)
        line = line.replace(": error: ", f": error: rank {rank}: ", 1)
    if detail:
        sys.stderr.write(detail)
    say(line)
    end_job_unstarted(status)


def kernel_counts(text: str):
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected two kernel counts as A,B (e.g. 500,1500), "
                                         f"got {shown(text)}")
    try:
        a, b = (_int(v) for v in parts)
    except argparse.ArgumentTypeError as e:      # its message names the count
        raise argparse.ArgumentTypeError(f"{shown(text)}: {e} (two kernel counts as A,B, e.g. "
                                         f"500,1500)") from None
    if a < 1 or b < 1:
        raise argparse.ArgumentTypeError(f"kernel counts must be >= 1, got {shown(text)}")
    return (a, b)


def _int(text):
    """A whole number in ASCII digits (int() would also read other scripts' digits)."""
    t = text.strip()
    # one sign at most, and no more digits than any count here needs (int() refuses 4,300)
    if not re.fullmatch(r"[+-]?[0-9]{1,18}", t):
        long = re.fullmatch(r"[+-]?[0-9]+", t) is not None
        raise argparse.ArgumentTypeError(
            f"expected a whole number{' of at most 18 digits' if long else ''}, got "
            f"{shown(text, 40)}")
    return int(t)


def _float(text):
    """A finite number in ASCII (float() would also take inf, nan and other scripts' digits)."""
    try:
        v = float(text) if text.isascii() else math.nan
    except ValueError:
        v = math.nan
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {shown(text)}")
    return v


def positive(kind, high=None):
    """A value > 0 (and at most high, where given)."""
    return ranged(kind, above=0, high=high)


def ranged(kind, *, above=None, low=None, high=None):
    """An argparse type: a number in ASCII digits (a finite one), > above, >= low and <= high
    where given."""
    parse_kind = _int if kind is int else _float

    def parse(text):
        v = parse_kind(text)
        if above is not None and not v > above:
            raise argparse.ArgumentTypeError(f"expected a value > {above:g}, got {shown(text)}")
        if low is not None and not v >= low:
            raise argparse.ArgumentTypeError(f"expected a value >= {low:g}, got {shown(text)}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"expected a value of at most {high:g}, got "
                                             f"{shown(text)}")
        return v
    return parse


def _non_negative_int(text):
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {shown(text)}")
    return v


def _lr(text):
    """A learning rate: > 0, and so in float32, the weights' type (optim.SGDConfig)."""
    v = positive(float)(text)
    try:
        SGDConfig(lr=v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("lr must be ")) from None
    return v


def _non_negative_float(text):
    v = _float(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected a value >= 0, got {shown(text)}")
    return v


def _momentum(text):
    v = _float(text)
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"expected a value in [0, 1), got {shown(text)}")
    return v


def _timeout(text):
    """Seconds > 0; inf waits for ever."""
    try:
        v = float(text) if text.strip().lower() in ("inf", "infinity") else _float(text)
    except argparse.ArgumentTypeError:   # (1e400 too: a finite number past float's range)
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, or inf "
                                         f"for no limit, got {shown(text)}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a value > 0, got {shown(text)}")
    return v


def dataset(text):
    """A dataset's name (pyhet.data.DATASETS) or npz:FILE, checked now: a name that is not one
    is a usage error, before any work (a FILE that cannot be read is found when it is read)."""
    if name_problem(text) is not None:
        raise argparse.ArgumentTypeError(name_problem(text))
    return text


def _device_spec(text):
    """A device SPEC, checked against the grammar now (auto is expanded later, when the GPUs
    are counted)."""
    try:
        parse_devices(text)
    except DeviceSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _master_link(text):
    """--master-link: 'links' or a bandwidth (bytes/s)."""
    if text.strip() == "links":
        return "links"
    try:
        return plan.parse_bandwidth(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(f"{e} (or 'links')") from None


def arch_spec(text):
    """A network in --arch notation, checked now (pyhet.arch.parse)."""
    try:
        arch.parse(text)
    except ArchitectureError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


DATA_DIR_HELP = ("the folder of the fashion-mnist, mnist or cifar10 files (default: "
                 "/usr/share/datasets/fashion-mnist, ~/.cache/pyhet/mnist, "
                 "~/.cache/pyhet/cifar10; ~/.cache is $XDG_CACHE_HOME where set)")


def _network_options(p):
    p.add_argument("--arch", type=arch_spec, metavar="SPEC", default=None,
                   help="the network in CNN-paper notation, blocks joined by '-' from the "
                        "input: 32C5 (conv of 32 kernels 5x5, then ReLU), 32C3p1s2 (zero "
                        "padding 1, stride 2), P2 (max-pool 2x2, stride 2), P3s2 (3x3, stride "
                        "2), 256N (fc layer of 256 units, then ReLU); the classifier is "
                        "implicit. E.g. 32C5-P2-64C3p1s2-P2-256N (default: the --kernels "
                        "shorthand)")
    p.add_argument("--kernels", type=kernel_counts, default=None, metavar="A,B",
                   help="shorthand for --arch AC{k}-P2-BC{k}-P2 (default 32,64; 500,1500 is "
                        "the paper's network)")
    p.add_argument("--kernel-size", type=positive(int), default=None, metavar="K",
                   help="k of the --kernels shorthand (default 5)")


def network_spec(args, parser) -> str:
    """The network of --arch, or of the --kernels/--kernel-size shorthand (not both); errors
    are usage errors of the command's own parser."""
    parser = getattr(args, "command_parser", parser)
    if args.arch is not None:
        if args.kernels is not None or args.kernel_size is not None:
            parser.error("--arch describes the whole network: give it without --kernels and "
                         "--kernel-size")
        return args.arch
    return arch.shorthand(args.kernels or arch.DEFAULT_KERNELS,
                          args.kernel_size or arch.DEFAULT_KERNEL_SIZE)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pyhet", description="Train CNNs with each conv layer's "
                                "kernels split across heterogeneous devices.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    p.add_argument("--version", action="version", version=f"pyhet {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    t = sub.add_parser("train", help="train a CNN")
    t.set_defaults(command_parser=t)
    _network_options(t)
    t.add_argument("--dataset", type=dataset, default="bundled",
                   help="bundled, fashion-mnist, mnist, cifar10, synthetic or npz:FILE "
                        "(default bundled)")
    t.add_argument("--data-dir", default=None, metavar="DIR", help=DATA_DIR_HELP)
    t.add_argument("--devices", type=_device_spec, default="auto", metavar="SPEC",
                   help="e.g. cpu:1,cpu:1@0.5 or numpy or gpu:0,cpu (default auto)")
    t.add_argument("--balance", choices=("dynamic", "static", "even"), default="dynamic",
                   help="dynamic: calibrated, then moved while training (default); static: "
                        "calibrated once; even: equal shares")
    t.add_argument("--batch-size", type=positive(int), default=64, metavar="N",
                   help="images per step (default 64)")
    t.add_argument("--epochs", type=positive(int), default=2, metavar="E",
                   help="passes over the training split (default 2)")
    t.add_argument("--steps", type=positive(int), default=None, metavar="S",
                   help="stop after S optimizer steps (overrides --epochs)")
    t.add_argument("--lr", type=_lr, default=0.01,
                   help="SGD's learning rate (default 0.01)")
    t.add_argument("--momentum", type=_momentum, default=0.9, metavar="M",
                   help="in [0, 1) (default 0.9)")
    t.add_argument("--weight-decay", type=_non_negative_float, default=0.0, metavar="WD",
                   help="L2 penalty, as torch.optim.SGD's (default 0)")
    t.add_argument("--seed", type=_non_negative_int, default=0, metavar="S",
                   help="of the initial weights, the batches' order and the synthetic data "
                        "(default 0)")
    t.add_argument("--no-shuffle", action="store_true", help="batches in file order")
    t.add_argument("--init", metavar="FILE.npz", help="start from these weights")
    t.add_argument("--save", metavar="FILE.npz", help="write the final weights")
    t.add_argument("--checkpoint-dir", metavar="DIR",
                   help="write a checkpoint at every epoch's end and at the end (the folder "
                        "belongs to this run: another run's checkpoints there are refused)")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    t.add_argument("--overwrite", action="store_true",
                   help="delete the checkpoints of another run in --checkpoint-dir, as this "
                        "run writes its first (a run that fails before keeps them)")
    t.add_argument("--checkpoint-every", type=positive(int), default=None, metavar="N",
                   help="also write a checkpoint every N steps")
    t.add_argument("--keep", type=_non_negative_int, default=None, metavar="K",
                   help=f"keep the K newest checkpoints, 0 keeps all (default {DEFAULT_KEEP})")
    t.add_argument("--deterministic", action="store_true",
                   help="a partition that no timing decides (in proportion to each device's "
                        "@S), never moved: bit-identical weights run to run and across "
                        "--resume")
    t.add_argument("--timeout", type=_timeout, default=None, metavar="SECONDS",
                   help="under mpiexec: how long a rank may take to answer before the run "
                        "ends with an error naming it (default 300)")
    t.add_argument("--json", action="store_true", help="print the summary as JSON (last line)")
    t.add_argument("--quiet", action="store_true",
                   help="no progress bars, nor the lines on calibration and the partition "
                        "(warnings and errors stay)")
    t.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show tracebacks on errors")

    d = sub.add_parser("devices", help="list the devices and their calibrated speed on a network")
    d.set_defaults(command_parser=d)
    d.add_argument("--devices", type=_device_spec, default="auto", metavar="SPEC",
                   help="the devices to list (default auto)")
    _network_options(d)
    d.add_argument("--dataset", type=dataset, default="bundled",
                   help="gives the input shape (default bundled)")
    d.add_argument("--batch-size", type=positive(int), default=64, metavar="N",
                   help="the batch calibrated on (default 64)")
    d.add_argument("--no-calibrate", action="store_true", help="only list the devices")
    d.add_argument("--json", action="store_true", help="print the listing as JSON")
    d.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show tracebacks on errors")

    pl = sub.add_parser("plan", help="predict the partition and step time of a cluster, "
                        "with devices that are not here described by their figures")
    pl.set_defaults(command_parser=pl)
    pl.add_argument("--devices", type=_device_spec, default=None, metavar="SPEC",
                    help="devices of this machine, calibrated here (default: none)")
    pl.add_argument("--describe", action="append", default=[], metavar="DEVICES",
                    help="devices that are not here, 'NAME:key=value,...;NAME:...', keys: "
                         "gflops=G (its rate, GFLOP/s) or like=D,factor=F (F times calibrated "
                         "device D's speed); mem=80G (memory); overhead=1ms (fixed time a "
                         "layer and step); bw=10gbit, lat=50us (its link to the master; "
                         "without bw, on the master's machine); count=N (N such devices). "
                         "E.g. 'gpu:gflops=20000,mem=80G,bw=100gbit;c:like=d0,count=3' "
                         "(README, 'Planning a cluster', has the details)")
    pl.add_argument("--link", default=None, metavar="BW[@LAT],...",
                    help="the link of described devices that give no bw= (e.g. 10gbit@50us); "
                         "with --sweep, several: one column each, for every described device")
    pl.add_argument("--sweep", default=None, metavar="devices=N,N,...",
                    help="a table of predicted speedups over these counts of described devices")
    low, high = plan.GFLOPS_RANGE
    pl.add_argument("--master-gflops", type=ranged(float, low=low, high=high), default=None,
                    metavar="G",
                    help="the master's rate for its fc layers (default: its machine's devices)")
    low, high = plan.FACTOR_RANGE
    pl.add_argument("--master-link", type=_master_link, default=None, metavar="BW|links",
                    help="the master's own network interface, which every link's bytes cross "
                         "(a layer takes at least its bytes over it): a bandwidth (10gbit, "
                         "1.2GB), or 'links' for the fastest device link (in a sweep, each "
                         "column's); default: none, the links independent")
    pl.add_argument("--ddp-speed", type=ranged(float, low=low, high=high), default=1.0,
                    metavar="F",
                    help="the DDP replicas' compute speed relative to pyhet's devices' (the "
                         "framework that runs DDP has its own; default 1)")
    _network_options(pl)
    pl.add_argument("--dataset", type=dataset, default="bundled",
                    help="gives the input shape (default bundled)")
    pl.add_argument("--batch-size", type=positive(int), default=64, metavar="N",
                    help="images per step (default 64)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON (last line)")
    pl.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                    help="show tracebacks on errors")

    e = sub.add_parser("evaluate", help="the loss and accuracy of saved weights on a dataset's "
                       "test split")
    e.set_defaults(command_parser=e)
    e.add_argument("--weights", required=True, metavar="FILE.npz",
                   help="a file written by pyhet train --save (or Network.save)")
    e.add_argument("--dataset", type=dataset, default="bundled",
                   help="bundled, fashion-mnist, mnist, cifar10 or npz:FILE (its test split; "
                        "default bundled)")
    e.add_argument("--data-dir", default=None, metavar="DIR", help=DATA_DIR_HELP)
    e.add_argument("--devices", type=_device_spec, default="auto", metavar="SPEC",
                   help="as pyhet train's (default auto)")
    e.add_argument("--batch-size", type=positive(int), default=64, metavar="N",
                   help="images per forward pass (default 64, pyhet train's default)")
    e.add_argument("--json", action="store_true", help="print the result as JSON (last line)")
    e.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show tracebacks on errors")

    r = sub.add_parser("predict", help="class probabilities of images under saved weights")
    r.set_defaults(command_parser=r)
    r.add_argument("--weights", required=True, metavar="FILE.npz",
                   help="a file written by pyhet train --save (or Network.save)")
    r.add_argument("--input", required=True, metavar="FILE",
                   help="images (N, C, H, W): an .npy array, or an .npz with array x; float32 "
                        "is used as it is, uint8 is prepared as the training images were")
    r.add_argument("--output", metavar="OUT.npz",
                   help="write arrays classes (N,) and probabilities (N, M) instead of "
                        "printing one JSON line per image")
    r.add_argument("--devices", type=_device_spec, default="auto", metavar="SPEC",
                   help="as pyhet train's (default auto)")
    r.add_argument("--batch-size", type=positive(int), default=256, metavar="N",
                   help="images per forward pass (default 256)")
    r.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show tracebacks on errors")

    b = sub.add_parser("bench", help=f"run a benchmark from bench/ ({', '.join(BENCHMARKS)})",
                       add_help=False)
    # -h before the benchmark's name lists the benchmarks; after it, the benchmark's options
    b.add_argument("-h", "--help", action="help", help="list the benchmarks; pyhet bench NAME "
                   "--help lists one's options")
    b.add_argument("name", choices=BENCHMARKS, metavar="NAME", nargs="?",
                   help=f"the benchmark (bench/NAME.py): {', '.join(BENCHMARKS)}")
    b.add_argument("args", nargs=argparse.REMAINDER, metavar="OPTIONS",
                   help="the benchmark's own options")
    b.set_defaults(command_parser=b)
    p.bench_parser = b
    return p


def cmd_train(args, parser, comm=None) -> int:
    if args.checkpoint_dir is None:   # the options of checkpoints, without their folder
        given = [(option, why) for option, why, value in (
            ("--resume", " (the folder to resume from)", args.resume),
            ("--overwrite", " (the folder to clear)", args.overwrite),
            ("--checkpoint-every", "", args.checkpoint_every is not None),
            ("--keep", "", args.keep is not None)) if value]
        if given:
            args.command_parser.error(f"{given[0][0]} needs --checkpoint-dir{given[0][1]}")
    cfg = TrainConfig(arch=network_spec(args, parser), dataset=args.dataset,
                      data_dir=args.data_dir, devices=args.devices, balance=args.balance,
                      batch_size=args.batch_size, epochs=args.epochs, steps=args.steps,
                      lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                      seed=args.seed, shuffle=not args.no_shuffle, init=args.init,
                      save=args.save, checkpoint_dir=args.checkpoint_dir, resume=args.resume,
                      overwrite=args.overwrite, checkpoint_every=args.checkpoint_every,
                      keep=args.keep,
                      deterministic=args.deterministic,
                      progress=not args.quiet, timeout=args.timeout)
    result = train(cfg, comm=comm)
    if args.json:
        print(json.dumps(result))
    else:
        print(human_summary(result))
    return 0


def human_summary(r: dict) -> str:
    st, start = r["step_time_s"], r.get("start_step") or 0
    done = f"{r['steps']} step{'' if r['steps'] == 1 else 's'} ({r['epochs']:.2f} epochs)"
    if start:     # resumed: what this run trained, then the whole run's count
        now = r["steps"] - start
        done = (f"{now or 'no'} step{'' if now < 2 else 's'} after resuming at step {start}, "
                f"{done} in all,")
    lines = [f"trained {done} of batch {r['batch_size']} on {r['dataset']}, network {r['arch']}",
             "devices: " + ", ".join(f"{d['name']}={d['spec']}" for d in r["devices"])]
    if st:
        lines.append(f"step time: median {st['median']:.4f} s, {r['images_per_s']:.1f} images/s, "
                     f"conv share {r['conv_time_fraction']:.0%}")
    for layer, part in r["partition"].items():
        lines.append(f"{layer} partition: " + ", ".join(f"{k} {v}" for k, v in part.items()))
    loss = r["train_loss"]
    lines.append("final train loss: " + ("n/a (no step ran)" if loss is None else f"{loss:.4f}"))
    acc = r["test_accuracy"]
    lines.append("test accuracy: " + ("n/a (no test split)" if acc is None else f"{acc:.4f}"))
    return "\n".join(lines)


def cmd_devices(args, parser) -> int:
    report = describe_devices(args.devices, network_spec(args, parser), args.dataset,
                              args.batch_size, calibrate_them=not args.no_calibrate,
                              log=sys.stderr)
    if args.json:
        print(json.dumps(report))
        return 0
    h = report["host"]
    print(f"host: {h['cores']} cores, OpenMP {'on' if h['openmp'] else 'off'}, GEMM kernel "
          f"{h['gemm_kernel']}, {h['memory_available_gib']:.1f} GiB available")
    gpus = report["gpus"]
    if gpus and "index" not in gpus[0]:
        print(f"GPUs: none ({gpus[0]['error']})")
    else:
        for g in gpus:
            print(f"GPU {g['index']}: cannot be used ({g['error']})" if "error" in g else
                  f"GPU {g['index']}: {g['name']}, {g['memory_free'] / 2**30:.1f} of "
                  f"{g['memory_total'] / 2**30:.1f} GiB free")
    net = report["network"]
    print(f"\n--devices {args.devices} on {net['arch']}, input "
          f"{'x'.join(map(str, net['input_shape']))}, batch {net['batch_size']}:")
    cal = report["calibration"]
    head = f"{'name':<6}{'spec':<14}"
    if cal:
        head += "".join(f"{layer + ' kernels/s':>18}{'overhead ms':>13}{'share':>7}"
                        for layer in cal)
    print(head)
    for d in report["devices"]:
        line = f"{d['name']:<6}{d['spec']:<14}"
        if cal:
            for layer, per in cal.items():
                c = per[d["name"]]
                line += (f"{c['kernels_per_s']:>18.1f}{1000 * c['overhead_s']:>13.2f}"
                         f"{report['partition'][layer][d['name']]:>7}")
        print(line)
    for note in report.get("left_out") or []:
        print(f"{note['device']} gets no kernels of {note['layer']}: {note['why']}")
    if any(d["emulated_speed"] for d in report["devices"]):
        print("(devices with @S are emulated: they idle to run S times as fast)")
    return 0


# The most described devices one plan takes (its time grows with their number: 65,536 take
# seconds, about 10 behind links, where the bottleneck re-plans their class once; an absurd
# count would never end)
MAX_ALARM_S = 1e9            # seconds (31 years): --timeout past it sets no start-up alarm
MAX_PLAN_DEVICES = 2 ** 16
MAX_SWEEP_DEVICES = 2 ** 18     # in a sweep, over every count and link (about a minute)


def _sweep_counts(text, parser):
    name, eq, values = text.partition("=")
    try:
        counts = [_int(v) for v in values.split(",")] if name.strip() == "devices" and eq else []
    except argparse.ArgumentTypeError:
        counts = []
    twice = sorted({n for n in counts if counts.count(n) > 1})
    if twice:   # one row of the table each
        parser.error(f"--sweep {shown(text)}: {', '.join(map(str, twice))} given twice")
    if not counts or any(n < 1 for n in counts):
        parser.error(f"--sweep {shown(text)}: expected devices=N,N,... with counts >= 1, such as "
                     f"devices=1,2,4,8")
    if max(counts) > MAX_PLAN_DEVICES:
        parser.error(f"--sweep {shown(text)}: at most {MAX_PLAN_DEVICES:,} devices, got "
                     f"{max(counts):,}")
    return counts


def _plan_options(option, text, parse, parser):
    """parse(text) of a --describe or --link value; its errors name the option and its
    value."""
    try:
        return parse(text)
    except UsageError as e:
        message = str(e)
        if not message.startswith(option):
            message = f"{option} {shown(text)}: {message}"
        parser.error(message)


def cmd_plan(args, parser, comm=None) -> int:
    """pyhet plan; under mpiexec (comm, on rank 0) the devices of every rank are calibrated
    where they are, each behind its rank's measured link (report.calibrate_ranks)."""
    parser = args.command_parser
    spec = network_spec(args, parser)
    described = [d for text in args.describe
                 for d in _plan_options("--describe", text, plan.parse_describe, parser)]
    if sum(d.count for d in described) > MAX_PLAN_DEVICES:
        parser.error(f"--describe: at most {MAX_PLAN_DEVICES:,} devices in all, got "
                     f"{sum(d.count for d in described):,} (count=)")
    if args.sweep is None:   # before any calibration (a sweep numbers its devices itself)
        _plan_options("--describe", described, lambda d: plan.check_distinct(
            plan.described_names(d)), parser)
    links = ([_plan_options("--link", t, plan.parse_link, parser) for t in args.link.split(",")]
             if args.link is not None else [None])
    if len(links) > 1 and args.sweep is None:
        parser.error("several --link values need --sweep (one column each)")
    _plan_options("--link", args.link, lambda _: plan.link_names(links), parser)
    if args.devices is None and not described:
        parser.error("the cluster is empty: give --devices SPEC and/or --describe")
    if args.link is not None and not any(d.gflops is not None or d.like is not None
                                         for d in described):
        parser.error("--link is the link of described devices (--describe NAME:gflops=G or "
                     "like=DEVICE): there is none")
    # (a sweep's --link is every described device's, bw= or not: see plan.sweep)
    if args.link is not None and args.sweep is None and not any(
            (d.gflops is not None or d.like is not None) and d.link is None for d in described):
        parser.error("--link is the link of described devices that give no bw= of their own: "
                     "every described device gives its own bw=")
    counts = _sweep_counts(args.sweep, parser) if args.sweep is not None else None
    if counts is not None and sum(counts) * len(links) > MAX_SWEEP_DEVICES:
        parser.error(f"--sweep {shown(args.sweep)}: at most {MAX_SWEEP_DEVICES:,} devices planned "
                     f"in all (the counts' sum times the links), got "
                     f"{sum(counts) * len(links):,}")
    # the described devices' names against the calibrated ones (d0, d1, ... from the SPEC
    # alone, of every rank's devices under mpiexec), before any calibration
    specs = ([] if args.devices is None else
             parse_devices(args.devices, gpu_count=cuda_device_count))
    # (under mpiexec an entry without R/ is placed on every rank)
    ranks = 1 if comm is None else comm.Get_size()
    count = (sum(len(for_rank(specs, r)) for r in range(ranks)) if ranks > 1 else len(specs))
    cal_names = [f"d{i}" for i in range(count)]
    try:
        plan.check_described(described, cal_names, counts is not None)
    except UsageError as e:
        parser.error(str(e))
    in_shape, classes = input_shape_of(args.dataset)
    net = arch.build(spec, in_shape, classes)
    calibrated = ranked = None
    # with --master-gflops and devices on other ranks no step runs (the master's rate is
    # given; the layers are taken at their model's time there)
    remote = ranks > 1 and any(for_rank(specs, r) for r in range(1, ranks))
    in_step = args.master_gflops is None or not remote
    if args.master_link == "links" and not remote and args.link is None and not any(
            d.link is not None for d in described):
        parser.error("--master-link links is the fastest of the devices' links: no device has "
                     "one (give a bandwidth, or devices behind links: --describe NAME:...,bw=BW "
                     "or --link)")
    if args.devices is not None:   # what calibrating them here needs (rank 0's, under mpiexec)
        check_memory(net, args.batch_size, devices=host_devices(args.devices))
    if comm is not None:
        if args.devices is None:
            raise UsageError("under mpiexec pyhet plan calibrates the devices of every rank: "
                             "give --devices placing them, e.g. 0/cpu:1,1/cpu:1")
        calibrated, ranked = calibrate_ranks(args.devices, net, args.batch_size, comm,
                                             in_step=in_step,
                                             links_together=args.master_link is None,
                                             log=sys.stderr)
    elif args.devices is not None:
        calibrated = calibrate_spec(args.devices, net, args.batch_size, in_step=in_step,
                                    log=sys.stderr)
    if counts is not None:
        rows = plan.sweep(net, args.batch_size, counts, links, calibrated, described,
                          args.master_gflops, args.ddp_speed, ranked, args.master_link)
        if args.json:
            print(json.dumps({"network": net.arch, "batch_size": args.batch_size,
                              "sweep": rows}))
        else:
            print(plan_sweep_table(rows, net.arch, args.batch_size))
        return 0
    cluster = plan.build_cluster(net, args.batch_size, calibrated, described, links[0],
                                 ranked=ranked, master_link=args.master_link)
    result = plan.plan(cluster, net, args.batch_size, args.master_gflops, args.ddp_speed)
    for d, lk in zip(result["devices"], cluster.links):   # behind its rank's measured link
        if lk is not None and lk is (ranked or {}).get(d["name"], (None,))[0]:
            d["link_measured"] = True
    print(json.dumps(result) if args.json else plan_table(result))
    return 0


def _secs(seconds: float) -> str:
    """Seconds for the plan's table: four significant digits (a fast described device's times
    were all 0.00000 at five decimals, a slow one's 1615.20495), in e-notation below 0.1 ms,
    whole seconds from 10,000 s."""
    rounded = float(f"{seconds:.4g}")     # 9.99995 is 10.00, not 10.000
    if rounded == 0 or rounded >= 1e4:
        return f"{seconds:.0f}"
    if rounded < 1e-4:
        return f"{seconds:.3g}"
    return f"{rounded:.{max(0, 3 - math.floor(math.log10(rounded)))}f}"


def _gflops(rate: float) -> str:
    """A rate for the plan's table: one decimal (20000.0, not 2e+04), or three significant
    digits below 1 GFLOP/s (a slow described device's was 0.0)."""
    return f"{rate:.1f}" if rate >= 1 or rate == 0 else f"{rate:.3g}"


def _link_text(d: dict) -> str:
    """A plan device's link for the table: as given (10gbit), or a measured one's rate rounded
    (26.0 Gbit/s measured, not 25.9536gbit)."""
    if not d.get("link_measured"):
        return d["link"]
    rate = d.get("bandwidth_bytes_per_s")      # None: too fast to time ("untimed bandwidth")
    return f"{d['link'] if rate is None else _rate(rate * 8 / 1e9)} measured"


def plan_table(r: dict) -> str:
    names = [d["name"] for d in r["devices"]]
    lines = [f"plan of {r['network']}, batch {r['batch_size']}, on "
             + ", ".join(f"{d['name']} ({_gflops(d['gflops'])} GFLOP/s, {_link_text(d)})"
                         for d in r["devices"]),
             f"{'layer':<8}{'conv s':>11}  " + "".join(f"{n:>12}" for n in names)]
    for layer, row in r["layers"].items():
        lines.append(f"{layer:<8}{_secs(row['conv_s']):>11}  " + "".join(
            f"{row['devices'][n]['kernels']:>12}" for n in names))
    best = r["best_single"]
    master = ("fc layers, loss and their update, timed here: "
              if r["master_timed"] else "fc layers at ")
    lines += [f"master ({master}{_gflops(r['master_gflops'])} GFLOP/s): {_secs(r['master_s'])} s",
              f"predicted step: {_secs(r['predicted_step_s'])} s, speedup "
              + ("n/a (no device holds every layer alone)" if best is None else
                 f"{r['speedup']:.2f}x over {best['device']} alone ({_secs(best['step_s'])} s)")
              + f", bottleneck: {r['bottleneck']}"]
    traffic = r["master_traffic"]
    if traffic["interface_bytes_per_s"]:
        bound = traffic["bound_layers"]
        given = plan.link_name(plan.Link(0.0, traffic["interface_bytes_per_s"]))
        lines.append(f"master's network interface ({given}): {_bytes(traffic['bytes'])} a "
                     f"step, {_rate(traffic['gbit_per_s'])} at the predicted step; "
                     + (f"it sets the time of {', '.join(bound)}" if bound else
                        "it sets no layer's time"))
    elif traffic["bytes"]:
        lines.append(f"master's network interface: {_bytes(traffic['bytes'])} a step, "
                     f"{_rate(traffic['gbit_per_s'])} at the predicted step (the links are taken "
                     f"as independent: an interface slower than that lengthens the step; "
                     f"--master-link)")
    d = r["ddp"]
    replicas = d["replicas"]
    lines.append("data parallel (DDP"
                 + ("" if replicas == len(names) else
                    f", {replicas} of the {len(names)} devices as replicas, "
                    f"{d['replica_images']} image{'s' if d['replica_images'] > 1 else ''} each")
                 + ("" if d["speed"] == 1.0 else f", replicas at {d['speed']:g} of pyhet's speed")
                 + f"): {_secs(d['step_s'])} s (compute {_secs(d['compute_s'])} s on "
                 f"{d['slowest_device']}, all-reduce {_secs(d['allreduce_s'])} s), speedup "
                 + ("n/a" if d["speedup"] is None else f"{d['speedup']:.2f}x")
                 + f"; faster: {r['winner']}")
    return "\n".join(lines)


def _bytes(n: int) -> str:
    """Bytes in powers of 1000, three significant digits: 48.2 MB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _rate(gbit_per_s: float) -> str:
    """A rate in Gbit/s, three significant digits (Mbit/s below 1 Gbit/s)."""
    if gbit_per_s >= 1000:
        return f"{gbit_per_s:,.0f} Gbit/s"
    for unit, scale in (("Gbit/s", 1), ("Mbit/s", 1e3), ("kbit/s", 1e6)):
        if gbit_per_s * scale >= 1:
            return f"{gbit_per_s * scale:.3g} {unit}"
    return f"{gbit_per_s * 1e9:.3g} bit/s"


def plan_sweep_table(rows, network: str, batch: int) -> str:
    links = list(dict.fromkeys(r["link"] for r in rows))
    counts = list(dict.fromkeys(r["devices"] for r in rows))
    cell = {(r["devices"], r["link"]): r for r in rows}
    lines = [f"predicted speedup of {network}, batch {batch}: pyhet / DDP (the faster marked *)",
             f"{'devices':>8}" + "".join(f"{lk:>22}" for lk in links)]
    for n in counts:
        line = f"{n:>8}"
        for lk in links:
            r = cell[(n, lk)]
            a, b = r["speedup"], r["ddp_speedup"]
            text = ("n/a" if a is None else f"{a:.2f}{'*' if r['winner'] == 'pyhet' else ''}"
                    ) + " / " + ("n/a" if b is None else
                                 f"{b:.2f}{'*' if r['winner'] == 'ddp' else ''}")
            line += f"{text:>22}"
        lines.append(line)
    # why a row is n/a, once: its devices cannot hold the network (the first such row's
    # reason), or no device holds every layer alone (the speedups are over the best one alone)
    failed = [r for r in rows if r.get("error")]
    if failed:
        r, more = failed[0], len(failed) - 1
        lines.append(f"n/a at {r['devices']} described ({r['link']})"
                     + (f" and {more} more" if more else "") + f": {r['error']}")
    # per column, the most the master's own interface carries: the model takes the links as
    # independent, which a cluster on one switch is not
    busiest = [max((r for r in rows if r["link"] == lk and r.get("master_gbit_per_s")),
                   key=lambda r: r["master_gbit_per_s"], default=None) for lk in links]
    busiest = [r for r in busiest if r is not None]
    if busiest:
        given = any(r.get("master_interface_bytes_per_s") for r in rows)
        lines.append("the master's network interface carries at most "
                     + ", ".join(f"{_rate(r['master_gbit_per_s'])} ({r['link']}, "
                                 f"{r['devices']} described)" for r in busiest)
                     + (" (--master-link: a layer takes at least its bytes over it)" if given
                        else ": the links are taken as independent; an interface slower than a "
                             "row's traffic lengthens its step (--master-link)"))
    if any(r["speedup"] is None and not r.get("error") for r in rows):
        lines.append("n/a elsewhere: no device holds every layer alone (a speedup is over "
                     "the best single device)")
    return "\n".join(lines)


def _load_network(path, devices, input_shape):
    """pyhet.load for evaluate and predict (static balance: no step to re-measure). A weight
    file of an earlier version records no input shape: input_shape() gives it then."""
    _, meta = read_weight_file(path)
    return load(path, devices=devices, balance="static",
                input_shape=None if meta is not None else input_shape())


def cmd_evaluate(args) -> int:
    net = _load_network(args.weights, args.devices,
                        lambda: input_shape_of(args.dataset, args.data_dir)[0])
    with net:
        result = net.evaluate(dataset=args.dataset, data_dir=args.data_dir,
                              batch_size=args.batch_size)
    result = {"weights": str(args.weights), "dataset": args.dataset, "arch": net.arch, **result}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.weights} ({net.arch}) on the test split of {args.dataset}, "
          f"{result['images']} images:")
    print(f"loss {result['loss']:.4f}, accuracy {result['accuracy']:.4f}")
    names = net.classes or [str(c) for c in range(net.num_classes)]
    for c, (name, acc) in enumerate(zip(names, result["per_class_accuracy"])):
        # a line per class, whatever a weight file's names hold (blank, a newline, escapes)
        name = name if name.strip() and name.isprintable() else f"{c} {shown(name, 40)}"
        print(f"  {name:<14} {'-' if acc is None else f'{acc:.4f}'}")
    return 0


def cmd_predict(args) -> int:
    if args.output is not None:      # checked before any work, as --save is
        for option, given in (("--weights", args.weights), ("--input", args.input)):
            if files.same_file(args.output, given):
                raise UsageError(f"--output {args.output}: the same file as {option} {given}, "
                                 f"which writing it would replace: give another name")
        check_file_destination(args.output, "--output")
    x = read_images(args.input)
    net = _load_network(args.weights, args.devices, lambda: tuple(x.shape[1:]))
    if looks_channel_last(x.shape, net.input_shape):
        raise DataError(f"--input {args.input}: " + channel_last_message("the array", x.shape))
    if tuple(x.shape[1:]) != net.input_shape:
        raise DataError(f"--input {args.input}: images of shape {tuple(x.shape[1:])} (C, H, W), "
                        f"but the network in {args.weights} ({net.arch}) takes "
                        f"{net.input_shape}")
    with net:
        probs = net._predict(x, args.batch_size, f"--input {args.input}")
    classes = probs.argmax(axis=1)
    if args.output:
        write_npz(args.output, {"classes": classes.astype(np.int64), "probabilities": probs})
        say(f"wrote the classes and probabilities of {len(x)} images to {args.output}")
        return 0
    names = net.classes
    for c, p in zip(classes, probs):
        line = {"class": int(c), "probabilities": [round(float(v), 6) for v in p]}
        if names:
            line["name"] = names[int(c)]
        print(json.dumps(line))
    return 0


def cmd_bench(args) -> int:
    if args.name is None:
        args.command_parser.error(f"give the benchmark to run: one of {', '.join(BENCHMARKS)}")
    try:
        module = importlib.import_module(f"pyhet.bench.{args.name}")
    except ImportError:
        module = importlib.import_module(f"bench.{args.name}")  # running from a source tree
    return int(module.main(args.args) or 0)


# the options that name a file or folder: (option, an empty name is refused here; --save,
# --output and --checkpoint-dir say so where they are checked as destinations)
PATH_OPTIONS = {"data_dir": ("--data-dir", True), "init": ("--init", True),
                "weights": ("--weights", True), "input": ("--input", True),
                "save": ("--save", False), "output": ("--output", False),
                "checkpoint_dir": ("--checkpoint-dir", False)}


def _user_paths(args) -> None:
    """Every path option with a leading ~ made the home folder, as the shell does but not
    after `--opt=` (`--checkpoint-dir=~/ck` made a folder named ~ here); an empty name for an
    input is refused (--init '' trained from random weights, --data-dir '' read the default
    folder)."""
    for dest, (option, empty_refused) in PATH_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if value == "" and empty_refused:
            raise UsageError(f"{option} '': give a "
                             f"{'folder' if dest == 'data_dir' else 'file name'}")
        setattr(args, dest, files.user_path(value))


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    at = 0
    while argv[at:at + 1] == ["--debug"]:   # the one global option that lets a command follow
        at += 1
    after = argv[at + 1:at + 2]
    if argv[at:at + 1] == ["bench"] and after and after[0].startswith("-") and after[0] not in (
            "-h", "--help", "--"):   # argparse would take the option's value for the name
        parser.bench_parser.error(f"give the benchmark's name before its options (pyhet bench "
                                  f"NAME {after[0]} ...): one of {', '.join(BENCHMARKS)}")
    try:
        args = parser.parse_args(argv)
    except OutputError as e:          # --help into a closed pipe or a full disk
        return report_output_error(e)
    if files.working_folder_gone():   # (every relative path, and the defaults, need it)
        say(f"pyhet: error: {files.WORKING_FOLDER_GONE}: cd to a folder that exists")
        return 1
    ranks = launched_size()
    try:
        _user_paths(args)
        if ranks > 1:
            return run_rank(args, parser, ranks)
        if args.command == "train":
            return cmd_train(args, parser)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "devices":
            return cmd_devices(args, parser)
        if args.command == "plan":
            return cmd_plan(args, parser)
        if args.command == "evaluate":
            return cmd_evaluate(args)
        if args.command == "predict":
            return cmd_predict(args)
        parser.error(f"unknown command {args.command}")
    except OutputError as e:
        if args.debug:
            traceback.print_exc()    # shown, and the status is the same as without --debug
        return report_output_error(e)
    except PyhetError as e:
        detail = traceback.format_exc() if args.debug else ""
        if ranks > 1 and not _mpi_started():   # mpi4py missing, say: end the job
            # (every rank has the same error: its traceback once, with the line)
            refused_before_mpi(f"pyhet: error: {brief(e)}", e.exit_status, detail)
        else:
            if detail:
                sys.stderr.write(detail)
            say(f"pyhet: error: {brief(e)}")
        return e.exit_status
    except MemoryError:
        say(f"pyhet: error: {OUT_OF_MEMORY}")
        return EXIT_ERROR
    except KeyboardInterrupt as e:
        if ranks > 1:   # Ctrl-C while MPI starts, before run_rank's handlers: once it has
            # started, the other ranks would wait for this one for ever
            _abort_if_started("pyhet: interrupted" if launched_rank() == 0 else None, 130)
            if launched_rank() == 0:
                say("pyhet: interrupted")
            end_job_unstarted(130)   # before MPI started here: the others may be in its start
            return 130
        # SIGINT or SIGTERM while training (pyhet.interrupt) says what it saved; a bare Ctrl-C
        # elsewhere is a KeyboardInterrupt
        say(f"pyhet: {e.message}" if isinstance(e, Interrupted) else "pyhet: interrupted")
        return getattr(e, "exit_status", 130)
    return 0


MIN_STARTUP_S = 5.0   # the least time MPI's start-up is given under mpiexec (run_rank)


def run_rank(args, parser, ranks: int) -> int:
    """Under mpiexec with several ranks: rank 0 trains (the master), or plans (pyhet plan,
    which calibrates the devices of every rank); every other rank serves the devices placed on
    it until the master is done. An error on rank 0 ends the whole job."""
    if args.command not in ("train", "plan"):
        raise UsageError(f"pyhet {args.command} runs in one process: start it without mpiexec "
                         f"(only pyhet train and pyhet plan place devices on MPI ranks)")
    # While MPI starts (MPI_Init waits for every rank, in C, where no Python handler runs),
    # Ctrl-C or SIGTERM ends this rank by the signal itself, so that the launcher ends the
    # others; once it has started, the handlers below end the job through MPI_Abort.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # a rank that never starts (stopped, unreachable) would keep the others in MPI's start-up,
    # which holds the interpreter: after --timeout, SIGALRM's default action ends this rank,
    # and mpiexec the job, saying so in its own words
    timeout = getattr(args, "timeout", None)   # pyhet plan has none: the default
    # (at least MIN_STARTUP_S: a --timeout of a tenth of a second, fit for messages between
    # running ranks, ended every start-up by SIGALRM, in mpiexec's banner)
    limit = timeout if timeout is not None else DEFAULT_TIMEOUT
    startup = max(MIN_STARTUP_S, limit)
    # (the timer takes at most about 2**63 ns: a longer limit is none, as inf is)
    if startup < MAX_ALARM_S:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, startup)
    from .transport import mpi  # mpi4py is optional: imported only under mpiexec

    signal.setitimer(signal.ITIMER_REAL, 0)
    comm = mpi.MPI.COMM_WORLD
    if comm.Get_size() != ranks:
        raise PyhetError(f"the launcher started {ranks} ranks but MPI sees {comm.Get_size()}: "
                         f"mpi4py was built for another MPI than this mpiexec's")
    if comm.Get_rank() != 0:
        # a serving rank says nothing: rank 0 reports every error (a device that cannot be
        # made reaches it through the hello); Ctrl-C or SIGTERM (a scheduler's) ends the job,
        # rank 0 saying so where it got the signal too (Ctrl-C reaches every rank)
        def ended(said: str, status: int):
            return lambda *_: (
                time.sleep(1.0),   # where rank 0 got it too, it reports and ends the job first
                _abort(comm, f"pyhet: rank {comm.Get_rank()} {said}", status))
        signal.signal(signal.SIGINT, ended("interrupted", 130))
        signal.signal(signal.SIGTERM, ended("terminated by SIGTERM", 143))
        try:
            # (a plan without --devices: none here; rank 0 says why and ends the job)
            specs = ([] if args.devices is None else
                     parse_devices(args.devices, gpu_count=cuda_device_count))
            check_ranks(specs, ranks)
            mpi.serve(comm, specs, args.devices)
        except PyhetError:
            return EXIT_ERROR
        return 0
    # Ctrl-C or SIGTERM ends the whole job at once (the other ranks wait for messages that will
    # not come)
    signal.signal(signal.SIGINT, lambda *_: _abort(comm, "pyhet: interrupted", 130))
    signal.signal(signal.SIGTERM, lambda *_: _abort(comm, "pyhet: terminated by SIGTERM", 143))
    try:
        status = (cmd_train if args.command == "train" else cmd_plan)(args, parser, comm)
    except SystemExit as e:            # a usage error: argparse has said why
        _abort(comm, None, e.code if isinstance(e.code, int) else EXIT_USAGE)
    except BaseException as e:
        # the other ranks wait for messages that will not come: end the job with this error
        status = e.exit_status if isinstance(e, PyhetError) else 130 if isinstance(
            e, KeyboardInterrupt) else 1
        if args.debug or not isinstance(e, (PyhetError, KeyboardInterrupt, MemoryError)):
            traceback.print_exc()   # asked for, or a bug: show where
        _abort(comm, f"pyhet: error: {brief(e)}" if isinstance(e, PyhetError) else
               "pyhet: interrupted" if isinstance(e, KeyboardInterrupt) else
               f"pyhet: error: {OUT_OF_MEMORY}" if isinstance(e, MemoryError) else
               f"pyhet: error: {type(e).__name__}: {brief(e)}", status)
    try:
        mpi.dismiss(comm, limit)   # the serving ranks wait for it (not in MPI_Finalize)
    except PyhetError as e:        # a rank that is stopped would hold MPI_Finalize for ever
        _abort(comm, f"pyhet: error: {brief(e)}", e.exit_status)
    return status


def _abort(comm, message, status: int):
    """End every rank of the job with this status, after `message` reached stderr."""
    if message:
        say(message)
    sys.stderr.flush()
    time.sleep(0.3)    # the launcher forwards our stderr before it ends the job
    try:               # MPI_Abort's own line ("Abort(130) on node 0 ...") is not ours to print
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    except OSError:
        pass
    comm.Abort(status)
    os._exit(status)   # MPI_Abort may return while the launcher ends the ranks


def _mpi_started() -> bool:
    """Whether MPI has started (and not ended) in this process."""
    if "mpi4py.MPI" not in sys.modules:
        return False
    try:
        from mpi4py import MPI
        return MPI.Is_initialized() and not MPI.Is_finalized()
    except BaseException:
        return False


def _abort_if_started(message, status: int) -> None:
    """_abort where MPI has started in this process (else nothing: no rank waits on it)."""
    if _mpi_started():
        from mpi4py import MPI
        _abort(MPI.COMM_WORLD, message, status)


# ================================================================================================
# Standard output that cannot be written


def report_output_error(e: OutputError) -> int:
    """A reader of stdout that went away (pyhet predict ... | head) ends the command quietly, as
    other command-line tools do; any other failure to write (a full disk) is said in one line.
    Exit status 1 either way."""
    if e.errno != errno.EPIPE:
        say(f"pyhet: error: {brief(e)}")
    return EXIT_ERROR


class GuardedStdout:
    """sys.stdout for the console script: a write or flush that fails raises OutputError (one
    line, no traceback) instead of OSError, once; afterwards fd 1 is /dev/null, so that the
    output still buffered and Python's own flush at exit cannot fail again. A stdout that was
    closed when pyhet started (`pyhet ... >&-`) fails at the first write."""

    def __init__(self, stream):
        self._stream = stream          # None: stdout was closed

    def _failed(self, e: OSError):
        _null_fd(1)
        if self._stream is None:
            self._stream = open(os.devnull, "w")
        raise OutputError(f"cannot write to stdout: {e.strerror or e}", e.errno) from None

    def write(self, text):
        if self._stream is None:
            self._failed(OSError(errno.EBADF, "it is closed"))
        try:
            return self._stream.write(text)
        except OSError as e:
            self._failed(e)

    def flush(self):
        if self._stream is not None:
            try:
                self._stream.flush()
            except OSError as e:
                self._failed(e)

    def __getattr__(self, name):          # encoding, isatty, fileno, ...
        return getattr(self._stream, name)


def _null_fd(target: int):
    """Point the file descriptor `target` (1, 2) at /dev/null."""
    fd = os.open(os.devnull, os.O_WRONLY)
    if fd != target:
        os.dup2(fd, target)
        os.close(fd)


class QuietStderr:
    """sys.stderr for the console script: a write that fails (a full disk, a closed pipe)
    is dropped, and so is all that follows it (to /dev/null). Progress, warnings and error
    lines are reports on the work, which must not be lost for them: a run whose stderr
    cannot be written still writes its summary and --save file."""

    def __init__(self, stream):
        self._stream = stream

    def _failed(self):
        self._stream = open(os.devnull, "w")

    def write(self, text):
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            self._failed()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except (OSError, ValueError):
            self._failed()

    def __getattr__(self, name):          # encoding, isatty, fileno, ...
        return getattr(self._stream, name)


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    """A warning (more threads than cores, say) as one line on stderr, as pyhet's own warnings
    are: no source file, no line of code."""
    try:
        say(f"pyhet: warning: {brief(message)}", file)
    except (OSError, ValueError):     # stderr closed: nowhere to say it
        pass


def _terminate(signum, frame):
    raise Interrupted(signum)


def entry():  # console script (through pyhet._command)
    if sys.stdout is None:
        # fd 1 is closed: hold it with /dev/null, so that no file opened later becomes fd 1
        # and receives what a library prints there
        _null_fd(1)
    sys.stdout = GuardedStdout(sys.stdout)
    if sys.stderr is None:
        # fd 2 is closed: hold it with /dev/null too, or print(file=None) would write the
        # error lines to stdout, and a file opened later would become fd 2
        _null_fd(2)
        sys.stderr = open(os.devnull, "w")
    sys.stderr = QuietStderr(sys.stderr)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        # NumPy's floating-point warnings (overflow, invalid value) on a run that diverges: the
        # run checks its losses and weights and says what went wrong in its own error line
        warnings.filterwarnings("ignore", message=".*encountered in ", category=RuntimeWarning)
        warnings.showwarning = _one_line_warning
        if launched_size() <= 1:
            # SIGTERM as SIGINT is: one line and its status, in every command and phase
            # (training installs its own handlers, pyhet.interrupt; under mpiexec the ranks
            # have theirs). It killed the process silently before.
            signal.signal(signal.SIGTERM, _terminate)
        try:
            code = main()
            try:
                sys.stdout.flush()
            except OutputError as e:
                code = report_output_error(e)
            # the command is over, its output written: what is left is Python's shutdown,
            # where a signal killed the process without a line (Python puts back the default
            # handlers there) or broke the exit with a traceback; one now changes nothing
            # (under mpiexec, where MPI's shutdown waits for the other ranks, a signal still
            # ends a rank)
            if launched_size() <= 1:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_IGN)
        except KeyboardInterrupt as e:   # while the parser is built or reads the arguments
            if isinstance(e, Interrupted):
                say(f"pyhet: {e.message}")
                os._exit(e.exit_status)
            _loading_interrupted()
            raise
    sys.exit(code)
