"""`python -m tracker.ssh` against a real sshd on 127.0.0.1-5: formulas over
hosts, dedicated server hosts (--server-hosts), --sync-dst-dir, failures and
signals (nothing left on any host), bad input refused before anything starts;
plus host file parsing and placement."""

import os
import re
import signal
import sys
import uuid

import pytest

import services
from services import FAST_FAILURE, SCRIPTS, eventually_empty, python_launcher, tagged
from tracker import hostfile
from tracker.hostfile import Host, HostfileError


# -- host files and placement (no ssh needed) -------------------------------------------

def test_hostfile_formats():
    hosts = hostfile.parse("""
        # a comment
        node1
        node2:2222          # trailing comment
        alice@node3 slots=4

        bob@10.0.0.7:22 slots=2
        [fe80::1]:2200
    """)
    assert hosts == [Host("node1"), Host("node2", 2222), Host("node3", None, "alice", 4),
                     Host("10.0.0.7", 22, "bob", 2), Host("fe80::1", 2200)]
    assert hosts[3].name == "bob@10.0.0.7:22" and hosts[3].destination == "bob@10.0.0.7"


@pytest.mark.parametrize("text, message", [
    ("", "lists no host"), ("# only\n\n", "lists no host"),
    ("node1 slots=0", "slots=N"), ("node1 cores=3", "unknown option"),
    ("node1:99999", "port 99999"), ("-oProxyCommand=x", "is not host"),
    ("a\nb\na", "listed twice"),
])
def test_bad_hostfiles(text, message):
    with pytest.raises(HostfileError, match=message):
        hostfile.parse(text)


def test_placement_is_round_robin_servers_first_and_respects_slots():
    a, b, c = Host("a"), Host("b", slots=1), Host("c")
    labels = ["s0", "s1", "w0", "w1", "w2"]
    assert [h.host for h in hostfile.place([a, Host("b")], 2, 3)] == ["a", "b", "a", "b", "a"]
    assert [h.host for h in hostfile.place([a, b, c], 2, 3)] == ["a", "b", "c", "a", "c"]
    full = [Host("a", slots=2), Host("b", slots=1)]
    with pytest.raises(HostfileError, match="5 processes .* 3 slots"):
        hostfile.place(full, 2, 3)
    assert [h.host for h in hostfile.place(full, 2, 3, oversubscribe=True)] == ["a", "b", "a", "b", "a"]
    text = hostfile.describe(labels, hostfile.place([a, Host("b")], 2, 3))
    assert "a  s0, w0, w2" in text


def test_dedicated_server_hosts_placement():
    """Servers round-robin over the server hosts, workers over the worker hosts,
    each with its file's slots; a host in both files is refused, naming both."""
    workers, servers = [Host("w1"), Host("w2")], [Host("s1"), Host("s2", slots=1), Host("s3")]
    placed = hostfile.place_apart(workers, servers, 4, 3)
    assert [h.host for h in placed] == ["s1", "s2", "s3", "s1", "w1", "w2", "w1"]
    with pytest.raises(HostfileError, match=r"3 servers do not fit in the 2 slots of --server-hosts"):
        hostfile.place_apart(workers, [Host("s1", slots=1), Host("s2", slots=1)], 3, 2)
    with pytest.raises(HostfileError, match=r"w2 is in both -H w\.txt and --server-hosts s\.txt"):
        hostfile.place_apart(workers, [Host("s1"), Host("w2")], 2, 2,
                             sources=("-H w.txt", "--server-hosts s.txt"))
    # the same name on another ssh port is another host (e.g. a container)
    assert len(hostfile.place_apart(workers, [Host("w1", 2222)], 1, 2)) == 3


# -- real ssh -----------------------------------------------------------------------

pytestmark = pytest.mark.slow


def ssh_launch(sshd, *args, env=None, cwd=services.ROOT):
    return python_launcher("tracker.ssh", "-F", sshd.client_config, "--env", "KVSTORE_TEST_TAG",
                           "--env", "PYTHONUNBUFFERED", *args, env=env, cwd=cwd)


def assert_nothing_left(p, sshd):
    assert eventually_empty(lambda: tagged(p.tag)) == [], f"processes left behind:\n{p.text}"
    assert eventually_empty(sshd.sessions) == [], f"ssh sessions left behind:\n{p.text}"


def two_hosts(sshd, extra=""):
    return sshd.hostfile("# two loopback hosts", "127.0.0.2:{port}" + extra, "",
                         "127.0.0.3:{port}" + extra)


def test_dist_sync_job_over_ssh_matches_formulas(sshd, tmp_path):
    logs = tmp_path / "logs"
    p = ssh_launch(sshd, "-n", "2", "-s", "2", "-H", two_hosts(sshd), "--log-dir", str(logs),
                   "python", os.path.join(SCRIPTS, "formulas.py"), "--keys", "str")
    assert p.wait(120) == 0, p.text
    port = sshd.port
    # the placement is printed first: servers then workers, round-robin
    assert re.search(rf"127\.0\.0\.2:{port}\s+server 0, worker 0", p.text), p.text
    assert re.search(rf"127\.0\.0\.3:{port}\s+server 1, worker 1", p.text), p.text
    # each server binds and advertises the address of its host, not 127.0.0.1
    assert re.search(rf"\[server:0@127\.0\.0\.2:{port}\] .*serving on tcp://127\.0\.0\.2:", p.text)
    assert re.search(rf"\[server:1@127\.0\.0\.3:{port}\] .*serving on tcp://127\.0\.0\.3:", p.text)
    assert f"[worker:0@127.0.0.2:{port}] OK rank 0 of 2" in p.text
    assert f"[worker:1@127.0.0.3:{port}] OK rank 1 of 2" in p.text
    assert (logs / "worker-1.log").read_text().strip() == "OK rank 1 of 2"
    assert "serving on tcp://127.0.0.2" in (logs / "server-0.log").read_text()
    assert_nothing_left(p, sshd)


def test_dedicated_server_hosts_over_ssh(sshd, tmp_path):
    """--server-hosts: 4 servers on 127.0.0.4/5, 2 workers on 127.0.0.2/3; every
    process ran on its host (the ssh connection it was started through, and the
    address each server binds and advertises), and the sums are right."""
    servers = sshd.hostfile("# CPU-only machines", "127.0.0.4:{port}", "127.0.0.5:{port}")
    p = ssh_launch(sshd, "-n", "2", "-s", "4", "-H", two_hosts(sshd), "--server-hosts", servers,
                   "python", os.path.join(SCRIPTS, "placement.py"))
    assert p.wait(120) == 0, p.text
    port = sshd.port
    assert "placement: servers round-robin over the 2 server hosts, workers over the 2 " \
           "worker hosts" in p.text, p.text
    want = {("server", "0"): "4", ("server", "1"): "5", ("server", "2"): "4",
            ("server", "3"): "5", ("worker", "0"): "2", ("worker", "1"): "3"}
    assert re.search(rf"127\.0\.0\.4:{port}\s+server 0, server 2$", p.text, re.M), p.text
    assert re.search(rf"127\.0\.0\.2:{port}\s+worker 0$", p.text, re.M), p.text
    placed = {(role, rank): host for role, rank, host in
              re.findall(r"\] placed (\w+) (\d+) 127\.0\.0\.(\d+)$", p.text, re.M)}
    assert placed == want, p.text
    for (role, rank), host in want.items():
        at = rf"\[{role}:{rank}@127\.0\.0\.{host}:{port}\] "
        assert re.search(at + ("sums ok" if role == "worker" else
                               rf".*serving on tcp://127\.0\.0\.{host}:"), p.text), p.text
    assert_nothing_left(p, sshd)


def test_sync_dst_dir_copies_the_working_directory(sshd, tmp_path):
    work, dest = tmp_path / "work", tmp_path / "copied" / "job"
    work.mkdir()
    (work / "data.txt").write_text("payload 42\n")
    (work / "job.py").write_text(
        "import os, numpy as np, kvstore\n"
        "kv = kvstore.create('dist_sync')\n"
        "kv.init(0, np.zeros(3, np.float32))\n"
        "out = np.empty(3, np.float32)\n"
        "kv.pushpull(0, np.ones(3, np.float32), out=out)\n"
        "print('cwd', os.getcwd(), open('data.txt').read().strip(), out.tolist(), flush=True)\n"
        "kv.close()\n")
    p = ssh_launch(sshd, "-n", "2", "-s", "1", "-H", two_hosts(sshd), "--sync-dst-dir", str(dest),
                   "--env", "PYTHONPATH", "python", "job.py", cwd=str(work))
    assert p.wait(120) == 0, p.text
    assert (dest / "job.py").exists()
    assert p.text.count(f"cwd {dest} payload 42 [2.0, 2.0, 2.0]") == 2, p.text
    assert_nothing_left(p, sshd)


@pytest.mark.parametrize("mode, culprit, code", [
    ("exit", "worker 1 on 127.0.0.3:{port} exited with status 3", 3),
    ("sigkill", "worker 1 on 127.0.0.3:{port} was killed by SIGKILL", 128 + 9),
    ("server", "server 1 on 127.0.0.3:{port} was killed by SIGKILL", 128 + 9),
])
def test_a_failure_on_one_host_ends_the_job_on_every_host(sshd, mode, culprit, code):
    p = ssh_launch(sshd, "-n", "3", "-s", "2", "-H", two_hosts(sshd), "--kill-grace", "2",
                   "python", os.path.join(SCRIPTS, "faulty.py"),
                   "loop" if mode == "server" else mode, env=FAST_FAILURE)
    if mode == "server":
        p.wait_for(r"ready rank", count=3)
        pid = int(re.search(r"server 1 \(pid (\d+)\)", p.text).group(1))
        os.kill(pid, signal.SIGKILL)   # the "remote" host is this machine
    assert p.wait(60) == code, p.text
    assert f"job failed: {culprit.format(port=sshd.port)}" in p.text, p.text
    row = re.search(rf"{culprit.split(' on ')[0]} +\d+ +127\.0\.0\.3:\d+ .*<- root cause", p.text)
    assert row, p.text
    assert_nothing_left(p, sshd)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_launcher_ends_remote_processes(sshd, sig):
    token = uuid.uuid4().hex
    p = ssh_launch(sshd, "-n", "2", "-s", "2", "-H", two_hosts(sshd), "--worker-env", "MY_TOKEN",
                   "python", os.path.join(SCRIPTS, "faulty.py"), "loop",
                   env={**FAST_FAILURE, "MY_TOKEN": token, "KVSTORE_SECURE": "1"})
    p.wait_for(r"ready rank", count=2)
    # the allow-list per role, and no secret on any command line (they go over stdin)
    services.check_environments(p.tag)
    p.popen.send_signal(sig)
    assert p.wait(30) == 128 + sig, p.text
    assert f"interrupted by {signal.Signals(sig).name}" in p.text
    assert_nothing_left(p, sshd)


def test_a_killed_launcher_leaves_nothing_behind(sshd):
    """SIGKILL gives the launcher no chance to clean up: the remote wrappers see
    their stdin close and stop their processes by themselves."""
    p = ssh_launch(sshd, "-n", "2", "-s", "1", "-H", two_hosts(sshd), "--kill-grace", "1",
                   "python", os.path.join(SCRIPTS, "faulty.py"), "loop", env=FAST_FAILURE)
    p.wait_for(r"ready rank", count=2)
    p.popen.kill()
    p.wait(10)
    assert eventually_empty(lambda: tagged(p.tag), timeout=20) == [], p.text
    assert eventually_empty(sshd.sessions, timeout=20) == [], p.text


@pytest.mark.parametrize("args, message", [
    (["-H", "/nonexistent/hosts"], "cannot read host file"),
    (["-H", "EMPTY"], "lists no host"),
    (["-H", "UNREACHABLE"], "cannot reach 127.0.0.4"),
    (["-H", "SLOTS"], "do not fit in the 3 slots"),
    (["--bogus", "-H", "TWO"], "no such option: --bogus"),
    (["-H", "TWO", "--env", "NOT_SET_ANYWHERE_42"], "NOT_SET_ANYWHERE_42 is not set"),
    (["-H", "TWO", "--remote-python", "/nonexistent/python"], "cannot run the remote interpreter"),
    (["-H", "TWO", "--remote-dir", "/nonexistent/dir"], "working directory '/nonexistent/dir'"),
    (["-H", "TWO", "--host-ip", "nosuchif0"], "nosuchif0 is not an address of this machine"),
    (["-H", "TWO", "--server-hosts", "/nonexistent/servers"],
     "error: --server-hosts: cannot read host file '/nonexistent/servers'"),
    (["-H", "TWO", "--server-hosts", "EMPTY"], "error: --server-hosts: EMPTY lists no host"),
    (["-H", "TWO", "--server-hosts", "SERVERS_AND_ONE_WORKER"],
     "127.0.0.3:{port} is in both -H TWO and --server-hosts SERVERS_AND_ONE_WORKER"),
    (["-H", "TWO", "--server-hosts", "FAR"], "cannot reach 127.0.0.5"),
])
def test_bad_input_is_refused_before_anything_starts(sshd, args, message):
    files = {"EMPTY": sshd.hostfile("# nothing", ""), "TWO": two_hosts(sshd),
             "UNREACHABLE": sshd.hostfile("127.0.0.2:{port}", f"127.0.0.4:{services.free_port()}"),
             "SLOTS": sshd.hostfile("127.0.0.2:{port} slots=2", "127.0.0.3:{port} slots=1"),
             "SERVERS_AND_ONE_WORKER": sshd.hostfile("127.0.0.4:{port}", "127.0.0.3:{port}"),
             "FAR": sshd.hostfile(f"127.0.0.5:{services.free_port()}")}
    args = [files.get(a, a) for a in args]
    for name, path in files.items():   # the error names the file
        message = message.replace(name, path)
    message = message.replace("{port}", str(sshd.port))
    p = ssh_launch(sshd, "-n", "2", "-s", "2", *args, "python", "x.py")
    assert p.wait(60) == 2, p.text
    assert message in p.text, p.text
    assert "scheduler listening" not in p.text
    assert_nothing_left(p, sshd)


@pytest.mark.parametrize("module, example", [
    ("tracker.ssh", "python -m tracker.ssh -n 2 -s 2 -H hosts python train_cifar10.py --kvstore dist_sync"),
    ("tracker.mpi", "python -m tracker.mpi -n 2 -s 2 -H hosts python train_cifar10.py --kvstore dist_sync"),
    ("tracker.slurm", "python -m tracker.slurm -n 2 -s 2 python train_cifar10.py --kvstore dist_sync"),
])
def test_help_shows_a_complete_example(module, example):
    p = python_launcher(module, "--help")
    assert p.wait(30) == 0, p.text
    assert example in p.text
    for option in ("--num-workers", "--env", "--worker-env", "--host-ip", "--log-dir", "--dry-run"):
        assert option in p.text


def test_dry_run_prints_what_would_run_where(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node1\nalice@node2:2222 slots=1\n")
    p = python_launcher("tracker.ssh", "-n", "2", "-s", "1", "-H", str(hosts), "--dry-run",
                        "--host-ip", "lo",
                        "--worker-env", "SECRET_TOKEN=hunter2", "python", "train.py", "--lr", "0.1")
    assert p.wait(30) == 0, p.text
    assert "scheduler on 127.0.0.1 (this machine)" in p.text   # the address of interface lo
    assert re.search(r"node1\s+server 0, worker 1", p.text), p.text
    assert re.search(r"alice@node2:2222\s+worker 0", p.text), p.text
    lines = p.text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("worker 0 on alice@node2:2222"))
    assert "-p 2222 -- alice@node2 REMOTE" in lines[at]
    assert re.search(rf"REMOTE = cd \S+ && exec {sys.executable} -c <wrapper> ssh \w+ worker 0 -- "
                     rf"{sys.executable} train.py --lr 0.1$", lines[at + 1]), lines[at + 1]
    assert "hunter2" not in p.text and "SECRET_TOKEN" in lines[at + 2]   # names only, never values
    assert "scheduler listening" not in p.text


# -- teardown, output, threads (docs/launching.md) ------------------------------------

CASES = os.path.join(SCRIPTS, "launcher_cases.py")


def test_a_second_signal_kills_remote_processes_at_once(sshd):
    """Remote workers ignore SIGTERM and --kill-grace is 300 s: the second
    signal makes every wrapper SIGKILL its process group now."""
    p = ssh_launch(sshd, "-n", "2", "-s", "1", "-H", two_hosts(sshd), "--kill-grace", "300",
                   "python", CASES, "ignore-term")
    p.wait_for(r"\] ready", count=2)
    p.popen.send_signal(signal.SIGTERM)
    p.wait_for("launcher got SIGTERM: stopping every process")
    p.popen.send_signal(signal.SIGINT)
    assert p.wait(60) == 128 + signal.SIGTERM, p.text
    assert "killing every process now (SIGKILL)" in p.text
    assert "Traceback" not in p.text, p.text
    assert_nothing_left(p, sshd)


def test_sighup_to_the_launcher_ends_remote_processes(sshd):
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)   # the launcher inherits it
    try:
        p = ssh_launch(sshd, "-n", "2", "-s", "2", "-H", two_hosts(sshd), "python",
                       os.path.join(SCRIPTS, "faulty.py"), "loop", env=FAST_FAILURE)
    finally:
        signal.signal(signal.SIGHUP, previous)
    p.wait_for(r"ready rank", count=2)
    p.popen.send_signal(signal.SIGHUP)
    assert p.wait(30) == 128 + signal.SIGHUP, p.text
    assert "interrupted by SIGHUP" in p.text
    assert_nothing_left(p, sshd)


def test_a_closed_output_pipe_does_not_hang_a_remote_job(sshd, tmp_path):
    """`python -m tracker.ssh ... | head -1`: output keeps being drained (and
    still written to --log-dir), the job ends with its own status."""
    tag = uuid.uuid4().hex
    _, code, errors = services.run_with_output_closed(
        [sys.executable, "-m", "tracker.ssh", "-F", sshd.client_config, "--env", "KVSTORE_TEST_TAG",
         "-n", "2", "-s", "1", "-H", two_hosts(sshd), "--log-dir", str(tmp_path / "logs"),
         "python", CASES, "chatty"],
        {**os.environ, **FAST_FAILURE, "KVSTORE_TEST_TAG": tag, "PYTHONPATH": services.ROOT}, 120)
    assert code == 0, errors
    assert "Traceback" not in errors, errors
    assert re.search(r"job finished: 2 workers, 1 server, [\d.]+ s, exit 0", errors), errors
    assert (tmp_path / "logs" / "worker-1.log").read_text().splitlines()[-1].startswith("line 19999 ")
    assert eventually_empty(lambda: tagged(tag)) == []
    assert eventually_empty(sshd.sessions) == []


@pytest.mark.parametrize("mode, status, code", [
    ("grandchild-group", "ok", 0), ("grandchild-session", "ok", 0),
    ("grandchild-setsid", "ok", 0), ("grandchild-setsid", "hang", 3),
])
def test_grandchildren_left_on_remote_hosts_are_killed(sshd, mode, status, code):
    """In the process's group, moved to a group of its own in its session, or to
    a session of its own (setsid(); the node wrapper is a subreaper): after the
    process exited, or below a process the teardown stops (hang)."""
    p = ssh_launch(sshd, "-n", "2", "-s", "1", "-H", two_hosts(sshd), "python", CASES,
                   mode, status, env=FAST_FAILURE)
    assert p.wait(60) == code, p.text
    assert p.text.count("ready") == 2, p.text
    grandchildren = [int(pid) for pid in re.findall(r"grandchild (\d+) ready", p.text)]
    assert eventually_empty(lambda: [pid for pid in grandchildren if services.alive(pid)]) == [], p.text
    assert_nothing_left(p, sshd)


def test_thread_count_per_remote_host(sshd):
    """OMP_NUM_THREADS = a host's cores (its slots=, else this machine's count)
    // the processes placed on it."""
    from tracker.launcher import cpu_count
    hosts = sshd.hostfile("127.0.0.2:{port} slots=2", "127.0.0.3:{port}")
    p = ssh_launch(sshd, "-n", "2", "-s", "2", "-H", hosts, "python", CASES, "threads",
                   env={**FAST_FAILURE, "OMP_NUM_THREADS": "", "MKL_NUM_THREADS": ""})
    assert p.wait(60) == 0, p.text
    other = max(1, cpu_count() // 2)
    assert re.search(r"\[worker:0@127\.0\.0\.2:\d+\] threads 1 1$", p.text, re.M), p.text
    assert re.search(rf"\[worker:1@127\.0\.0\.3:\d+\] threads {other} {other}$", p.text, re.M), p.text
    assert p.text.count("OMP_NUM_THREADS is not set") == 1, p.text
    assert_nothing_left(p, sshd)


def test_one_of_each_reads_well_and_ipv6_host_ip_is_refused_early(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2\n")
    p = python_launcher("tracker.ssh", "-n", "1", "-s", "1", "-H", str(hosts), "--dry-run",
                        "python", "train.py")
    assert p.wait(30) == 0, p.text
    assert "1 server and 1 worker over 1 host," in p.text, p.text
    p = python_launcher("tracker.ssh", "-n", "1", "-H", str(hosts), "--host-ip", "::1",
                        "python", "train.py")
    assert p.wait(30) == 2, p.text
    assert "error: --host-ip: ::1 is an IPv6 address" in p.text, p.text
    assert "scheduler listening" not in p.text


def test_scheduler_address_refuses_ipv6():
    from tracker.addresses import scheduler_address
    with pytest.raises(ValueError, match="IPv6"):
        scheduler_address("fe80::1%lo", [(True, "127.0.0.1")])
    assert scheduler_address("127.0.0.1", [(True, "127.0.0.1")]) == "127.0.0.1"
