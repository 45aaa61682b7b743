"""kvstore.server.checkpoint_lock: one live server per rank and checkpoint
directory, across jobs and processes; the kernel frees a dead holder's lock."""

import json
import os
import signal
import sys
import threading

import pytest

from kvstore.errors import CheckpointError
from kvstore.server.checkpoint_lock import DirLock, lock_path
from services import Proc

HOLDER = {"job": "aaaa000011112222", "server": 0, "host": "here", "pid": os.getpid(), "since": "now"}


def test_a_second_holder_is_refused_naming_the_first_and_gets_it_once_released(tmp_path):
    first = DirLock(str(tmp_path), 0)
    first.acquire(HOLDER, wait=0)
    assert json.loads(open(lock_path(str(tmp_path), 0)).read()) == HOLDER
    second = DirLock(str(tmp_path), 0)       # same process, its own open file: still excluded
    with pytest.raises(CheckpointError, match=rf"{tmp_path} is in use by job aaaa000011112222 \(server 0, "
                                              rf"pid {os.getpid()} on here, since now\): it holds "
                                              rf".*server-0.lock. Two live jobs cannot share"):
        second.acquire({**HOLDER, "job": "bbbb"}, wait=0)
    other_rank = DirLock(str(tmp_path), 1)
    other_rank.acquire(HOLDER, wait=0)       # each rank has its own lock
    first.release()
    assert not os.path.exists(lock_path(str(tmp_path), 0))   # a job that ended leaves no lock file
    second.acquire({**HOLDER, "job": "bbbb"}, wait=0)
    second.describe({**HOLDER, "job": "cccc"})
    assert DirLock(str(tmp_path), 0).holder()["job"] == "cccc"
    second.release()
    other_rank.release()
    assert os.listdir(tmp_path) == []


def test_a_holder_that_lets_go_within_the_wait_is_waited_for(tmp_path):
    class Watched(threading.Event):        # tells the test that the acquirer is retrying
        def __init__(self):
            super().__init__()
            self.retrying = threading.Event()

        def wait(self, timeout=None):
            self.retrying.set()
            return super().wait(timeout)

    first, second, stop = DirLock(str(tmp_path), 0), DirLock(str(tmp_path), 0), Watched()
    first.acquire(HOLDER, wait=0)
    errors = []

    def take():
        try:
            second.acquire({**HOLDER, "job": "bbbb"}, wait=30, stop=stop)
        except CheckpointError as e:
            errors.append(e)
    t = threading.Thread(target=take)
    t.start()
    assert stop.retrying.wait(10), "the second holder did not wait"
    first.release()
    t.join(10)
    assert not t.is_alive() and not errors and second.held
    assert DirLock(str(tmp_path), 0).holder()["job"] == "bbbb"
    second.release()


def test_a_stop_ends_the_wait_at_once(tmp_path):
    first = DirLock(str(tmp_path), 0)
    first.acquire(HOLDER, wait=0)
    stop = threading.Event()
    stop.set()
    with pytest.raises(CheckpointError, match="in use by job aaaa000011112222"):
        DirLock(str(tmp_path), 0).acquire(HOLDER, wait=60, stop=stop)     # no 60 s wait: the test's deadline
    first.release()


def test_a_killed_holders_lock_is_free_and_its_stale_file_is_taken_over(tmp_path):
    code = ("import os, signal, sys; from kvstore.server.checkpoint_lock import DirLock; "
            "DirLock(sys.argv[1], 0).acquire({'job': 'dead0000', 'server': 0, 'host': 'there', "
            "'pid': os.getpid()}, wait=0); print('locked', flush=True); signal.pause()")
    holder = Proc([sys.executable, "-c", code, str(tmp_path)])
    holder.wait_for("locked", timeout=30)
    with pytest.raises(CheckpointError, match=rf"in use by job dead0000 \(server 0, pid {holder.popen.pid} "
                                              r"on there"):
        DirLock(str(tmp_path), 0).acquire(HOLDER, wait=0)
    holder.popen.send_signal(signal.SIGKILL)
    assert holder.wait(30) == -signal.SIGKILL
    assert DirLock(str(tmp_path), 0).holder()["job"] == "dead0000"    # the file stays, its lock does not
    lock = DirLock(str(tmp_path), 0)
    lock.acquire(HOLDER, wait=0)
    assert lock.holder() == HOLDER
    lock.release()


def test_a_link_in_place_of_the_lock_file_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    os.symlink(target, lock_path(str(tmp_path), 0))
    with pytest.raises(CheckpointError, match="cannot open the checkpoint lock .*server-0.lock"):
        DirLock(str(tmp_path), 0).acquire(HOLDER, wait=0)
    assert target.read_text() == "keep"
