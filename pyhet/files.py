"""Files named by the user: what a path is, reading one without waiting on a FIFO, and where
a file will be written (pyhet.model.write_npz's temporary name beside it)."""

from __future__ import annotations

import errno
import fcntl
import os
import stat

KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


def kind(mode: int) -> str:
    """What a file of this st_mode is, in words: "a regular file", "a FIFO", ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((words for test, words in KINDS if test(mode)), "not a regular file")


def user_path(path) -> str:
    """A path the user gave, with a leading ``~`` or ``~user`` made the home folder (also after
    ``--opt=``, where the shell leaves it), and left as it is for a user who does not exist
    (pathlib's expanduser raises RuntimeError there)."""
    return os.path.expanduser(os.fspath(path))


def working_folder_gone() -> bool:
    """Whether this process's working folder has been removed (a relative path then names
    nothing, and os.getcwd, os.path.abspath and realpath raise a bare FileNotFoundError)."""
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    return False


WORKING_FOLDER_GONE = ("the working folder no longer exists (it was removed after this "
                       "process started in it)")


def same_file(a, b) -> bool:
    """Whether the paths name one file (the same file by device and inode where both are
    there, else the same path with links resolved)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return os.path.realpath(a) == os.path.realpath(b)


def open_regular(path, error):
    """`path` opened for reading (binary) if it is a regular file (or a link to one). A FIFO,
    a device or a socket raises `error` ("PATH: not a regular file (a FIFO)") before anything
    is read: open() would wait on a FIFO for a writer forever. A missing file raises
    FileNotFoundError, as open() does."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{os.fspath(path)}: not a regular file ({kind(mode)})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


LOCK_NAME = ".lock"    # a checkpoint folder's lock file (pyhet.checkpoint)
# flock's errors where another holds the lock (LOCK_NB), and on a file system that takes no
# locks (some network and FUSE ones)
HELD = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES})
NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL,
                      errno.ENOSYS})


def held_lock(path) -> bool:
    """Whether `path` (itself, not a link's target) is a file named as a checkpoint folder's
    lock that a process holds flock()ed. Its run keeps the folder by that file: another file
    renamed over it would let a second run take the folder while the first still writes."""
    if os.fsdecode(os.path.basename(os.path.normpath(os.fspath(path)))) != LOCK_NAME:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False      # not there, a link, or unreadable: no lock of a run to keep
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)   # a run holds LOCK_EX: this fails
    except OSError as e:
        return e.errno in HELD
    finally:
        os.close(fd)      # also drops the shared lock, if it was had
    return False


def folder_of(path) -> str:
    """The folder that holds `path`, as written (``.`` for a bare name). Not normalised: the
    system resolves a path's links before its ``..`` (``link/..`` is the folder above the
    link's target), where os.path.abspath, working on the text, drops ``link/..`` whole and
    names another folder. os.path.realpath resolves as the system does, as far as the path is
    there."""
    return os.path.dirname(os.fspath(path)) or os.curdir


def shown_folder(folder) -> str:
    """A folder as a message names it: as written, the current folder by its path."""
    folder = os.fspath(folder)
    return os.getcwd() if folder in ("", os.curdir) else folder


def unreachable(folder, missing_ok: bool = False) -> "str | None":
    """Why `folder`, as written, is not a folder the system reaches, or None: the first part
    of it, from the left, that is not there, is no folder or cannot be entered. missing_ok:
    None at a part that is not there (from it on, os.makedirs makes what is missing)."""
    folder = os.fspath(folder)
    if os.path.isdir(folder):
        return None
    part = os.sep if folder.startswith(os.sep) else ""
    for name in filter(None, folder.split(os.sep)):
        part = os.path.join(part, name) if part else name
        try:
            mode = os.stat(part).st_mode
        except FileNotFoundError:
            if missing_ok:
                return None
            if part == folder.rstrip(os.sep) or os.pardir not in folder.split(os.sep):
                return f"the folder {folder} does not exist"
            return f"the folder {folder} cannot be reached: {part} does not exist"
        except OSError as e:
            return f"the folder {folder} cannot be reached: {part}: {e.strerror or e}"
        if not stat.S_ISDIR(mode):
            return f"{part} is {kind(mode)}, not a folder"
    return f"the folder {folder} cannot be reached"


def temp_name(path) -> str:
    """The hidden temporary file that write_npz writes `path` to: ``.NAME.tmp`` beside it (in
    folder_of(path), as written)."""
    path = os.fspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")


def not_regular(path) -> "str | None":
    """What stands at `path` when it is there but is no regular file ("a FIFO"), following
    links; None when it is a regular file or is not there."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else kind(mode)


def temp_in_the_way(tmp) -> "str | None":
    """What stands at the temporary name `tmp` that write_npz may not remove: a folder, a
    FIFO, ... (not following links). A regular file (a write that was cut short) or a link
    is removed by write_npz; None for those and for nothing there."""
    try:
        mode = os.lstat(tmp).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISLNK(mode) else kind(mode)


def create_new(path, mode: int = 0o666) -> int:
    """A descriptor of a new regular file at `path`, opened for writing: never an existing
    file, nor a link's target (O_EXCL, O_NOFOLLOW); FileExistsError where one is there."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                   | getattr(os, "O_CLOEXEC", 0), mode)


def destination_problem(path) -> "str | None":
    """Why write_npz may not write `path`, or None: a FIFO, a device or a folder there (a link
    to one included: a link to a regular file is itself replaced, its target left as it was),
    or something write_npz may not remove at its temporary name."""
    there = not_regular(path)
    if there is not None:
        return f"it is {there}, not a regular file"
    if held_lock(path):
        return ("it is the lock file of a checkpoint folder that a running pyhet holds "
                "(replaced, it would let another run into that folder): give another name")
    tmp = temp_name(path)
    in_the_way = temp_in_the_way(tmp)
    if in_the_way is not None:
        return f"its temporary file {tmp} is {in_the_way}: move it away"
    return None
