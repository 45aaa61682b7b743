"""What summing on the host (``KVSTORE_HOST_REDUCE=1``, kvstore/hostgroup/group.py) saves
on the wire: ResNet-50's pushpull over emulated machines, with and without it.

    sudo python -m benchmarks.host_reduce                       # 500mbit, 2 launches
    python -m benchmarks.host_reduce --rates 1gbit --workers-per-host 3 --iters 3

Layout: 2 worker hosts A and B with k workers each (``--workers-per-host``, ranks
placed A, B, A, B, ...: the lowest rank of each host leads its group) and 2
dedicated server hosts S0, S1 (server s on S s), the scheduler on A; every host a
network namespace with its own rate-limited link to one bridge (benchmarks/harness/netns.py
``Cluster``, removed at the end even on Ctrl-C or failure). Workers in one
namespace share a host identity (kvstore.transport.endpoints), so with it on they
form a group. Variants, interleaved per launch (the order alternates):

  direct        KVSTORE_HOST_REDUCE=0: every worker pushes its gradient (k N per host)
  host_reduce   KVSTORE_HOST_REDUCE=1: the host's leader pushes the host's sum (N)

The processes, the checks of every sum and of the transports are the harness's
(``benchmarks.harness.exchange.run_ours``, as benchmarks.link's). Per launch:
the median exchange time, the bytes every host's link sent and received (its
interface's counters) against the wire model below, and the wire bound (the bytes
on the busiest link direction per exchange / the link rate). A launch fails unless
worker 0 reports the host group its variant implies (``host_group`` in its result)
and, in host_reduce, every worker host sent nearer to the grouped model than to the
ungrouped one (the bytes prove that the sums went once). Writes host_reduce.md and host_reduce.json to
--out-dir (default: a new scratch directory; ``--record``: benchmarks/results/hostreduce).
Needs root (network namespaces); without it prints a "skipped" line and
exits 0.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.host_reduce"

from benchmarks.harness import common  # noqa: E402
from benchmarks.harness.output import ResultsDir  # noqa: E402
from benchmarks.harness.exchange import effective_settings, run_ours, versions  # noqa: E402
from benchmarks.harness.netns import Cluster, Failed, on_sigterm, parse_rate, raw_check  # noqa: E402
from benchmarks.harness.resnet50_shapes import model_shapes  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT = ResultsDir("host-reduce", "hostreduce")
WORKER_HOSTS = ("A", "B")
SERVER_HOSTS = ("S0", "S1")
VARIANTS = {"direct": "0", "host_reduce": "1"}   # variant -> KVSTORE_HOST_REDUCE
MODE = "pushpull"


@dataclass(frozen=True)
class Job:
    """What ``benchmarks.harness.exchange.run_ours`` reads of a layout, with several workers
    on one host (link's layouts put one worker on each)."""
    worker_hosts: tuple
    server_hosts: tuple = SERVER_HOSTS
    kind: str = "dedicated"

    @property
    def workers(self) -> int:
        return len(self.worker_hosts)

    @property
    def servers(self) -> int:
        return len(self.server_hosts)

    @property
    def hosts(self) -> list:
        return [*dict.fromkeys(self.worker_hosts), *self.server_hosts]


def job_of(per_host: int) -> Job:
    """Rank r on WORKER_HOSTS[r % 2]: A, B, A, B, ..."""
    return Job(tuple(WORKER_HOSTS[r % len(WORKER_HOSTS)]
                     for r in range(per_host * len(WORKER_HOSTS))))


def exchange_bytes(job: Job, variant: str, nbytes: float) -> dict:
    """{host: {"tx", "rx"}}: payload bytes per exchange. A worker host sends (and
    gets back) N per worker pushing from it: all k of them direct, its leader
    alone with host_reduce; the servers share what all pushers send."""
    counts = Counter(job.worker_hosts)
    pushers = {h: (k if variant == "direct" else 1) for h, k in counts.items()}
    out = {h: {"tx": p * nbytes, "rx": p * nbytes} for h, p in pushers.items()}
    share = sum(pushers.values()) * nbytes / job.servers
    out.update({h: {"tx": share, "rx": share} for h in job.server_hosts})
    return out


def launch_bytes(job: Job, variant: str, nbytes: float, exchanges: int) -> dict:
    """:func:`exchange_bytes` over a launch, plus worker 0's kv.init of the
    servers (its values win: N from its host, none of it to a server on it)."""
    out = {h: {d: exchanges * v for d, v in io.items()}
           for h, io in exchange_bytes(job, variant, nbytes).items()}
    out[job.worker_hosts[0]]["tx"] += nbytes
    for h in job.server_hosts:
        out[h]["rx"] += nbytes / job.servers
    return out


def bound_ms(job: Job, variant: str, nbytes: float, bits_per_s: float) -> float:
    """The busiest link direction's bytes per exchange over the link rate."""
    busiest = max(max(io.values()) for io in exchange_bytes(job, variant, nbytes).values())
    return 1e3 * busiest * 8 / bits_per_s


def grouping_failure(job: Job, counted: dict, nbytes: float, exchanges: int) -> str | None:
    """Why a host_reduce launch did not group (None when it did): a worker host
    sent nearer to the direct model than to the grouped one, or the counter was
    unreadable."""
    grouped = launch_bytes(job, "host_reduce", nbytes, exchanges)
    ungrouped = launch_bytes(job, "direct", nbytes, exchanges)
    for h in dict.fromkeys(job.worker_hosts):
        sent, lo, hi = counted[h]["tx"], grouped[h]["tx"], ungrouped[h]["tx"]
        if sent is None:
            return f"host {h}'s link counter could not be read"
        if sent > (lo + hi) / 2:
            return (f"host {h} sent {sent / 1e6:.1f} MB, nearer to the ungrouped model "
                    f"({hi / 1e6:.1f} MB) than to the grouped one ({lo / 1e6:.1f} MB): "
                    "its workers did not sum on the host")
    return None


def launch(cluster: Cluster, job: Job, rate: str, variant: str, launch_no: int, cfg: dict,
           nbytes: int, data: dict) -> None:
    """One launch of ``variant``: its samples and the bytes on every link go into
    ``data["launches"]``, a failure into ``data["failures"]``."""
    tag = f"{variant}-{rate}-{launch_no}"
    exchanges = cfg["iters"] + cfg["warmup"]
    load = os.getloadavg()[0]
    before = cluster.host_counters()
    t0 = time.monotonic()
    try:
        res = run_ours(cluster, job, {**cfg, "env": {**cfg["env"],
                                                     "KVSTORE_HOST_REDUCE": VARIANTS[variant]}}, tag)
        counted = cluster.counted(before, cluster.host_counters(), job.hosts)
        why = grouping_failure(job, counted, nbytes, exchanges) if variant == "host_reduce" else None
        group = [r for r, h in enumerate(job.worker_hosts) if h == job.worker_hosts[0]]
        if not why and res.get("host_group") != (group if variant == "host_reduce" else []):
            why = f"worker 0's host group was {res.get('host_group')}, not {group if variant == 'host_reduce' else []}"
        if why:
            raise Failed(why)
    except Failed as e:
        data["failures"].append(f"{variant} at {rate} (launch {launch_no + 1}): {e}")
        click.echo(f"  {rate} {variant} launch {launch_no + 1}: FAILED: {e}", err=True)
        return
    d = res["modes"][MODE]
    model = launch_bytes(job, variant, nbytes, exchanges)
    median = common.stats(d["times"])["median"]
    bound = bound_ms(job, variant, nbytes, parse_rate(rate))
    data["launches"].append({
        "rate": rate, "variant": variant, "launch": launch_no, "load_before": load,
        "seconds": time.monotonic() - t0, "samples": d["times"], "unit": "s",
        "median_ms": median * 1e3, "bound_ms": bound, "measured_over_bound": median * 1e3 / bound,
        "link_bytes": counted, "model_link_bytes": model,
        "link_over_model": {h: {k: (v / model[h][k]) if v is not None and model[h][k] else None
                                for k, v in io.items()} for h, io in counted.items()},
        "worker0_bytes_sent": d.get("bytes_sent"), "worker0_bytes_received": d.get("bytes_received"),
        "cpu_s": d.get("cpu_s"), "worker_usage_total": res.get("usage_total"),
        "servers_usage": res.get("servers_usage"), "transports": res.get("transports"),
        "host_group": res.get("host_group"),
        "server_urls": res.get("server_urls")})
    click.echo(f"  {rate} {variant} launch {launch_no + 1}/{cfg['launches']}: median "
               f"{median * 1e3:.0f} ms (bound {bound:.0f} ms); sent A {_mb(counted['A']['tx'])}, "
               f"B {_mb(counted['B']['tx'])} MB (load average before: {load:.2f})", err=True)


def _mb(x) -> str:
    return "?" if x is None else f"{x / 1e6:.1f}"


def summarise(data: dict) -> dict:
    """{rate: {variant: pooled stats (ms), launch medians, bound, mean link bytes
    per host}, "host_reduce/direct": the ratios of medians and of every host's bytes}."""
    out = {}
    for rate in data["rates"]:
        per = {}
        for variant in VARIANTS:
            runs = [L for L in data["launches"] if L["rate"] == rate and L["variant"] == variant]
            if not runs:
                continue
            st = common.stats([s for L in runs for s in L["samples"]])
            per[variant] = {
                **{k: (v * 1e3 if k != "n" else v) for k, v in st.items()},
                "launch_medians_ms": [L["median_ms"] for L in runs], "bound_ms": runs[0]["bound_ms"],
                "link_bytes": {h: {d: _mean([L["link_bytes"][h][d] for L in runs]) for d in ("tx", "rx")}
                               for h in runs[0]["link_bytes"]},
                "model_link_bytes": runs[0]["model_link_bytes"]}
            per[variant]["measured_over_bound"] = per[variant]["median"] / per[variant]["bound_ms"]
        if len(per) == len(VARIANTS):
            d, h = per["direct"], per["host_reduce"]
            per["host_reduce/direct"] = {
                "median": h["median"] / d["median"],
                "link_bytes": {host: {k: _ratio(h["link_bytes"][host][k], v) for k, v in io.items()}
                               for host, io in d["link_bytes"].items()}}
        out[rate] = per
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def markdown(data: dict) -> str:
    m, cfg = data["machine"], data["config"]
    k = cfg["workers_per_host"]
    lines = [
        "# Summing on the host before pushing (`python -m benchmarks.host_reduce`)", "",
        f"Run {data['started']} .. {data['finished']}: `{data['command']}`. "
        f"Machine: {m.get('cpu_model', m.get('processor'))}, {m['cpus']} cores shared by every "
        f"emulated host and by other work, {m.get('mem_total', '?')}, {m['platform']}; load "
        f"average {data['load_start']:.2f} at the start, {data['load_end']:.2f} at the end. "
        "Versions: " + "; ".join(f"{name}: {v}" for name, v in data["versions"].items()) + ".", "",
        f"Layout: worker hosts A and B with {k} workers each (ranks {', '.join(cfg['worker_hosts'])}), "
        "server hosts S0 and S1, every host a network namespace with its own rate-limited link "
        f"(tc tbf both ways) to one bridge. {cfg['model']} parameter set, {data['tensors']} fp32 "
        f"tensors, N = {data['nbytes'] / 1e6:.1f} MB; pushpull of all of them per exchange, "
        f"{cfg['iters']} timed after {cfg['warmup']} warm-up, {cfg['launches']} launch(es) per "
        "variant, interleaved; every sum verified exactly. direct: KVSTORE_HOST_REDUCE=0; "
        "host_reduce: KVSTORE_HOST_REDUCE=1.", "",
        f"Wire bound = the busiest link direction's bytes per exchange / the link rate: direct "
        f"{k}N (each worker host sends its {k} gradients, each server host gets {k}N), "
        "host_reduce N. Bytes: what each host's interface sent (tx) and received (rx) over a "
        "launch (warm-up and kv.init included) next to the payload model (headers add about 1 %; "
        "the servers' split follows the keys' sharding, not exactly N/2 each); the host_reduce launches were checked to send nearer the grouped model than the "
        "ungrouped one from A and B, and worker 0 reported its host group.", ""]
    for rate, per in data["summary"].items():
        raw = data["rates"][rate].get("raw") or {}
        lines += [f"## {rate}" + (f" (raw TCP both ways at once: A->B {raw['a_to_b_gbit']:.3f}, "
                                  f"B->A {raw['b_to_a_gbit']:.3f} Gbit/s)" if raw else ""), "",
                  "| variant | n | median ms | p10-p90 ms | launch medians ms | bound ms | "
                  "median / bound |", "|---|---|---|---|---|---|---|"]
        for variant in VARIANTS:
            if variant in per:
                e = per[variant]
                lines.append(f"| {variant} | {e['n']} | {e['median']:.0f} | {e['p10']:.0f}-"
                             f"{e['p90']:.0f} | {', '.join(f'{x:.0f}' for x in e['launch_medians_ms'])} "
                             f"| {e['bound_ms']:.0f} | {e['measured_over_bound']:.2f} |")
        lines += ["", "| host | direct tx / rx MB | model | host_reduce tx / rx MB | model | "
                  "host_reduce / direct tx, rx |", "|---|---|---|---|---|---|"]
        ratio = per.get("host_reduce/direct", {})
        for host in cfg["hosts"]:
            cells = []
            for variant in VARIANTS:
                e = per.get(variant)
                cells += ["", ""] if e is None else [
                    f"{_mb(e['link_bytes'][host]['tx'])} / {_mb(e['link_bytes'][host]['rx'])}",
                    f"{_mb(e['model_link_bytes'][host]['tx'])} / {_mb(e['model_link_bytes'][host]['rx'])}"]
            r = ratio.get("link_bytes", {}).get(host, {})
            cells.append(", ".join("?" if r.get(d) is None else f"{r[d]:.2f}" for d in ("tx", "rx"))
                         if r else "")
            lines.append(f"| {host} | " + " | ".join(cells) + " |")
        if ratio:
            lines += ["", f"host_reduce / direct median: {ratio['median']:.2f}."]
        lines.append("")
    if data["failures"]:
        # the first line and the last (the error) of each; the json has the log's tail too
        lines += ["## Failures", "", *[f"- {f.splitlines()[0]}" + (f" ... {f.splitlines()[-1].strip()}"
                                                                   if "\n" in f else "")
                                       for f in data["failures"]], ""]
    return "\n".join(lines)


def run_rate(cluster: Cluster, job: Job, rate: str, cfg: dict, nbytes: int, data: dict) -> None:
    """The rate limit on every link, the raw TCP check (a failed one skips the
    rate), then the interleaved launches of both variants."""
    info = data["rates"][rate] = {"qdisc": cluster.set_rate(rate)}
    try:
        info["raw"] = raw_check(cluster, rate, cfg["check_seconds"])
    except Failed as e:
        data["failures"].append(f"raw TCP check at {rate}: {e}")
        click.echo(f"  {rate}: raw TCP check FAILED: {e}", err=True)
        return
    click.echo(f"  {rate}: raw TCP both ways at once: A->B {info['raw']['a_to_b_gbit']:.3f}, "
               f"B->A {info['raw']['b_to_a_gbit']:.3f} Gbit/s", err=True)
    for launch_no in range(cfg["launches"]):
        order = list(VARIANTS) if launch_no % 2 == 0 else list(VARIANTS)[::-1]
        for variant in order:
            launch(cluster, job, rate, variant, launch_no, cfg, nbytes, data)


def _rates(ctx, param, text: str) -> list[str]:
    """click callback: '500mbit,1gbit' -> ['500mbit', '1gbit'], each a valid tc rate."""
    try:
        rates = [r for r in (t.strip().lower() for t in text.split(",")) if r and parse_rate(r)]
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return rates or ctx.fail("--rates: no rate given")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rates", default="500mbit", show_default=True, callback=_rates,
              help="Link rates to emulate (tc units, comma-separated).")
@click.option("--model", type=click.Choice(["resnet50", "tiny"]), default="resnet50",
              show_default=True, help="Parameter set (tiny: for tests).")
@click.option("--workers-per-host", type=click.IntRange(min=2, max=8), default=2, show_default=True,
              help="Workers on each of the worker hosts A and B.")
@click.option("--iters", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed exchanges per launch and variant.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
              help="Untimed exchanges before them.")
@click.option("--launches", type=click.IntRange(min=1), default=2, show_default=True,
              help="Launches of each variant per rate, interleaved (the order alternates).")
@click.option("--timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds one launch may take before it is stopped and the run fails.")
@OUTPUT.click_options
def main(rates, model, workers_per_host, iters, warmup, launches, out_dir, timeout):
    """Time ResNet-50's pushpull from 2 hosts of k workers each to 2 server hosts over
    emulated links, with and without summing on the host (KVSTORE_HOST_REDUCE)."""
    job = job_of(workers_per_host)
    shapes = model_shapes(model)
    nbytes = 4 * sum(math.prod(s) for s in shapes)
    signal.signal(signal.SIGTERM, on_sigterm)
    cluster = Cluster(job.hosts)
    work = tempfile.mkdtemp(prefix="kvhostreduce-")
    cfg = {"model": model, "iters": iters, "warmup": warmup, "launches": launches,
           "modes": {"dedicated": (MODE,)}, "timeout": timeout, "work": work, "env": {},
           "check_seconds": 0.1 if model == "tiny" else 1.0}   # the raw TCP check, per direction
    data = {"command": " ".join(["python -m benchmarks.host_reduce", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_start": os.getloadavg()[0],
            "machine": common.machine(), "versions": versions(), "nbytes": nbytes,
            "tensors": len(shapes), "namespaces": [cluster.switch, *cluster.ns.values()],
            "addresses": dict(cluster.addr),
            "config": {k: v for k, v in cfg.items() if k not in ("work", "env")} | {
                "rates": rates, "workers_per_host": workers_per_host, "hosts": job.hosts,
                "worker_hosts": list(job.worker_hosts), "server_hosts": list(job.server_hosts),
                "variants": {v: f"KVSTORE_HOST_REDUCE={x}" for v, x in VARIANTS.items()},
                "effective": effective_settings({})},
            "rates": {}, "launches": [], "failures": []}
    try:
        if not cluster.up_or_skip():
            return
        click.echo("cluster: " + ", ".join(f"{h} {cluster.addr[h]}" for h in cluster.hosts)
                   + f"; workers on {','.join(job.worker_hosts)}; work dir {work}", err=True)
        for rate in rates:
            run_rate(cluster, job, rate, cfg, nbytes, data)
    except KeyboardInterrupt:   # leave the results of an earlier, complete run in place
        click.echo("interrupted: cleaning up; no results written", err=True)
        sys.exit(130)
    finally:
        errors = cluster.down()
        for e in errors:
            click.echo(f"cleanup: {e}", err=True)
        data["failures"] += [f"cleanup: {e}" for e in errors]
    data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    data["load_end"] = os.getloadavg()[0]
    data["summary"] = summarise(data)
    os.makedirs(out_dir, exist_ok=True)
    common.write_results(out_dir, "host_reduce", markdown(data), data)
    if data["failures"]:
        click.echo("\nFAILED:\n" + "\n".join(data["failures"]), err=True)
        sys.exit(1)
    click.echo(f"(logs in {work})", err=True)


if __name__ == "__main__":
    main()
