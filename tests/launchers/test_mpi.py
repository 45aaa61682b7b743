"""`python -m tracker.mpi` through a real mpirun (Open MPI, and MPICH when
installed): formulas, failures and signals with nothing left behind, bad input
refused before anything starts."""

import os
import re
import shutil
import signal
import subprocess
import uuid

import pytest

import services
from services import FAST_FAILURE, SCRIPTS, eventually_empty, python_launcher, tagged

pytestmark = pytest.mark.slow


def _kind(program):
    path = shutil.which(program)
    if path is None:
        return None
    text = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return "openmpi" if "Open MPI" in text else "mpich" if "HYDRA" in text or "MPICH" in text else None


OPENMPI = next((p for p in ("mpirun.openmpi", "mpirun") if _kind(p) == "openmpi"), None)
MPICH = next((p for p in ("mpirun.mpich", "mpiexec.mpich", "mpirun") if _kind(p) == "mpich"), None)
needs_openmpi = pytest.mark.skipif(OPENMPI is None, reason="Open MPI's mpirun is not installed "
                                   "(.ci/run installs openmpi-bin)")


def mpi_launch(mpirun, *args, env=None):
    return python_launcher("tracker.mpi", "--mpirun", mpirun, "--env", "KVSTORE_TEST_TAG",
                           "--env", "PYTHONUNBUFFERED", *args, env=env)


def assert_nothing_left(p):
    assert eventually_empty(lambda: tagged(p.tag)) == [], f"processes left behind:\n{p.text}"


@pytest.mark.parametrize("mpirun", [
    pytest.param(OPENMPI, id="openmpi", marks=needs_openmpi),
    pytest.param(MPICH, id="mpich", marks=pytest.mark.skipif(MPICH is None, reason="MPICH not installed")),
])
def test_dist_sync_job_through_mpirun_matches_formulas(mpirun, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=4\n" if _kind(mpirun) == "openmpi" else "localhost:4\n")
    p = mpi_launch(mpirun, "-n", "2", "-s", "2", "-H", str(hosts), "--log-dir", str(tmp_path / "logs"),
                   "python", os.path.join(SCRIPTS, "formulas.py"))
    assert p.wait(120) == 0, p.text
    assert re.search(r"ranks 0\.\.1 are servers, 2\.\.3 workers", p.text)
    for rank in range(2):
        assert re.search(rf"\[worker:{rank}@[^\]]+\] OK rank {rank} of 2", p.text), p.text
        assert re.search(rf"\[server:{rank}@[^\]]+\] .*serving on tcp://", p.text), p.text
    assert (tmp_path / "logs" / "worker-0.log").read_text().strip() == "OK rank 0 of 2"
    assert_nothing_left(p)


@needs_openmpi
def test_mpi_job_over_ssh_hosts_from_the_hostfile(sshd):
    """The host file names 127.0.0.2 and 127.0.0.3; Open MPI starts its daemons
    there through our sshd (plm_rsh_agent), and ranks are placed by slots."""
    hosts = sshd.hostfile("127.0.0.2 slots=2", "127.0.0.3 slots=2")
    accepted = lambda: sum("Accepted publickey" in line for line in sshd.log)
    before = accepted()
    p = mpi_launch(OPENMPI, "-n", "2", "-s", "2", "-H", hosts,
                   "--mpi-arg=--mca", "--mpi-arg=plm_rsh_agent",
                   f"--mpi-arg=ssh -F {sshd.client_config} -p {sshd.port}",
                   "--mpi-arg=--mca", "--mpi-arg=oob_tcp_if_include", "--mpi-arg=lo",
                   "python", os.path.join(SCRIPTS, "formulas.py"))
    assert p.wait(120) == 0, p.text
    assert p.text.count("OK rank") == 2, p.text
    assert accepted() - before >= 2, "".join(sshd.log)   # one daemon per host, over ssh
    assert_nothing_left(p)
    assert eventually_empty(sshd.sessions) == [], p.text


def placed_by_ssh(text: str) -> dict:
    """{(role, rank): last byte of the address of the ssh connection} from the
    lines of tests/scripts/placement.py."""
    return {(role, rank): host for role, rank, host in
            re.findall(r"\] placed (\w+) (\d+) 127\.0\.0\.(\d+)$", text, re.M)}


DEDICATED = {("server", "0"): "4", ("server", "1"): "5", ("server", "2"): "4",
             ("worker", "0"): "2", ("worker", "1"): "3"}


@needs_openmpi
def test_dedicated_server_hosts_through_mpirun(sshd):
    """--server-hosts: Open MPI runs the servers' app context on 127.0.0.4/5 and the
    workers' on 127.0.0.2/3 (daemons over our sshd), round-robin; each rank ran on
    its host (the ssh connection of its daemon) and the sums are right."""
    workers = sshd.hostfile("127.0.0.2 slots=2", "127.0.0.3 slots=2")
    servers = sshd.hostfile("127.0.0.4 slots=2", "127.0.0.5 slots=2")
    p = mpi_launch(OPENMPI, "-n", "2", "-s", "3", "-H", workers, "--server-hosts", servers,
                   "--mpi-arg=--mca", "--mpi-arg=plm_rsh_agent",
                   f"--mpi-arg=ssh -F {sshd.client_config} -p {sshd.port}",
                   "--mpi-arg=--mca", "--mpi-arg=oob_tcp_if_include", "--mpi-arg=lo",
                   "python", os.path.join(SCRIPTS, "placement.py"))
    assert p.wait(120) == 0, p.text
    assert placed_by_ssh(p.text) == DEDICATED, p.text
    assert p.text.count("sums ok rank") == 2, p.text
    assert_nothing_left(p)
    assert eventually_empty(sshd.sessions) == [], p.text


@pytest.mark.skipif(MPICH is None, reason="MPICH not installed")
def test_dedicated_server_hosts_with_mpich_list_every_rank(tmp_path):
    """MPICH's hydra takes one host list: the rank-by-rank list, servers first."""
    (tmp_path / "workers").write_text("127.0.0.2:2\n127.0.0.3\n")
    (tmp_path / "servers").write_text("# CPU machines\n127.0.0.4:1\n127.0.0.5\n")
    p = python_launcher("tracker.mpi", "--mpirun", MPICH, "--mpi", "mpich", "-n", "3", "-s", "3",
                        "-H", str(tmp_path / "workers"), "--server-hosts", str(tmp_path / "servers"),
                        "--dry-run", "python", "train.py")
    assert p.wait(30) == 0, p.text
    assert ("-n 6 -hosts 127.0.0.4:1,127.0.0.5:1,127.0.0.5:1,127.0.0.2:1,127.0.0.3:1,127.0.0.2:1 "
            in p.text), p.text


@needs_openmpi
@pytest.mark.parametrize("mode, culprit, code", [
    ("exit", "worker 1 on \\S+ exited with status 3", 3),
    ("sigkill", "worker 1 on \\S+ was killed by SIGKILL", 128 + 9),
    ("server", "server 1 on \\S+ was killed by SIGKILL", 128 + 9),
])
def test_a_failing_rank_ends_the_mpi_job(mode, culprit, code):
    p = mpi_launch(OPENMPI, "-n", "3", "-s", "2", "--oversubscribe", "--kill-grace", "2", "python",
                   os.path.join(SCRIPTS, "faulty.py"), "loop" if mode == "server" else mode,
                   env=FAST_FAILURE)
    if mode == "server":
        p.wait_for(r"ready rank", count=3)
        os.kill(int(re.search(r"server 1 \(pid (\d+)\)", p.text).group(1)), signal.SIGKILL)
    assert p.wait(60) == code, p.text
    assert re.search(f"job failed: {culprit}", p.text), p.text
    assert re.search(rf"{culprit.split(' on ')[0]} +\d+ .*<- root cause", p.text), p.text
    assert_nothing_left(p)


@needs_openmpi
def test_a_rank_that_fails_before_registering_has_its_exception_in_the_summary():
    """The node wrapper watches its process's output: a worker whose create() refuses
    the store type (before it registers) is summarised with the exception's last line."""
    p = mpi_launch(OPENMPI, "-n", "2", "-s", "1", "--oversubscribe", "--kill-grace", "2", "python", "-c",
                   "import kvstore; kvstore.create('dist_sync_cpu')", env=FAST_FAILURE)
    assert p.wait(60) == 1, p.text
    cause = p.text.split("job failed:")[1].splitlines()[0]
    assert re.fullmatch(r" worker [01] on \S+ exited with status 1: kvstore\.errors\.ConfigError: unknown store "
                        r"type 'dist_sync_cpu'; valid types: .*", cause), p.text
    assert_nothing_left(p)


@needs_openmpi
def test_sigint_to_the_mpi_launcher_ends_every_rank():
    p = mpi_launch(OPENMPI, "-n", "2", "-s", "2", "--oversubscribe", "--worker-env", "MY_TOKEN",
                   "python", os.path.join(SCRIPTS, "faulty.py"), "loop",
                   env={**FAST_FAILURE, "MY_TOKEN": uuid.uuid4().hex})
    p.wait_for(r"ready rank", count=2)
    # worker-only variable, job secret: in the environment (mpirun -x NAME), not on command lines
    services.check_environments(p.tag)
    p.popen.send_signal(signal.SIGINT)
    assert p.wait(30) == 128 + signal.SIGINT, p.text
    assert "interrupted by SIGINT" in p.text
    assert_nothing_left(p)


@needs_openmpi
@pytest.mark.parametrize("args, message", [
    (["-H", "SLOTS"], "4 processes do not fit in the 3 slots"),
    (["-H", "/nonexistent/hosts"], "cannot read host file"),
    (["--bogus"], "no such option: --bogus"),
    (["--mpirun", "/nonexistent/mpirun"], "/nonexistent/mpirun not found"),
    (["--server-hosts", "SLOTS"], "--server-hosts needs -H FILE"),
    (["-H", "SLOTS", "--server-hosts", "/nonexistent/servers"],
     "--server-hosts: cannot read host file '/nonexistent/servers'"),
    (["-H", "SLOTS", "--server-hosts", "SLOTS"], "localhost is in both -H SLOTS and --server-hosts SLOTS"),
    (["-H", "SLOTS", "--server-hosts", "ONE"], "2 servers do not fit in the 1 slots of --server-hosts ONE"),
])
def test_bad_mpi_input_is_refused_before_anything_starts(args, message, tmp_path):
    files = {"SLOTS": tmp_path / "hosts", "ONE": tmp_path / "one"}
    files["SLOTS"].write_text("# three slots\nlocalhost slots=3\n")
    files["ONE"].write_text("127.0.0.4 slots=1\n")
    args = [str(files[a]) if a in files else a for a in args]
    for name, path in files.items():   # the error names the file
        message = message.replace(name, str(path))
    p = mpi_launch(OPENMPI, "-n", "2", "-s", "2", *args, "python", "x.py")
    assert p.wait(60) == 2, p.text
    assert message in p.text
    assert "scheduler listening" not in p.text


@needs_openmpi
def test_mpi_dry_run_shows_mpirun_and_hides_values(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=8\n")
    p = python_launcher("tracker.mpi", "--mpirun", OPENMPI, "-n", "3", "-s", "1", "-H", str(hosts),
                        "--dry-run", "--env", "API_TOKEN=hunter2", "python", "train.py")
    assert p.wait(30) == 0, p.text
    assert "ranks 0..0 are servers, 1..3 workers" in p.text
    assert f"-np 4 --hostfile {hosts}" in p.text and "-x API_TOKEN" in p.text
    assert "hunter2" not in p.text
    assert "scheduler listening" not in p.text


@needs_openmpi
def test_every_rank_gets_one_thread_count_and_the_culprit_is_marked(tmp_path):
    """One environment for every rank: OMP_NUM_THREADS = the smallest share of a
    host's cores (slots=) among the hosts; and a worker that ends by an uncaught
    exception is the root cause with its own exit status."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=4\n")
    p = mpi_launch(OPENMPI, "-n", "2", "-s", "1", "-H", str(hosts), "python",
                   os.path.join(SCRIPTS, "launcher_cases.py"), "threads",
                   env={**FAST_FAILURE, "OMP_NUM_THREADS": "", "MKL_NUM_THREADS": ""})
    assert p.wait(120) == 0, p.text
    assert len(re.findall(r"\[worker:\d@[^\]]+\] threads 1 1$", p.text, re.M)) == 2, p.text
    assert re.search(r"job finished: 2 workers, 1 server, [\d.]+ s, exit 0", p.text), p.text
    p = mpi_launch(OPENMPI, "-n", "2", "-s", "1", "-H", str(hosts), "python",
                   os.path.join(SCRIPTS, "launcher_cases.py"), "exception", env=FAST_FAILURE)
    assert p.wait(120) == 1, p.text
    assert re.search(r"^worker 1 +\d+ +\S+ +exited with status 1  <- root cause$", p.text, re.M), p.text
    assert_nothing_left(p)
