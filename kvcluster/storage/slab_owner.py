"""One owner per nvme slab file: an OS lock held while its backend lives, and the owner's pid beside it.

Why: a slab's slot index lives in its owner's memory only. Two backends on one file (two replicas on one
node given the same path) would each hand out the same slots and overwrite each other's blocks, and every
read of the loser would fail its checksum. So a second opener is refused (`SlabInUse`) before it writes.

Why `flock` on the slab's own descriptor: a flock belongs to an open file description, so a second open in
the same process conflicts too (POSIX `fcntl` locks would not), and the kernel drops it when the last
descriptor closes, so a process that dies, even killed, frees its slab. A process forked while it holds one
shares the lock until the child closes or exits. A slab file unlinked and created again is a new file,
with a lock of its own: the old owner keeps its inode, nothing is shared.

The pid goes into `<slab>.owner` only for the refusal's message: it is written whole (temp file, rename)
once the lock is held and removed before the lock is let go; a dead owner's stale file is overwritten by the
next one.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .base import StorageError

OWNER_SUFFIX = ".owner"


class SlabInUse(StorageError):
    """Another live backend, in this process or another, owns the slab file; the message names it and its pid."""


def owner_file(slab: Path) -> Path:
    """Where the pid of `slab`'s owner is recorded."""
    return slab.with_name(slab.name + OWNER_SUFFIX)


def hold(fd: int, slab: Path) -> None:
    """Own `slab`, open as `fd`, until `let_go`; SlabInUse (naming the owner's pid) when someone else does, a
    StorageError when the file cannot be locked. `fd` stays open either way: the caller closes it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SlabInUse(f"nvme: the slab file {slab} is in use by {recorded_owner(slab)}: its blocks are that "
                        f"backend's, whose slot index lives in its memory. Give this tier a path of its own, or "
                        f"close the other backend first") from None
    except OSError as exc:  # a filesystem without locks: an owner could not keep a second opener out
        raise StorageError(f"nvme: cannot lock the slab file {slab}: {exc.strerror or exc}") from None
    _record_owner(slab)


def let_go(fd: int, slab: Path) -> None:
    """Stop owning `slab` and close `fd`: the record goes first, while the lock still keeps others out."""
    try:
        owner_file(slab).unlink(missing_ok=True)
    finally:
        os.close(fd)


def recorded_owner(slab: Path) -> str:
    """The recorded owner as a message names it ("pid N"), or what is known while none is recorded."""
    try:
        return f"pid {int(owner_file(slab).read_text())}"
    except (OSError, ValueError):
        return "another process (its pid is not recorded yet)"


def _record_owner(slab: Path) -> None:
    """This process's pid in the owner file, written whole: a reader sees the old pid or the new one."""
    final = owner_file(slab)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{os.getpid()}\n")
        os.replace(tmp, final)
    except OSError:  # the lock holds regardless; a refused opener's message then lacks the pid
        tmp.unlink(missing_ok=True)
