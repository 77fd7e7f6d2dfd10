"""Pool segments are this user's alone: a segment anyone else made or may write is refused
before it is locked or mapped, another replica's pool is mapped read-only, nothing found
at a name can block a start, and a clean exit never leaves a segment behind, whatever
another process does at the same moment."""

from __future__ import annotations

import fcntl
import mmap
import os
import pwd
import stat
import uuid

import numpy as np
import pytest

import distkv.storage.pool
import distkv.storage.segments
from distkv.names import segment_name
from distkv.storage.pool import PAGE_BYTES, HostPool, PoolLayout
from distkv.storage.readers import PoolReaders
from distkv.storage.segments import UntrustedSegment, reclaim_stale_segments

LAYOUT = PoolLayout(num_rows=2, num_ranks=1, slot_bytes=PAGE_BYTES)
KEY = b"k" * 32 + b"\0\0\0\0"


@pytest.fixture
def name():
    n = segment_name("tseg" + uuid.uuid4().hex[:12], "r0")
    yield n
    for leftover in os.listdir("/dev/shm"):
        if leftover.startswith(n):
            os.unlink(os.path.join("/dev/shm", leftover))


def seal(pool: HostPool, row: int, fill: int, generation: int) -> None:
    rows = np.array([row])
    pool.begin_write(0, rows)
    pool.payload[0, row] = fill
    pool.seal(0, rows, [KEY], np.array([generation], dtype=np.uint64), LAYOUT.slot_bytes)


def segment_image() -> bytes:
    """The bytes of a valid segment of LAYOUT, KEY sealed in row 0 at generation 7 with
    bytes 0x66: what an attacker writes, checksum recomputed and all."""
    made = HostPool(segment_name("tseg" + uuid.uuid4().hex[:12], "image"), LAYOUT)
    try:
        seal(made, 0, 0x66, 7)
        with open(made.path, "rb") as f:
            return f.read()
    finally:
        made.close()


def as_user(uid: int, gid: int, act) -> int:
    """Run `act()` in a forked child as uid:gid; its exit status (0 when act returned True)."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no threads, only os calls
        code = 1
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            code = 0 if act() else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# ---- who may have made a segment --------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root")
def test_a_segment_another_user_made_is_refused_and_ours_is_closed_to_them(name):
    """Two users: one makes the segment of another's pool, world-writable, with a block in
    it whose checksum it computed; the victim neither attaches to it as a member nor reads
    it as a reader, and says whose it is. The victim's own segment is closed to the other."""
    nobody = pwd.getpwnam("nobody")
    path = os.path.join("/dev/shm", name)
    image = segment_image()

    def plant() -> bool:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        os.fchmod(fd, 0o666)
        os.write(fd, image)
        os.close(fd)
        return True

    assert as_user(nobody.pw_uid, nobody.pw_gid, plant) == 0
    assert os.stat(path).st_uid == nobody.pw_uid
    for member in (True, False):
        with pytest.raises(UntrustedSegment, match=f"{path} is owned by uid {nobody.pw_uid}"):
            HostPool(name, LAYOUT, create=member, member=member)
    readers = PoolReaders()
    with readers.reading(name, LAYOUT) as pool:
        assert pool is None
    assert len(readers) == 0
    with open(path, "rb") as f:
        assert f.read() == image  # refused, left as it was
    os.unlink(path)

    victim = HostPool(name, LAYOUT)
    try:
        seal(victim, 0, 0x11, 9)

        def pry() -> bool:
            try:
                os.open(path, os.O_RDONLY)
            except PermissionError:
                return True
            return False

        assert as_user(nobody.pw_uid, nobody.pw_gid, pry) == 0
    finally:
        victim.close()


def test_a_segment_others_may_write_is_refused(name):
    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.write(segment_image())
    os.chmod(path, 0o666)
    for member in (True, False):
        with pytest.raises(UntrustedSegment, match=f"{path} has mode 0666, not 0600"):
            HostPool(name, LAYOUT, create=member, member=member)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666  # left as it was


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_link_or_a_fifo_at_a_segment_name_is_refused_without_waiting(name, kind):
    path = os.path.join("/dev/shm", name)
    if kind == "symlink":
        target = HostPool(segment_name("tseg" + uuid.uuid4().hex[:12], "target"), LAYOUT)
        os.symlink(target.path, path)
        expected = "is a symbolic link"
    else:
        target = None
        os.mkfifo(path, 0o600)
        expected = "is not a regular file"
    try:
        for member in (True, False):
            with pytest.raises(UntrustedSegment, match=expected):
                HostPool(name, LAYOUT, create=member, member=member)
    finally:
        if target is not None:
            target.close()


@pytest.mark.parametrize("whose", ["another user's", "a live process's"])
def test_a_file_at_the_name_a_start_creates_under_blocks_nothing(name, whose):
    """The segment used to be made as `{path}.{pid}.tmp` with O_EXCL: another user who made
    that file first, or a live process holding one of that name (a process of another
    PID namespace with our pid), stopped the start; a reclaim removes neither."""
    path = os.path.join("/dev/shm", name)
    planted = f"{path}.{os.getpid()}.tmp"
    if whose == "another user's":
        if os.geteuid() != 0:
            pytest.skip("acting as a second user needs root")
        nobody = pwd.getpwnam("nobody")

        def plant() -> bool:
            os.close(os.open(planted, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return True

        assert as_user(nobody.pw_uid, nobody.pw_gid, plant) == 0
        holder = None
    else:
        holder = os.open(planted, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        pool = HostPool(name, LAYOUT)
        try:
            seal(pool, 1, 0x22, 3)
            assert pool.verify(0, 1, KEY, 3)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        finally:
            pool.close()
        assert not os.path.exists(path)
        assert os.path.exists(planted)  # not ours to remove
    finally:
        if holder is not None:
            os.close(holder)


# ---- readers ----------------------------------------------------------------------------


def test_another_replicas_pool_is_mapped_read_only(name):
    owner = HostPool(name, LAYOUT)
    try:
        seal(owner, 1, 0x33, 5)
        reader = HostPool(name, LAYOUT, create=False, member=False)
        try:
            out = np.empty(LAYOUT.slot_bytes, dtype=np.uint8)
            assert reader.read(0, 1, KEY, 5, out) is not None and (out == 0x33).all()
            with pytest.raises(ValueError, match="read-only"):
                reader.payload[0, 1, 0] = 0
            with pytest.raises(ValueError, match="read-only"):
                reader.begin_write(0, np.array([1]))
            for refused in (reader.claim, lambda: reader.mark_attached(0), lambda: reader.reserve_generations(1)):
                with pytest.raises(ValueError, match="mapped read-only"):
                    refused()
            assert owner.verify(0, 1, KEY, 5)  # nothing changed
            assert owner.claim()  # the reader took no lock of the replica's
        finally:
            reader.close()
    finally:
        owner.close()


# ---- a clean exit never leaves its segment behind ----------------------------------------


class Stepped:
    """Stands in for the os, fcntl and mmap modules of distkv's pool code: runs `act` just
    before the `at`-th call the party under test makes into any of them."""

    def __init__(self, at: int, act) -> None:
        self.at = at
        self.act = act
        self.calls = 0
        self.active = False
        self.acted = False

    def module(self, real):
        stepped = self

        class Module:
            def __getattr__(self, attr):
                value = getattr(real, attr)
                if not callable(value) or isinstance(value, type) and attr != "mmap":
                    return value

                def call(*args, **kwargs):
                    if stepped.active:
                        if stepped.calls == stepped.at:
                            stepped.active = False
                            stepped.act()
                            stepped.acted = True
                            stepped.active = True
                        stepped.calls += 1
                    return value(*args, **kwargs)

                return call

        return Module()

    def run(self, party) -> None:
        self.active = True
        try:
            party()
        finally:
            self.active = False


def read_as_reader(name: str) -> None:
    try:
        reader = HostPool(name, LAYOUT, create=False, member=False)
    except FileNotFoundError:
        return
    reader.close()


def attach_with_another_layout(name: str) -> None:
    """A member that fails to attach: a worker started with another configuration."""
    with pytest.raises((ValueError, FileNotFoundError)):
        HostPool(name, PoolLayout(num_rows=4, num_ranks=1, slot_bytes=PAGE_BYTES), create=False)


def reclaim(name: str) -> None:
    reclaim_stale_segments()


@pytest.mark.parametrize("party", [read_as_reader, attach_with_another_layout, reclaim])
def test_a_clean_exit_leaves_no_segment_whatever_another_process_does_at_that_moment(name, party, monkeypatch):
    """The replica's last member closes at each step in turn of what another process does
    with the segment meanwhile (a reader opening and closing it, a member failing to
    attach, a reclaim); once both are done the segment is gone. A reader used to hold a
    shared lock for a moment, and a close that met it left the segment to nobody."""
    path = os.path.join("/dev/shm", name)
    at = 0
    while True:
        owner = HostPool(name, LAYOUT)
        stepped = Stepped(at, owner.close)
        for module in (distkv.storage.pool, distkv.storage.segments):
            for real in (os, fcntl, mmap):
                if getattr(module, real.__name__, None) is real:
                    monkeypatch.setattr(module, real.__name__, stepped.module(real))
        stepped.run(lambda: party(name))
        monkeypatch.undo()
        owner.close()  # if the party made fewer calls than `at`: after it
        assert not os.path.exists(path), f"the segment outlived its last member closing before call {at} of {party.__name__}"
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(name)]
        if not stepped.acted:
            break
        at += 1
    assert at > 3  # every step of the party was tried
