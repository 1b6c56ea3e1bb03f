"""Reading .npz (and .npy) files given by the user, with one-line errors that say what the file
is and what it should be, never NumPy's advice to load pickles.

np.load(allow_pickle=False) answers a file that is not an .npz with messages about pickled
data, "No data left in file" or "File is not a zip file", an array of Python objects with
"Object arrays cannot be loaded when allow_pickle=False", and gives a member of the zip archive
that is not an .npy array as its raw bytes; read() looks at the file's first bytes first, and
reads every array on its own, so the error can name the array.
"""

from __future__ import annotations

import ast
import math
import os
import re
import zipfile
import zlib

import numpy as np

from . import files
from .errors import cut, said

NPY_MAGIC = b"\x93NUMPY"                          # an .npy file (np.save)
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")       # a zip archive (np.savez), or an empty one


def read(path, error, expected: str, keys=None, npy: bool = False):
    """{name: array} of the .npz file at `path` (only `keys` where given, those present), or,
    with npy=True, the array of an .npy file. Anything else raises `error(message)` (a PyhetError)
    with "PATH: what it is; expected EXPECTED" in one line."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise error(f"{path}: a folder, not a file; expected {expected}")
    try:
        with files.open_regular(path, error) as f:      # a FIFO: refused, not waited on
            head = f.read(len(NPY_MAGIC))
            f.seek(0)
            if not head:
                raise error(f"{path}: an empty file; expected {expected}")
            if head.startswith(NPY_MAGIC):
                if not npy:
                    raise error(f"{path}: a single .npy array (np.save); expected {expected}")
                _check_size(f, os.fstat(f.fileno()).st_size, path, None, error)
                f.seek(0)
                return _array(lambda: np.load(f, allow_pickle=False), path, None, error)
            if not head.startswith(ZIP_MAGICS):
                kind = "an .npy or .npz file" if npy else "an .npz file (a zip archive)"
                raise error(f"{path}: not {kind}; expected {expected}")
            # np.load is handed an open file, not the name: for a broken zip, np.load(name)
            # leaves its own handle open
            try:
                archive = np.load(f, allow_pickle=False)
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
                raise error(f"{path}: not a readable .npz file ({said(e)}); "
                            f"truncated?") from e
            except MemoryError:
                raise
            except Exception as e:    # zipfile's NotImplementedError (a zip version), ...
                raise error(f"{path}: not a readable .npz file ({type(e).__name__}: "
                            f"{said(e)})") from None
            with archive:
                _check_directory(archive.zip, f, path, error)
                names = [k for k in archive.files if keys is None or k in keys]
                for k in names:
                    _check_member_size(archive.zip, k, path, error)
                return {k: _array(lambda: archive[k], path, k, error) for k in names}
    except FileNotFoundError as e:
        raise error(f"{path}: no such file") from e
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from e


def _check_directory(zf, f, path, error) -> None:
    """The zip's end record counts the entries of its directory; zipfile reads the entries
    until the directory's size in bytes is used up, so a damaged length inside it hides the
    entries after it (a dataset without its test split) with no error."""
    try:
        f.seek(0)
        end = zipfile._EndRecData(f)
        promised = None if end is None else end[zipfile._ECD_ENTRIES_TOTAL]
    except Exception:        # not this Python's zipfile: the check is left out
        return
    found = len(zf.infolist())
    if promised is not None and promised != found:
        raise error(f"{path}: its zip directory lists {promised} entries, but {found} can be "
                    f"read; a damaged file")


def read_names(path, error) -> list:
    """The names of the arrays in an .npz file that read() has read."""
    try:
        with files.open_regular(path, error) as f, zipfile.ZipFile(f) as z:
            return [n[:-len(".npy")] if n.endswith(".npy") else n for n in z.namelist()]
    except (OSError, zipfile.BadZipFile) as e:      # changed since read() read it
        raise error(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from e


def _check_size(fp, size: int, path, key, error) -> None:
    """An .npy array at the start of fp (of `size` bytes in all) whose header promises more
    data than there is: a truncated or damaged file, said so before NumPy allocates what the
    header promises (which ends in MemoryError, or in the machine's memory taken). One with
    bytes past its data (which np.load ignores) is refused too: np.save writes none. Anything
    that is not an .npy header is left to np.load."""
    what = f"array {key!r}" if key is not None else "the array"
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(fp)
        else:                # 3.0: a UTF-8 header, read by NumPy's public parts
            length = int.from_bytes(fp.read(4), "little")
            fields = ast.literal_eval(fp.read(length).decode("utf-8"))
            shape, dtype = fields["shape"], np.lib.format.descr_to_dtype(fields["descr"])
            if not isinstance(shape, tuple):
                return
        have = size - fp.tell()
    except Exception:        # any failure here, np.load reports in its own words
        return
    if dtype.hasobject or not all(type(d) is int for d in shape):
        return               # refused by np.load(allow_pickle=False), or by its reshape
    if any(d < 0 for d in shape):
        raise error(f"{path}: the header of {what} gives the shape {shape}; truncated or "
                    f"damaged file?")
    need = math.prod(shape) * dtype.itemsize
    kind = cut(str(dtype))   # (a structured dtype's text may run to kilobytes)
    if need > have:
        raise error(f"{path}: the header of {what} promises {kind} of shape {shape} "
                    f"({need:,} bytes), the file holds {max(have, 0):,}; truncated file?")
    if need < have:          # np.save writes the data and nothing after it
        more = ("more than one array saved into it" if key is None
                else "a member changed by hand")
        raise error(f"{path}: {what} holds {have - need:,} bytes past the {need:,} its header "
                    f"gives ({kind} of shape {shape}); a damaged file, or {more}?")


def _check_member_size(zf, key, path, error) -> None:
    """_check_size of the archive's member `key` (KEY.npy, or KEY as np.load also reads)."""
    names = zf.namelist()
    member = key + ".npy" if key + ".npy" in names else key if key in names else None
    if member is None:
        return
    try:
        info = zf.getinfo(member)
        m = zf.open(member)
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error, ValueError):
        return               # np.load's reading of it says what is wrong
    except MemoryError:
        raise
    except Exception as e:   # an encrypted member, a compression zipfile does not read, ...
        raise error(f"{path}: array {key!r} cannot be read ({type(e).__name__}: "
                    f"{said(e)})") from None
    with m:
        _check_size(m, info.file_size, path, key, error)


def _array(load, path, key, error):
    """load() of one array, its failures said in one line naming it."""
    what = f"array {key!r}" if key is not None else "the array"
    try:
        a = load()
    except ValueError as e:
        if "max_header_size" in str(e):   # (its advice names allow_pickle too: no pickle)
            size = re.search(r"length \((\d+)\)", str(e))
            raise error(f"{path}: {what} has a header of "
                        f"{f'{int(size.group(1)):,} bytes' if size else 'more bytes'}, more "
                        f"than NumPy reads from a file it does not trust (np.save writes about "
                        f"128 for an array of numbers): a damaged or hand-made file") from None
        if "allow_pickle" in str(e) or "pickle" in str(e).lower():
            raise error(f"{path}: {what} holds Python objects (a pickle), which pyhet does not "
                        f"load; save numeric arrays (float32, uint8, integers)") from None
        raise error(f"{path}: {what} cannot be read ({said(e)})") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        # a checksum that fails, or a compressed stream that does not decode: bytes changed in
        # a file of its full length (one cut short fails its size check before it is read)
        guess = ("damaged file?" if isinstance(e, zlib.error) or "CRC" in str(e)
                 else "truncated file?")
        raise error(f"{path}: {what} cannot be read ({said(e)}); {guess}") from e
    except MemoryError:
        raise
    except Exception as e:   # lzma's errors, a header NumPy's parser chokes on, ...
        raise error(f"{path}: {what} cannot be read ({type(e).__name__}: "
                    f"{said(e)})") from None
    if not isinstance(a, np.ndarray):
        # np.load gives the raw bytes of a member of the archive that is not an .npy array
        raise error(f"{path}: {what} is not an .npy array (np.save's format) but "
                    f"{len(a)} bytes of something else")
    return a
