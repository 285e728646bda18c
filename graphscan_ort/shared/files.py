"""Writing outputs so that they are the old file or all of the new one."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat

from graphscan import (
    EXIT_NO_FILE,
    GraphscanError,
    shown,
)

# A temporary output file is named like this, beside the output: short (a
# 250-character output name still fits NAME_MAX), hidden, never ``*.onnx``.
TEMPORARY_PREFIX = ".graphscan-"


TEMPORARY_SUFFIX = ".partial"


def check_output_path(path: str) -> int | None:
    """Exit 3 unless ``path`` can be replaced: it is absent or a regular file,
    in a folder that exists. A device, FIFO or folder there is left untouched."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise GraphscanError(f"{shown(path)}: cannot write (no folder {shown(folder)})", EXIT_NO_FILE)
        return None
    except (OSError, ValueError) as exc:
        raise GraphscanError(f"{shown(path)}: cannot write ({getattr(exc, 'strerror', None) or exc})", EXIT_NO_FILE)
    if not stat.S_ISREG(mode):
        raise GraphscanError(f"{shown(path)}: exists and is not a regular file; left untouched", EXIT_NO_FILE)
    return mode


def write_atomically(data: bytes, path: str) -> None:
    """Write ``data`` to ``path`` so that it is either the old file or all of the new one.

    The bytes go to a temporary file in the target's folder, are fsynced,
    renamed over the target, and the folder is fsynced. A symbolic link is
    written through. A run killed half-way leaves at most one
    ``.graphscan-*.partial`` file, which is never taken for the output.
    """
    import tempfile

    target = os.path.realpath(path) if os.path.islink(path) else path
    old_mode = check_output_path(target)
    folder = os.path.dirname(os.path.abspath(target))
    if old_mode is None:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    else:
        mode = stat.S_IMODE(old_mode)
    temporary = None
    try:
        fd, temporary = tempfile.mkstemp(prefix=TEMPORARY_PREFIX, suffix=TEMPORARY_SUFFIX, dir=folder)
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(temporary, target)
        temporary = None
    except OSError as exc:
        raise GraphscanError(f"{shown(path)}: cannot write ({exc.strerror or exc})", EXIT_NO_FILE)
    finally:  # also on KeyboardInterrupt
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    fsync_folder(folder)


def fsync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable; file systems that cannot are not an error."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_out(out: str) -> str:
    """The folder ``out`` goes in; exit 3 unless ``out`` is absent or an empty folder there."""
    name = os.path.basename(os.path.normpath(out)) if out else ""
    if not out or name in ("", ".", "..") or os.path.normpath(out) in (os.sep, os.curdir):
        raise GraphscanError(f"{shown(out)}: not a folder name tune can create and rename into place", EXIT_NO_FILE)
    if os.path.islink(out):  # renamed over, the link would go and its folder stay empty
        raise GraphscanError(f"{shown(out)}: a symbolic link; give the folder itself", EXIT_NO_FILE)
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise GraphscanError(f"{shown(out)}: cannot write (no folder {shown(parent)})", EXIT_NO_FILE)
    try:
        occupied = os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out))
    except OSError as exc:  # an unreadable folder: it cannot be checked empty, so it is not written
        raise GraphscanError(f"{shown(out)}: cannot read ({exc.strerror or exc}); left untouched", EXIT_NO_FILE)
    if occupied:
        raise GraphscanError(f"{shown(out)}: exists and is not an empty folder; left untouched", EXIT_NO_FILE)
    return parent


# What a failure to write says (a full disk, a read-only or quota-bound file system):
# never a refusal of the quantizer's or a model's fault.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EIO}
WRITE_FAILURE = re.compile(r"No space left|Disk quota|Read-only file system|File too large", re.I)


def write_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (from onnx, the quantizer or onnxruntime) says that a file could not be written."""
    if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
        return True
    return bool(WRITE_FAILURE.search(str(exc)))


def free_bytes(folder: str) -> int | None:
    """The bytes a user may still write on ``folder``'s file system (None: unknown)."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):  # AttributeError: no statvfs on this system
        return None
    return st.f_bavail * st.f_frsize


def out_of_room(folder: str, needed: int) -> bool:
    """Whether ``folder``'s file system has fewer than ``needed`` bytes left: a file of that
    size written there failed for want of room, whatever the writer said (the quantizer
    writes a truncated model on a full disk and fails later, reading it back)."""
    free = free_bytes(folder)
    return free is not None and free < needed


def in_folder(exc: BaseException, folder: str) -> bool:
    """Whether ``exc`` names a file inside ``folder``."""
    names = [getattr(exc, "filename", None), getattr(exc, "filename2", None)]
    inside = os.path.join(os.path.abspath(folder), "")
    return any(isinstance(n, str) and os.path.abspath(n).startswith(inside) for n in names) or inside in str(exc)


PLACED = ("model.onnx", "prepared.onnx", "report.html")  # what tune leaves in --out


def place(work: str, out: str) -> None:
    """Keep tune's files (PLACED) in ``work`` and rename it to ``out`` (absent or empty)."""
    for name in os.listdir(work):
        if name not in PLACED:
            target = os.path.join(work, name)
            shutil.rmtree(target) if os.path.isdir(target) else os.unlink(target)
    try:
        # A folder the user gets has the umask's mode, as mkdir gives it, not mkdtemp's 0700.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(work, 0o777 & ~umask)
        if os.path.isdir(out):
            os.rmdir(out)  # empty, as check_out saw it
        os.rename(work, out)
    except OSError as exc:
        raise GraphscanError(f"{shown(out)}: cannot write ({exc.strerror or exc})", EXIT_NO_FILE)
