"""tracker.local takes the core options every launcher takes (docs/launching.md):
per-role variables, the address to bind, and a log file per process."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = """
import os, numpy as np, kvstore
kv = kvstore.create("dist_sync")
kv.init("w", np.zeros(2, np.float32))
print("ENV", os.environ.get("ONLY_W"), os.environ.get("ONLY_S"), os.environ["KVSTORE_NODE_HOST"], flush=True)
kv.close()
"""


def test_worker_env_server_env_host_ip_and_log_dir(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "-s", "1", "--worker-env", "ONLY_W=yes",
                        "--server-env", "ONLY_S=no", "--server-env", "KVSTORE_LOG_LEVEL=DEBUG",
                        "--host-ip", "127.0.0.3", "--log-dir", "logs", sys.executable, "job.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("ENV yes None 127.0.0.3") == 2, p.stdout       # workers only get ONLY_W
    assert "listening on 127.0.0.3" in p.stderr
    logs = tmp_path / "logs"
    assert sorted(os.listdir(logs)) == ["server-0.log", "worker-0.log", "worker-1.log"]
    assert (logs / "worker-1.log").read_text().startswith("ENV yes None 127.0.0.3")   # no prefix
    assert "DEBUG" in (logs / "server-0.log").read_text()                # the server's own variable
    assert "DEBUG" not in (logs / "worker-0.log").read_text()


def test_a_host_ip_that_is_not_ours_is_refused():
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "1", "--host-ip", "192.0.2.1",
                        sys.executable, "-c", "pass"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "192.0.2.1 is not an address of this machine" in p.stderr, p.stderr


def test_output_ranks_shows_only_those_workers_and_logs_keep_everything(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "3", "-s", "1", "--output-ranks", "1",
                        "--log-dir", "logs", sys.executable, "job.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [line.split("]")[0] for line in p.stdout.splitlines() if line.startswith("[")] == ["[worker:1"]
    assert all("ENV" in (tmp_path / "logs" / f"worker-{r}.log").read_text() for r in range(3))
    bad = subprocess.run([sys.executable, "-m", "tracker.local", "-n", "2", "--output-ranks", "2",
                          sys.executable, "job.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "worker ranks are 0..1" in bad.stderr
