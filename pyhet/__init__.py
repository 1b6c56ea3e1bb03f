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



def _is_command() -> bool:
    """Whether this process is the `pyhet` command (its console script, or python -m pyhet),
    not a program of its own that imports pyhet."""
    import os
    import sys

    if os.path.basename(sys.argv[0] or "") == "pyhet":
        return True
    # `python [OPTIONS] -m pyhet`: argv[0] is "-m" by now; the interpreter's options come
    # before it (a program's own "-m pyhet", after its script's name, is not it)
    argv = getattr(sys, "orig_argv", [])
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            return argv[i + 1:i + 2] == ["pyhet"]
        if a == "-c" or not a.startswith("-"):
            return False
        i += 2 if a in ("-X", "-W") else 1     # (their value is the next word)
    return False


def _loading_failed(e: ImportError) -> None:
    """The `pyhet` command run in its source folder, whose pyhet/ has no built core (an
    ImportError that says so whole: said_whole): one line (rank 0's, under mpiexec) and status
    1, as its other errors, not a traceback. Any other failed import (a broken install) keeps
    its traceback, which shows where; and where pyhet is imported by a program of its own,
    nothing: it re-raises."""
    import sys

    if getattr(e, "said_whole", False) and _is_command():
        from .transport import launched_rank
        if launched_rank() == 0:
            try:
                sys.stderr.write(f"pyhet: error: {e}\n")
                sys.stderr.flush()
            except (AttributeError, OSError, ValueError):
                pass
        raise SystemExit(1)


def _loading_interrupted() -> None:
    """Ctrl-C while the `pyhet` command loads its modules (NumPy, the core: up to a second on
    a busy machine): its status and one line (rank 0's, under mpiexec), as later on, not a
    traceback. Where pyhet is imported by a program of its own, nothing: it re-raises."""
    import os
    import sys

    if _is_command():
        from .transport import launched_rank, launched_size
        if launched_rank() == 0:
            try:     # one write: ranks share stderr (None where fd 2 was closed)
                sys.stderr.write("pyhet: interrupted\n")
                sys.stderr.flush()
            except (AttributeError, OSError, ValueError):
                pass
        if launched_size() > 1:   # under mpiexec the launcher must end the other ranks (an
            # exit status alone it waits out): asked to, with 130 (MPICH's), else by the signal
            from .transport import end_job_unstarted
            if not end_job_unstarted(130):
                import signal
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
        os._exit(130)


def _is_interrupt(e: BaseException) -> bool:
    """Whether an exception of loading is Ctrl-C: a KeyboardInterrupt, or one in disguise, an
    ImportError with it in its chain (NumPy reports a KeyboardInterrupt while its C extensions
    load as a failed import, with a page of advice on broken installs)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


try:
    from . import errors, ops
    from .api import Network, load
    from .data import Dataset, load_dataset
except (KeyboardInterrupt, ImportError) as e:
    if _is_interrupt(e):
        _loading_interrupted()
    if isinstance(e, ImportError):
        _loading_failed(e)
    raise

__version__ = "0.1.0"
__all__ = ["Network", "load", "load_dataset", "Dataset", "errors", "ops", "__version__"]
