"""MXNet's ``kv._send_command_to_servers``: start, stop and dump a profile of every
server (pstats files, one per server); bad commands are refused and change nothing."""

import os
import pstats
import re

import numpy as np
import pytest

import kvstore
from tracker.control.security import new_secret


def test_profile_every_server_and_read_the_files_with_pstats(make_cluster, tmp_path):
    def job(kv):
        kv.init("w", np.zeros(5000, np.float32))
        if kv.rank == 0:
            assert kv._send_command_to_servers("profile_start") == ["", ""]
        kv.barrier()
        out = np.empty(5000, np.float32)
        for _ in range(3):
            kv.pushpull("w", np.ones(5000, np.float32), out=out)
        kv.barrier()
        if kv.rank == 0:
            kv._send_command_to_servers("profile_stop")
            return [kv._send_command_to_servers("profile_dump"),
                    kv._send_command_to_servers("profile_dump", "step-3")]
        return None

    profiles = tmp_path / "prof"
    (plain, labelled), _ = make_cluster(2, 2, chunk_bytes=8192, secret=new_secret(), secure=True,
                                        profile_dir=str(profiles)).run(job)
    assert plain == [str(profiles / f"server-{r}.prof") for r in range(2)]
    assert labelled == [str(profiles / f"server-{r}-step-3.prof") for r in range(2)]
    for path in plain + labelled:
        assert os.stat(path).st_mode & 0o777 == 0o600
        functions = {name for _, _, name in pstats.Stats(path).stats}
        assert "handle" in functions          # ServerState.handle ran under the profiler


def test_a_dump_never_follows_a_link_nor_replaces_a_file(make_cluster, tmp_path):
    """A link named like the server's profile (to a file the server's user may write)
    and an existing profile stay as they are: the dump takes the next free name."""
    profiles, victim = tmp_path / "prof", tmp_path / "victim"
    profiles.mkdir()
    victim.write_text("precious")
    (profiles / "server-0.prof").symlink_to(victim)
    (profiles / "server-0.1.prof").write_text("an earlier profile")

    def job(kv):
        kv._send_command_to_servers("profile_start")
        kv._send_command_to_servers("profile_stop")
        return kv._send_command_to_servers("profile_dump")

    (path,), = make_cluster(1, 1, profile_dir=str(profiles)).run(job)
    assert path == str(profiles / "server-0.2.prof")
    assert victim.read_text() == "precious"
    assert (profiles / "server-0.1.prof").read_text() == "an earlier profile"
    assert pstats.Stats(path).stats is not None


def test_bad_commands_are_refused_naming_the_server_and_change_nothing(make_cluster, tmp_path):
    profiles = tmp_path / "prof"

    def job(kv):
        kv.init("w", np.zeros(4, np.float32))
        for head, body, match in [
                ("profile_stop", "", "the profiler does not run"),
                ("profile_dump", "", "nothing recorded"),
                ("reboot", "", "unknown server command 'reboot'; known: profile_start"),
                ("profile_start", "", None),
                ("profile_start", "", "already runs"),
                # no path, no NUL, nothing but a label comes from the wire
                ("profile_dump", "/tmp/a\x00b", "must be empty or a label"),
                ("profile_dump", str(tmp_path / "elsewhere"), "no path comes from the wire"),
                ("profile_dump", "../up", "must be empty or a label"),
                ("profile_dump", "x" * 65, "at most 64"),
                ("profile_stop", "\x00", "must be empty or a label"),
                ("reboot\x00", "", "unknown server command")]:
            if match is None:
                kv._send_command_to_servers(head, body)
                continue
            with pytest.raises(kvstore.RemoteError, match=f"server 0 rejected .*{re.escape(match)}"):
                kv._send_command_to_servers(head, body)
        with pytest.raises(kvstore.ArgumentTypeError, match="must be str"):
            kv._send_command_to_servers(5, "")
        kv.push("w", np.ones(4, np.float32))           # the connection goes on
        out = np.empty(4, np.float32)
        kv.pull("w", out=out)
        return out

    out, = make_cluster(1, 1, profile_dir=str(profiles)).run(job)
    np.testing.assert_array_equal(out, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == []     # no file, not even the directory


def test_an_unusable_profile_directory_is_an_error_reply(make_cluster, tmp_path):
    """The server's own directory setting is wrong (a file): the dump is refused with
    the OS's reason and the server goes on serving."""
    (tmp_path / "file").write_text("")

    def job(kv):
        kv.init("w", np.zeros(4, np.float32))
        kv._send_command_to_servers("profile_start")
        with pytest.raises(kvstore.RemoteError, match="server 0 rejected .*profile_dump: .*File exists"):
            kv._send_command_to_servers("profile_dump")
        kv._send_command_to_servers("profile_stop")
        out = np.empty(4, np.float32)
        kv.pull("w", out=out)
        return out

    out, = make_cluster(1, 1, profile_dir=str(tmp_path / "file")).run(job)
    np.testing.assert_array_equal(out, 0)


def test_a_store_without_servers_has_nothing_to_run():
    assert kvstore.create("local")._send_command_to_servers("profile_start") == []


def test_a_request_that_raises_is_answered_and_the_server_goes_on(make_cluster, monkeypatch):
    """The node's last resort: whatever a handler raises (here a fault injected into
    a command) becomes an InternalError reply naming the op; the server keeps serving.
    Before, a ValueError from a command ended every server (issue 40)."""
    from kvstore.server.commands import ServerCommands

    def broken(self, body):
        raise ValueError("embedded null byte")

    monkeypatch.setattr(ServerCommands, "_stop", broken)

    def job(kv):
        kv.init("w", np.zeros(4, np.float32))
        with pytest.raises(kvstore.RemoteError, match=r"server 0 rejected .*InternalError.*'command' request "
                                                      r"failed: ValueError: embedded null byte"):
            kv._send_command_to_servers("profile_stop")
        kv.push("w", np.ones(4, np.float32))
        out = np.empty(4, np.float32)
        kv.pull("w", out=out)
        return out

    out, = make_cluster(1, 1).run(job)
    np.testing.assert_array_equal(out, 1)
