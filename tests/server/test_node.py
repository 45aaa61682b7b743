"""kvstore.server.node on its own: a :class:`ServerNode` made from its Config and run
in a thread against a real scheduler (tracker.control.rendezvous) and a registered
worker (:class:`~kvstore.worker.job.JobMember`), its data socket reached with a
plain ZeroMQ DEALER on 127.0.0.1 (random ports).

Pinned from its docstring and run(): a server binds, joins the job, answers every
message (a malformed one with an error reply naming what is wrong, its id when
readable) and keeps serving, and ends with 0 once every worker finished; a server
that cannot start or resume as configured ends with 1 and fails the job, naming
itself and the setting; a server outside a job is refused at once, naming what is
missing.
"""

from __future__ import annotations

import threading

import pytest
import zmq

from kvstore.config import Config
from kvstore.errors import ConfigError
from kvstore.protocol import decode, encode, ops
from kvstore.server.node import ServerNode
from kvstore.transport.endpoints import Advert
from kvstore.worker.job import JobMember
from tracker.control.rendezvous import Scheduler
from tracker.control.security import Security

pytestmark = pytest.mark.timeout(60)

TIMING = {"timeout": 20.0, "heartbeat_interval": 0.2, "heartbeat_timeout": 5.0}


class OneServerJob:
    """A scheduler for one worker and ``servers`` servers, server 0 a ServerNode of
    ``settings`` running in a thread, the worker registered (``registration``)."""

    def __init__(self, servers: int = 1, **settings):
        self.scheduler = Scheduler(1, servers, timeout=TIMING["timeout"],
                                   heartbeat_interval=TIMING["heartbeat_interval"],
                                   heartbeat_timeout=TIMING["heartbeat_timeout"],
                                   security=Security(None, False)).start()
        common = dict(scheduler_host="127.0.0.1", scheduler_port=self.scheduler.port, num_workers=1,
                      num_servers=servers, exit_on_abort=False, transport="tcp", data_channel=False, **TIMING)
        self.node = ServerNode(Config(role="server", rank=0, **common, **settings))
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, name="test-server-node")
        self.thread.start()
        self.worker = JobMember(Config(role="worker", rank=0, **common))
        self.registration = self.worker.register() if servers == 1 else None

    def _run(self) -> None:
        self.code = self.node.run()

    def ended(self) -> int | None:
        """The server's exit status, once it returned (None if it did not in time)."""
        self.thread.join(15)
        return self.code

    def close(self) -> None:
        if self.thread.is_alive() and not self.worker.membership.aborted.is_set():
            self.worker.membership.fail("the test ended")         # (a failed test: end at once)
        self.worker.membership.close()
        self.thread.join(15)
        self.scheduler.close()


@pytest.fixture
def start():
    made: list = []

    def make(**settings) -> OneServerJob:
        job = OneServerJob(**settings)
        made.append(job)
        return job
    yield make
    for job in made:
        job.close()


def test_a_server_outside_a_job_is_refused_naming_what_is_missing():
    with pytest.raises(ConfigError, match=r"a kvstore server needs a running job, but KVSTORE_SCHEDULER_HOST "
                                          r"\(or DMLC_PS_ROOT_URI\), .* are not set"):
        ServerNode(Config(role="server", rank=0))


def test_malformed_messages_get_error_replies_and_the_server_serves_on_until_every_worker_finished(start):
    job = start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(Advert.parse(job.registration.servers[0]).url("tcp"))    # the server's ROUTER

    def ask(frames) -> dict:
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no reply"
        return decode(sock.recv_multipart())[0]
    try:
        reply = ask([b"\xc1garbage"])
        assert reply["op"] == ops.ERROR and reply["kind"] == "ProtocolError" and reply["id"] is None
        reply = ask(encode({"op": ops.PULL, "id": 5, "chunks": [[0, 0]]}))            # no src
        assert (reply["op"], reply["id"], reply["kind"]) == (ops.ERROR, 5, "ProtocolError")
        assert "a request needs an integer 'src' and 'id'" in reply["message"]
        reply = ask(encode({"op": "launch_missiles", "id": 6, "src": 0}))
        assert (reply["op"], reply["id"]) == (ops.ERROR, 6)
        reply = ask(encode({"op": ops.CONFIGURE, "id": 7, "src": 0, "mode": "sync", "num_workers": 1}))
        assert (reply["op"], reply["id"]) == (ops.OK, 7)                               # still serving
    finally:
        sock.close()
        ctx.term()
    assert job.code is None and job.thread.is_alive()
    job.worker.finish()
    assert job.ended() == 0


def test_resume_without_a_checkpoint_directory_ends_the_server_with_1_and_fails_the_job_naming_it(start):
    job = start(resume=True)
    assert job.ended() == 1
    assert job.worker.membership.aborted.wait(10)
    reason = job.worker.membership.abort_reason
    assert "server 0 cannot resume: KVSTORE_RESUME is set but KVSTORE_CHECKPOINT_DIR is not" in reason


def test_replicas_with_one_server_end_the_server_with_1_and_fail_the_job_naming_the_setting(start):
    job = start(replicas=True)
    assert job.ended() == 1
    assert job.worker.membership.aborted.wait(10)
    assert ("server 0 cannot start: KVSTORE_REPLICAS=1 needs at least 2 servers (a backup on another server); "
            "this job has 1") in job.worker.membership.abort_reason
