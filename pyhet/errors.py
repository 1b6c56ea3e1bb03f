"""The errors pyhet raises on bad input. The CLI prints their message and exits with the
error's ``exit_status``: 2 for a usage error (a bad option value or combination, a device SPEC
that cannot be parsed), 1 for the rest."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import unicodedata
import warnings


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category=RuntimeWarning) -> None:
    """warnings.warn, at the line of the first caller outside pyhet (the program's call of fit,
    predict, ...), however deep in pyhet it is said: a program's filters by module, and
    the once-per-line rule, see its own lines."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    if frame is None or frame.f_code.co_filename == threading.__file__:
        level = 2   # a thread that runs pyhet's code alone: no program's line, pyhet's caller's
    warnings.warn(message, category, stacklevel=level)


def shown(value, most: int = 60) -> str:
    """A value as a message quotes it: repr, cut short past `most` characters (a message stays
    one readable line, whatever came: a damaged file's value may be kilobytes long)."""
    if isinstance(value, str):
        return (repr(value) if len(value) <= most
                else repr(value[:most]) + f"... ({len(value)} chars)")
    try:
        text = repr(value)
    except ValueError:   # an int of over 4,300 digits, which Python does not write
        if not isinstance(value, int):
            raise
        return f"a whole number of about {value.bit_length() * 0.30103:,.0f} digits"
    return cut(text, most)


def cut(text: str, most: int = 60) -> str:
    """Text as a message quotes it, as it is (no quotes), cut short past `most` characters."""
    return text if len(text) <= most else text[:most] + f"... ({len(text)} chars)"


def said(e: BaseException) -> str:
    """An exception's message as an error line quotes it: as it is where it is one short
    printable line, else escaped and cut short (zipfile, NumPy and pickle quote a damaged
    file's bytes)."""
    text = str(e)
    return text if text.isprintable() and len(text) <= 160 else shown(text, 120)


_LONG_WORD = re.compile(r"\S{241,}")


# bidirectional overrides and isolates: they reorder what a terminal shows of the line
_BIDI = frozenset("\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _breaks_line(c: str) -> bool:
    """A character that breaks a line or drives the terminal (controls, line and paragraph
    separators, bidirectional controls); letters, spaces and joiners of any script do not."""
    return unicodedata.category(c) in ("Cc", "Zl", "Zp") or c in _BIDI


def brief(message: str) -> str:
    """A message as the command line prints it: one line, whatever a name in it holds (a
    newline, a terminal's escape: written as Python writes them in a string, \\n, \\x1b),
    and every run of more than 240 characters without a space (a path of 100 KB, say, quoted
    by an error that names it) cut to its start and end, with its length."""
    text = str(message)
    if any(_breaks_line(c) for c in text):     # \\ too then, so that \\n reads one way
        text = "".join(repr(c)[1:-1] if _breaks_line(c) or c == "\\" else c for c in text)
    return _LONG_WORD.sub(lambda m: f"{m[0][:120]}...[{len(m[0]):,} chars]...{m[0][-60:]}",
                          text)


def say(line: str, file=None) -> None:
    """One line on stderr (or `file`) in a single write, flushed: the ranks of an MPI job share
    the launcher's stderr, and print's two writes (the text, then its newline) let two ranks'
    lines run into each other."""
    stream = sys.stderr if file is None else file
    stream.write(line + "\n")
    stream.flush()


def option(name: str, python: bool = False) -> str:
    """A setting as its user gives it: `--weight-decay` on the command line, `weight_decay` in
    Python (name: the Python one)."""
    return name if python else "--" + name.replace("_", "-")


def flag(name: str, python: bool = False) -> str:
    """A switch as its user turns it on: `--resume`, or `resume=True`."""
    return f"{name}=True" if python else option(name)


class PyhetError(Exception):
    """Base of every error that is the user's input, not a bug: the message says it all."""

    exit_status = 1


class UsageError(PyhetError, ValueError):
    """A bad value of an option or argument (an lr that is not a finite number > 0, say),
    options that do not go together, or one that names an unusable place (a --save folder that
    does not exist, a checkpoint folder of another run): the command line exits with status 2.
    Also a ValueError, as Python's own bad-argument errors."""

    exit_status = 2


class ArchitectureError(PyhetError, ValueError):
    """A network description that cannot be parsed, or whose shapes cannot work (a map that
    shrinks below 1x1, a kernel larger than its padded input). The command line reports a
    description that cannot be parsed as a usage error (exit status 2)."""


class DataError(PyhetError):
    """A dataset file is missing, truncated or not in the format its name promises."""


class DeviceError(PyhetError):
    """A device SPEC that cannot be parsed, or a device that is missing or failed."""


class NoDeviceLeftError(DeviceError):
    """Every device of a run failed (pyhet.failover); the network keeps the state it had
    before the step that failed."""


class DeviceSpecError(UsageError, DeviceError):
    """A device SPEC that cannot be parsed or names what cannot be (cpu:0, a speed above 1, a
    rank the job does not have): a usage error (exit status 2)."""


class WeightsError(PyhetError):
    """A weight file whose arrays do not match the network."""


class TrainingError(PyhetError):
    """Training cannot go on (a NaN or infinite loss or weight, say)."""


class OutputError(PyhetError):
    """Standard output cannot be written (a closed pipe, a full disk); errno says why."""

    def __init__(self, message: str, errno: "int | None" = None):
        super().__init__(message)
        self.errno = errno


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM ended the run. The command line prints the message and exits with
    128 + the signal's number (130, 143). detail: what was done about it (a checkpoint)."""

    def __init__(self, signum: int, detail: str | None = None):
        self.signum = signum
        self.exit_status = 128 + signum
        self.message = f"interrupted by {signal.Signals(signum).name}" + (
            f" {detail}" if detail else "")
        super().__init__(self.message)
