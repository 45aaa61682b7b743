"""DLRM on CPU: ours (ShardedEmbedding + Trainer on a parameter server) against
TorchRec (EmbeddingBagCollection + DistributedModelParallel), the same model, data,
initial values and optimizer, at each W in one run (issue 32).

    python -m benchmarks.dlrm.run --workers 2,4,8 --steps 40 --record   # into benchmarks/results/dlrm
    python -m benchmarks.dlrm.run --workers 2 --steps 5 --tables 4x2000 --out-dir /tmp/d   # seconds

At each W both contenders run one after the other (the first of the pair alternates
from one W to the next), every process on this machine with one torch thread:

  ours      python -m tracker.local -n W -s S (KVSTORE_TRANSPORT=tcp: every byte
            crosses a loopback socket, as gloo's do); benchmarks/dlrm/ours.py
  torchrec  benchmarks/.venv-torchrec/bin/torchrun --nproc-per-node W (gloo on
            loopback); benchmarks/dlrm/torchrec_worker.py

Reported per contender and W: steps a second (the timed steps over the slowest
rank's wall time), TCP bytes a worker sent plus received a step (``ss``; ours also
``kv.comm_stats()``), every worker's and (ours) every server's peak RSS (VmHWM),
and the loss of every step, averaged over the workers (each worker's loss on its
own part of the global batch: the global batch's loss). ``--big-tables`` adds a
run of both at the smallest W with other tables, to show how a worker's peak
memory follows the tables' size. Writes <name>.json and <name>.md to --out-dir (default:
a new scratch directory; ``--record``: benchmarks/results/dlrm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import click

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.dlrm"

from benchmarks.harness import common as bcommon  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402
from benchmarks.dlrm.data import parse_tables  # noqa: E402
from benchmarks.harness.procs import GroupFailed, free_port, run_group  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.path.join(ROOT, "benchmarks", ".venv-torchrec")
OUTPUT = ResultsDir("dlrm", "dlrm")
CONTENDERS = ("ours", "torchrec")
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def torchrec_state(venv: str) -> tuple[bool, str]:
    """(usable, the versions or why not): imports torchrec in the venv and runs a
    tiny EmbeddingBagCollection forward."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        return False, f"{venv} does not exist (see docs/performance.md 9.2 for how it is made)"
    probe = ("import importlib.metadata as m, torch, torchrec\n"
             "e = torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(name='t', embedding_dim=4, "
             "num_embeddings=10, feature_names=['f'])])\n"
             "k = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=['f'], values=torch.tensor([1, 2]), "
             "lengths=torch.tensor([2]))\n"
             "assert e(k).values().shape == (1, 4)\n"
             "print('torch', torch.__version__, 'torchrec', m.version('torchrec'), 'fbgemm-gpu-cpu', "
             "m.version('fbgemm_gpu_cpu'))\n")
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300,
                              env={**os.environ, **THREADS})
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{python} cannot run: {e}"
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return False, f"torchrec does not load in {venv}: {tail[0]}"
    return True, done.stdout.strip().splitlines()[-1]


def kvstore_tree(rev: str | None, work: str) -> tuple[str | None, str]:
    """(a directory holding kvstore/ and tracker/ as committed at ``rev``, or None for
    the working tree; what to call that code)."""
    if rev is None:
        return None, bcommon.kvstore_version()
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", rev], capture_output=True, text=True,
                            timeout=30, check=True).stdout.strip()
    tree = os.path.join(work, "kvstore-at-" + commit)
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", commit, "kvstore", "tracker"],
                             capture_output=True, timeout=120, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, timeout=120, check=True)
    return tree, f"kvstore {commit} (kvstore/ and tracker/ as committed, via --kvstore-at {rev})"


def worker_args(cfg: dict, tables: str, out: str) -> list[str]:
    return ["--tables", tables, "--dim", str(cfg["dim"]), "--batch", str(cfg["batch"]),
            "--pooling", str(cfg["pooling"]), "--n-dense", str(cfg["n_dense"]), "--zipf", str(cfg["zipf"]),
            "--seed", str(cfg["seed"]), "--bottom", cfg["bottom"], "--top", cfg["top"], "--lr", str(cfg["lr"]),
            "--steps", str(cfg["steps"]), "--warmup", str(cfg["warmup"]), "--out-dir", out]


def run_one(name: str, workers: int, tables: str, cfg: dict, work: str, tree: str | None) -> list[dict]:
    """One contender's job at W = ``workers``; returns every rank's result."""
    out = tempfile.mkdtemp(prefix=f"{name}-w{workers}-", dir=work)
    args = worker_args(cfg, tables, out)
    if name == "ours":
        path = os.pathsep.join(p for p in (tree, ROOT) if p)
        argv = [sys.executable, "-m", "tracker.local", "-n", str(workers), "-s", str(cfg["servers"]),
                "--env", "KVSTORE_TRANSPORT=tcp", "--env", "KVSTORE_LOG_LEVEL=WARNING",
                sys.executable, "-m", "benchmarks.dlrm.ours", *args]
        env = {"PYTHONPATH": path, **THREADS}
    else:
        argv = [os.path.join(cfg["venv"], "bin", "torchrun"), "--nnodes", "1", "--nproc-per-node", str(workers),
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                "-m", "benchmarks.dlrm.torchrec_worker", *args]
        env = {"PYTHONPATH": ROOT, "GLOO_SOCKET_IFNAME": "lo", "PYTHONWARNINGS": "ignore", **THREADS}
    try:
        run_group([(f"{name} W={workers}", argv, env)], os.path.join(work, f"{name}-w{workers}.log"),
                  cfg["timeout"])
    except GroupFailed as e:
        raise click.ClickException(f"{name} at W={workers} failed: {e}") from None
    ranks = []
    for r in range(workers):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def summarise(name: str, workers: int, ranks: list[dict]) -> dict:
    steps = len(ranks[0]["losses"])
    losses = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(steps)]
    row = {"contender": name, "workers": workers,
           "steps_per_s": min(r["steps_per_s"] for r in ranks),
           "tcp_bytes_per_step": sum(r["tcp_bytes_per_step"] for r in ranks) / len(ranks),
           "tcp_bytes_per_step_all": sum(r["tcp_bytes_per_step"] for r in ranks),
           "worker_peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
           "worker_rss_start_mb": max(r["rss_start_mb"] for r in ranks),
           "losses": losses, "torch": ranks[0]["torch"]}
    if name == "ours":
        row["comm_bytes_per_step"] = sum(r["comm_bytes_per_step"] for r in ranks) / len(ranks)
        row["server_peak_rss_mb"] = ranks[0].get("server_peak_rss_mb", [])
    else:
        row.update(torchrec=ranks[0]["torchrec"], fbgemm_gpu_cpu=ranks[0]["fbgemm_gpu"], plan=ranks[0]["plan"])
    return row


def compare(rows: list[dict], tol: float) -> dict:
    """Ours against TorchRec at each W: speed, and the loss curves' largest gap."""
    out = {}
    for w in sorted({r["workers"] for r in rows}):
        got = {r["contender"]: r for r in rows if r["workers"] == w}
        if set(got) != set(CONTENDERS):
            continue
        a, b = got["ours"]["losses"], got["torchrec"]["losses"]
        gap = max(abs(x - y) for x, y in zip(a, b))
        out[w] = {"speed_ratio": got["ours"]["steps_per_s"] / got["torchrec"]["steps_per_s"],
                  "bytes_ratio": got["ours"]["tcp_bytes_per_step"] / got["torchrec"]["tcp_bytes_per_step"],
                  "loss_gap": gap, "loss_step0_gap": abs(a[0] - b[0]), "same_loss": gap <= tol}
    return out


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def markdown(data: dict) -> str:
    cfg, m, rows = data["config"], data["machine"], data["rows"]
    tables = parse_tables(cfg["tables"])
    table_mb = sum(tables) * cfg["dim"] * 4 / 1e6
    lines = [f"## DLRM on CPU: ours against TorchRec, {len(tables)} tables ({sum(tables):,} rows x {cfg['dim']}, "
             f"{table_mb:,.0f} MB fp32), W = {', '.join(str(w) for w in cfg['workers'])}", "",
             f"Machine: {m.get('cpu_model', '?')}, {m['cpus']} cores, {m.get('mem_total', '?')}; every process "
             f"of a run on it (ours: W workers + {cfg['servers']} servers; TorchRec: W ranks), one torch thread "
             f"each. Run {data['started']} .. {data['finished']}.",
             f"Ours: {data['kvstore']}, torch {data['ours_torch']}, KVSTORE_TRANSPORT=tcp, S={cfg['servers']}. "
             f"TorchRec: {data['torchrec']}.",
             f"Model: DLRM, bottom MLP {cfg['n_dense']}-{cfg['bottom'].replace(',', '-')}-{cfg['dim']}, "
             f"top MLP {cfg['top'].replace(',', '-')}-1, dot interaction; batch {cfg['batch']} a worker, "
             f"{cfg['pooling']} id(s) a bag from a Zipf({cfg['zipf']}) law; plain SGD lr {cfg['lr']} on the "
             f"gradient averaged over the workers (ours: the servers' SGD with the Trainer's rescale 1/W, "
             f"tables and MLPs; TorchRec: fused EXACT_SGD on the tables, whose all-to-all divides the "
             f"gradient by W, and torch SGD after DDP on the MLPs); "
             f"{cfg['warmup']} warm-up + {cfg['steps']} timed steps.", "",
             "| W | contender | steps/s | MB a step a worker (TCP) | worker peak RSS MB (start) | "
             "server peak RSS MB | loss: step 0 | loss: last step |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("big"):
            continue
        servers = ", ".join(f"{x:.0f}" for x in r.get("server_peak_rss_mb", [])) or "-"
        lines.append(f"| {r['workers']} | {r['contender']} | **{r['steps_per_s']:.2f}** | "
                     f"{_mb(r['tcp_bytes_per_step'])} | {r['worker_peak_rss_mb']:.0f} ({r['worker_rss_start_mb']:.0f}) | "
                     f"{servers} | {r['losses'][0]:.6f} | {r['losses'][-1]:.6f} |")
    cmp_ = data["compare"]
    if cmp_:
        lines += ["", "| W | ours / TorchRec steps/s | ours / TorchRec bytes | largest loss gap (any step) | "
                      "same loss (<= " + f"{cfg['loss_tol']:g}) |", "|---:|---:|---:|---:|---|"]
        for w, c in sorted(cmp_.items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {w} | **{c['speed_ratio']:.2f}x** | {c['bytes_ratio']:.2f}x | {c['loss_gap']:.2e} | "
                         f"{'yes' if c['same_loss'] else 'NO'} |")
        curve_w = max(int(w) for w in cmp_)
        ours = next(r for r in rows if r["workers"] == curve_w and r["contender"] == "ours" and not r.get("big"))
        trec = next(r for r in rows if r["workers"] == curve_w and r["contender"] == "torchrec" and not r.get("big"))
        n = len(ours["losses"])
        pick = sorted({0, 1, n // 4, n // 2, 3 * n // 4, n - 1})
        lines += ["", f"Loss curve at W={curve_w} (global batch's loss, mean of the workers'):", "",
                  "| step | " + " | ".join(str(i) for i in pick) + " |", "|---|" + "---:|" * len(pick),
                  "| ours | " + " | ".join(f"{ours['losses'][i]:.6f}" for i in pick) + " |",
                  "| TorchRec | " + " | ".join(f"{trec['losses'][i]:.6f}" for i in pick) + " |"]
    big = [r for r in rows if r.get("big")]
    if big:
        btables = parse_tables(cfg["big_tables"])
        bmb = sum(btables) * cfg["dim"] * 4 / 1e6
        lines += ["", f"Memory against the tables' size (W={big[0]['workers']}): worker peak RSS MB with "
                      f"{table_mb:,.0f} MB of tables -> with {bmb:,.0f} MB ({cfg['big_tables']}):"]
        for r in big:
            small = next(x for x in rows if x["contender"] == r["contender"] and x["workers"] == r["workers"]
                         and not x.get("big"))
            extra = ""
            if r.get("server_peak_rss_mb"):
                extra = "; servers " + ", ".join(f"{x:.0f}" for x in small["server_peak_rss_mb"]) + " -> " + \
                        ", ".join(f"{x:.0f}" for x in r["server_peak_rss_mb"])
            lines.append(f"- {r['contender']}: {small['worker_peak_rss_mb']:.0f} -> {r['worker_peak_rss_mb']:.0f}"
                         f" ({r['steps_per_s']:.2f} steps/s){extra}")
    if "targets" in data:
        lines += ["", "Targets (issue 32): " + "; ".join(data["targets"]) + "."]
    if data.get("torchrec_skipped"):
        lines += ["", f"TorchRec did not run: {data['torchrec_skipped']}"]
    return "\n".join(lines) + "\n"


def targets(data: dict) -> list[str]:
    out, cmp_, cfg = [], data["compare"], data["config"]
    for w in (4, 8):
        c = cmp_.get(w)
        if c is not None:
            met = c["speed_ratio"] >= 1.0 and c["same_loss"]
            out.append(f"W={w}: ours {c['speed_ratio']:.2f}x TorchRec's steps/s, loss gap {c['loss_gap']:.1e} "
                       f"({'met' if met else 'NOT met'}: >= 1x with the same loss)")
    big = {r["contender"]: r for r in data["rows"] if r.get("big")}
    if "ours" in big:
        small = next(x for x in data["rows"] if x["contender"] == "ours" and x["workers"] == big["ours"]["workers"]
                     and not x.get("big"))
        grow = big["ours"]["worker_peak_rss_mb"] - small["worker_peak_rss_mb"]
        added = (sum(parse_tables(cfg["big_tables"])) - sum(parse_tables(cfg["tables"]))) * cfg["dim"] * 4 / 2 ** 20
        out.append(f"ours' worker peak grows {grow:+.0f} MB for {added:,.0f} MB more of tables "
                   f"({'met' if grow < 0.05 * added else 'NOT met'}: < 5 % of it)")
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--workers", default="2,4,8", show_default=True, help="The W to run, comma-separated.")
@click.option("-s", "--servers", type=click.IntRange(min=1), default=2, show_default=True, help="S (ours).")
@click.option("--tables", default="26x100000", show_default=True,
              help="Rows of each table: COUNTxROWS or ROWS,ROWS,... (comma lists of both).")
@click.option("--big-tables", default=None, help="Also run both at the smallest W with these tables (memory).")
@click.option("--dim", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=512, show_default=True, help="A worker's batch.")
@click.option("--pooling", type=click.IntRange(min=1), default=1, show_default=True,
              help="Ids a bag (Criteo's features have one).")
@click.option("--n-dense", type=click.IntRange(min=1), default=13, show_default=True)
@click.option("--bottom", default="128,64", show_default=True, help="Hidden sizes of the bottom MLP.")
@click.option("--top", default="128,64", show_default=True, help="Hidden sizes of the top MLP.")
@click.option("--zipf", type=click.FloatRange(min=0.5, max=3), default=1.05, show_default=True)
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=0.1, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=40, show_default=True, help="Timed steps.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True)
@click.option("--contenders", default=",".join(CONTENDERS), show_default=True)
@click.option("--loss-tol", type=click.FloatRange(min=0), default=1e-3, show_default=True,
              help="Largest gap between the two loss curves that counts as the same.")
@click.option("--venv", type=click.Path(file_okay=False), default=VENV, show_default=True,
              help="TorchRec's virtual environment.")
@click.option("--kvstore-at", default=None, metavar="REV",
              help="Run ours with kvstore/ and tracker/ as committed at REV (default: the working tree).")
@click.option("--name", default="dlrm", show_default=True)
@click.option("--timeout", type=click.FloatRange(min=1), default=900, show_default=True,
              help="Seconds one job may take.")
@OUTPUT.click_options
def main(workers, servers, tables, big_tables, dim, batch, pooling, n_dense, bottom, top, zipf, lr, seed,
         steps, warmup, contenders, loss_tol, venv, kvstore_at, out_dir, name, timeout):
    """Train the same DLRM with ours and with TorchRec at each W; compare."""
    try:
        ws = sorted({int(w) for w in workers.split(",") if w.strip()})
        parse_tables(tables)
        if big_tables:
            parse_tables(big_tables)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if not ws or min(ws) < 1:
        raise click.BadParameter(f"--workers: {workers!r}")
    chosen = [c.strip() for c in contenders.split(",") if c.strip()]
    if not chosen or any(c not in CONTENDERS for c in chosen):
        raise click.BadParameter(f"--contenders: choose from {', '.join(CONTENDERS)}")
    cfg = {"workers": ws, "servers": servers, "tables": tables, "big_tables": big_tables, "dim": dim,
           "batch": batch, "pooling": pooling, "n_dense": n_dense, "bottom": bottom, "top": top, "zipf": zipf,
           "lr": lr, "seed": seed, "steps": steps, "warmup": warmup, "loss_tol": loss_tol,
           "venv": os.path.abspath(venv), "timeout": timeout}
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kvbench-dlrm-")
    tree, version = kvstore_tree(kvstore_at, work)
    home = os.getcwd()
    os.chdir(work)          # `python -m` puts the current directory first: not the repository's kvstore
    data = {"machine": bcommon.machine(), "kvstore": version, "config": cfg, "ours_torch": "?",
            "torchrec": "-", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": []}
    if "torchrec" in chosen:
        ok, why = torchrec_state(cfg["venv"])
        data["torchrec"] = why
        if not ok:
            data["torchrec_skipped"] = why
            chosen.remove("torchrec")
            click.echo(f"TorchRec skipped: {why}", err=True)
        else:
            click.echo(f"TorchRec: {why}", err=True)
    click.echo(f"ours: {version}; logs in {work}", err=True)
    jobs = []
    for i, w in enumerate(ws):
        order = chosen if i % 2 == 0 else chosen[::-1]
        jobs += [(c, w, tables, False) for c in order]
    if big_tables:
        jobs += [(c, ws[0], big_tables, True) for c in chosen]
    for c, w, t, big in jobs:
        t0, load = time.monotonic(), os.getloadavg()[0]
        row = summarise(c, w, run_one(c, w, t, cfg, work, tree))
        row["big"] = big
        row["load_before"] = load          # 1-minute load average as the job started
        data["rows"].append(row)
        if c == "ours":
            data["ours_torch"] = row["torch"]
        click.echo(f"  W={w} {c}{' (big tables)' if big else ''}: {row['steps_per_s']:.2f} steps/s, "
                   f"{_mb(row['tcp_bytes_per_step'])} MB a step a worker, worker peak {row['worker_peak_rss_mb']:.0f} "
                   f"MB, loss {row['losses'][0]:.6f} -> {row['losses'][-1]:.6f}; {time.monotonic() - t0:.0f} s",
                   err=True)
    data["compare"] = compare([r for r in data["rows"] if not r["big"]], loss_tol)
    data["targets"] = targets(data)
    data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    os.chdir(home)
    bcommon.write_results(out_dir, name, markdown(data), data)


if __name__ == "__main__":
    main()
