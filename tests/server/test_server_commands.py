"""MXNet's ``kv._send_command_to_servers``: start, stop and dump a profile of every
server (pstats files, one per server); bad commands are refused and change nothing."""

import pstats

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
            return kv._send_command_to_servers("profile_dump", str(tmp_path / "prof"))
        return None

    paths, _ = make_cluster(2, 2, chunk_bytes=8192, secret=new_secret(), secure=True).run(job)
    assert paths == [str(tmp_path / "prof" / f"server-{r}.prof") for r in range(2)]
    for path in paths:
        functions = {name for _, _, name in pstats.Stats(path).stats}
        assert "handle" in functions          # ServerState.handle ran under the profiler


def test_bad_commands_are_refused_naming_the_server_and_change_nothing(make_cluster, tmp_path):
    def job(kv):
        kv.init("w", np.zeros(4, np.float32))
        for head, body, match in [
                ("profile_stop", "", "the profiler does not run"),
                ("profile_dump", str(tmp_path), "nothing recorded"),
                ("reboot", "", "unknown server command 'reboot'; known: profile_start"),
                ("profile_start", "", None),
                ("profile_start", "", "already runs"),
                ("profile_dump", "relative/dir", "absolute directory path"),
                ("profile_dump", str(tmp_path / "file") + "/x", "Not a directory")]:
            if match is None:
                kv._send_command_to_servers(head, body)
                continue
            with pytest.raises(kvstore.RemoteError, match=f"server 0 rejected .*{match}"):
                kv._send_command_to_servers(head, body)
        with pytest.raises(kvstore.ArgumentTypeError, match="must be str"):
            kv._send_command_to_servers(5, "")
        kv.push("w", np.ones(4, np.float32))           # the connection goes on
        out = np.empty(4, np.float32)
        kv.pull("w", out=out)
        return out

    (tmp_path / "file").write_text("")
    out, = make_cluster(1, 1).run(job)
    np.testing.assert_array_equal(out, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]     # no file was written


def test_a_store_without_servers_has_nothing_to_run():
    assert kvstore.create("local")._send_command_to_servers("profile_start") == []
