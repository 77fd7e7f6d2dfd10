"""The files behind host pools: created ours alone, opened only if ours alone, removed by
the last process that holds one or, once none does, by a reclaim.

A pool segment (`/dev/shm/distkv-<namespace>-<replica>`, `distkv.names`) is opened only if
it is a regular file owned by this process's user with mode 0600. Anything else found at
that name (another user's file, a link, a file others may write) is refused with
`UntrustedSegment`, naming the file and what is wrong, before it is locked or mapped:
whoever else can write a segment we map reads our blocks and writes blocks we accept (a
checksum is no secret).

Liveness is an flock: every member process of a segment (the replica's scheduler and
workers) holds a shared lock on it, so a segment nobody can lock exclusively belongs to
someone alive, and one that can be locked was left by killed processes and is reclaimed.
Readers of another replica's pool take no lock at all: liveness is the replica's own.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import tempfile

from distkv.names import SEGMENT_PREFIX

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_MODE = 0o600


class UntrustedSegment(PermissionError):
    """A file at a pool segment's name that is not this user's alone."""


def open_segment(path: str, writable: bool) -> int:
    """A descriptor of the segment at `path`, read-write or read-only; FileNotFoundError if
    there is none, UntrustedSegment if it is not a regular file of this user's with mode
    0600. Never follows a link, never waits (a FIFO at the name is refused, not opened)."""
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UntrustedSegment(f"pool segment {path} is a symbolic link: refusing to open it") from e
        raise
    try:
        check_trusted(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_trusted(fd: int, path: str) -> None:
    """Raise UntrustedSegment unless `fd` is a regular file owned by this process's user
    with mode 0600; the message names `path`, what is wrong and what to do."""
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    elif stat.S_IMODE(st.st_mode) != SEGMENT_MODE:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}, not {SEGMENT_MODE:04o}"
    if problem is not None:
        raise UntrustedSegment(
            f"pool segment {path} {problem}: refusing to use it (whoever else can write a pool reads "
            "its blocks and writes blocks it accepts); remove the file, or find who made it"
        )


def lock_member(fd: int, path: str) -> bool:
    """Take a member's shared lock on the segment open as `fd`: whether `path` still names
    it once locked (else `fd` is closed: the segment was reclaimed meanwhile)."""
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            return True
    except FileNotFoundError:
        pass
    os.close(fd)
    return False


def create_segment(path: str, size: int, superblock: bytes) -> int | None:
    """Create the segment at `path`, `size` bytes starting with `superblock`, mode 0600,
    member-locked: its descriptor, or None if another process published one first or a
    reclaim took ours before it was locked (open it then, or try again).

    It is made under a name no one can guess (`tempfile.mkstemp`) and published by a hard
    link, complete: no file anyone made beforehand blocks it, and no process ever opens
    a segment not yet initialized.
    """
    shm_dir = os.path.dirname(path)
    free = os.statvfs(shm_dir)
    if free.f_bavail * free.f_frsize < size:
        raise ValueError(
            f"pool needs {size} bytes of shared memory but {shm_dir} has "
            f"{free.f_bavail * free.f_frsize} free: lower cpu_bytes_to_use or enlarge "
            f"{shm_dir} (docker: --shm-size)"
        )
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=shm_dir)
    try:
        os.fchmod(fd, SEGMENT_MODE)  # whatever the umask
        fcntl.flock(fd, fcntl.LOCK_SH)
        # Reserve the pages now: a later page fault on a full tmpfs would be a SIGBUS.
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, superblock, 0)
        try:
            os.link(tmp, path)  # publish atomically, already initialized
        except FileExistsError:
            os.close(fd)
            return None  # another process of the replica won the race: attach to it
        except FileNotFoundError:
            os.close(fd)
            return None  # reclaimed before we locked it: start over
        return fd
    except OSError as e:
        os.close(fd)
        if e.errno == errno.ENOSPC:
            raise ValueError(
                f"{shm_dir} ran out of space reserving {size} bytes for the pool: "
                "lower cpu_bytes_to_use or enlarge it"
            ) from e
        raise
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def release_member(fd: int, path: str) -> bool:
    """Drop a member's lock and close `fd`, removing the segment if no other process holds
    it: whether this removed it.

    Every member that lets go (closing, or failing to attach) unlocks first and only then
    tries the exclusive lock, so whichever tries last after the last shared lock is gone
    gets it and removes the segment: no pair of members letting go at once each leaves
    it to the other. A process that holds the exclusive lock meanwhile (a reclaim, another
    member letting go) removes it itself.
    """
    removed = False
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # another process holds it: alive, or removing it
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
                removed = True
        except FileNotFoundError:
            pass
        return removed
    finally:
        os.close(fd)


def reclaim_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove this user's distkv segments (and leftovers of their creation) that no live
    process holds; returns their names. Another user's files are never touched."""
    reclaimed = []
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(SEGMENT_PREFIX)]
    except FileNotFoundError:
        return reclaimed
    for name in names:
        path = os.path.join(shm_dir, name)
        try:
            fd = open_segment(path, writable=False)
        except OSError:
            continue  # gone already, or not ours alone
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # held by a live process
        try:
            # Attachers re-check the inode after locking, so unlinking under our lock is safe.
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
                reclaimed.append(name)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    if reclaimed:
        logger.info("reclaimed %d stale shared-memory segment(s): %s", len(reclaimed), reclaimed)
    return reclaimed
