"""Reading .npz (and .npy) files given by the user, with one-line errors that say what the file
is and what it should be, never NumPy's advice to load pickles.

np.load(allow_pickle=False) answers a file that is not an .npz with messages about pickled
data, "No data left in file" or "File is not a zip file", and an array of Python objects with
"Object arrays cannot be loaded when allow_pickle=False"; read() looks at the file's first bytes
first, and reads every array on its own, so the error can name the array.
"""

from __future__ import annotations

import os
import zipfile
import zlib

import numpy as np

NPY_MAGIC = b"\x93NUMPY"                          # an .npy file (np.save)
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")       # a zip archive (np.savez), or an empty one


def read(path, error, expected: str, keys=None, npy: bool = False):
    """{name: array} of the .npz file at `path` (only `keys` where given, those present), or,
    with npy=True, the array of an .npy file. Anything else raises `error` (a PyhetError class)
    with "PATH: what it is; expected EXPECTED" in one line."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise error(f"{path}: a folder, not a file; expected {expected}")
    try:
        with open(path, "rb") as f:
            head = f.read(len(NPY_MAGIC))
            f.seek(0)
            if not head:
                raise error(f"{path}: an empty file; expected {expected}")
            if head.startswith(NPY_MAGIC):
                if not npy:
                    raise error(f"{path}: a single .npy array (np.save); expected {expected}")
                return _array(lambda: np.load(f, allow_pickle=False), path, None, error)
            if not head.startswith(ZIP_MAGICS):
                kind = "an .npy or .npz file" if npy else "an .npz file (a zip archive)"
                raise error(f"{path}: not {kind}; expected {expected}")
            # np.load is handed an open file, not the name: for a broken zip, np.load(name)
            # leaves its own handle open
            try:
                archive = np.load(f, allow_pickle=False)
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
                raise error(f"{path}: not a readable .npz file ({e}); truncated?") from None
            with archive:
                names = [k for k in archive.files if keys is None or k in keys]
                return {k: _array(lambda: archive[k], path, k, error) for k in names}
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None


def read_names(path) -> list:
    """The names of the arrays in an .npz file that read() has read."""
    with zipfile.ZipFile(path) as z:
        return [n[:-len(".npy")] if n.endswith(".npy") else n for n in z.namelist()]


def _array(load, path, key, error):
    """load() of one array, its failures said in one line naming it."""
    what = f"array {key!r}" if key is not None else "the array"
    try:
        return load()
    except ValueError as e:
        if "allow_pickle" in str(e) or "pickle" in str(e).lower():
            raise error(f"{path}: {what} holds Python objects (a pickle), which pyhet does not "
                        f"load; save numeric arrays (float32, uint8, integers)") from None
        raise error(f"{path}: {what} cannot be read ({e})") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise error(f"{path}: {what} cannot be read ({e}); truncated file?") from None
