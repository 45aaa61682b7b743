"""benchmarks.model and benchmarks.model.link: the link model on link.json-shaped data
checked by hand, the dedicated-server table's arithmetic, and the command on the
runs of record (JSON only: no processes, no links)."""

import json
import os

import pytest
from click.testing import CliRunner

from benchmarks.harness.exchange import effective_settings
from benchmarks.model import run as model, link as model_link
from benchmarks.model.link import Costs, message_bytes, paced, points, predict, run_settings
from benchmarks.harness.layouts import parse
from kvstore.transport import pace

MIB = 1 << 20
N = 100e6          # bytes per worker
RATE = 100e6       # bytes/s: a raw TCP rate of 0.8 Gbit/s both ways
NO_CPU = Costs(k_w=0.0, k_s=0.0, latency=0.0)


def link_json(rows, env=None, started="2026-11-25 05:00:00", raw=(0.8, 0.8)):
    """A link.json as benchmarks.link writes it, reduced to what the model reads."""
    raw_info = {"a_to_b_gbit": raw[0], "b_to_a_gbit": raw[1]} if raw else None
    return {"started": started, "finished": "2026-11-25 05:10:00", "nbytes": N,
            "machine": {"cpus": 2}, "config": {"env": env or {}},
            "rates": {"800mbit": {"qdisc": {"bits_per_s": 8e8}, "raw": raw_info}},
            "rows": [{"rate": "800mbit", "layout": layout, "mode": mode, "samples": samples}
                     for layout, mode, samples in rows]}


FIXED = {"KVSTORE_PIPELINE_BYTES": str(4 * MIB), "KVSTORE_CHUNK_BYTES": str(MIB)}


def test_link_model_on_hand_checked_points():
    rows = [("ring:2", "flat", [1.0, 0.9, 1.2]),
            ("colo:2", "pushpull", [1.1]),
            ("colo:2", "pushpull_2bit", [0.6]),
            ("dedicated:2x2", "pushpull", [1.2, 1.0]),     # median of two: their mean
            ("dedicated:2x1", "pushpull", [2.0])]
    got = {(r["layout"], r["mode"]): r for r in points(link_json(rows, FIXED), NO_CPU)}
    round_ms = 2 * 4 * MIB / RATE * 1e3        # max(W, S) messages of 4 MiB
    want = {("ring:2", "flat"): (1000, 0, 1000),                      # ring: 2N(W-1)/W / B
            ("colo:2", "pushpull"): (1000, 0, 1100),                  # co-located: no round
            ("colo:2", "pushpull_2bit"): (531.25, 0, 600),            # (1/16 + 1) N/2 / B
            ("dedicated:2x2", "pushpull"): (1000, round_ms, 1100),    # N/B + one round
            ("dedicated:2x1", "pushpull"): (2000, round_ms, 2000)}    # 2N on S0's link
    assert set(got) == set(want)
    for key, (wire, fill, measured) in want.items():
        r = got[key]
        assert r["wire"] == pytest.approx(wire), key
        assert r["fill"] == pytest.approx(fill), key
        assert r["total"] == pytest.approx(wire + fill), key
        assert r["measured"] == pytest.approx(measured), key
        assert r["error"] == pytest.approx(measured / (wire + fill) - 1), key
    # ordering: by workers, then ring, co-located, dedicated
    assert [r["kind"] for r in points(link_json(rows, FIXED), NO_CPU)] == \
        ["ring", "colo", "colo", "dedicated", "dedicated"]


def test_compressed_dedicated_waits_for_the_small_first_round_only():
    layout = parse("dedicated:4x4")
    got = predict(layout, "pushpull_2bit", N, RATE, 4 * MIB, MIB, NO_CPU, cores=2)
    first = 4 * (4 * MIB / 16) / RATE                # F: the first round of 2bit pushes
    assert got["total"] == pytest.approx(first + N / RATE)   # then the replies at full rate


def test_the_cpu_bound_and_the_last_message_and_the_latency_add_up():
    costs = Costs(k_w=1e-8, k_s=1e-8, latency=1e-3)
    got = predict(parse("colo:2"), "pushpull", N, RATE, 4 * MIB, MIB, costs, cores=2)
    cpu = 2 * N * 2e-8 / 2                          # W*N*(k_w + k_s)/P = 2 s > 1 s of wire
    assert got["cpu"] == pytest.approx(cpu)
    assert got["total"] == pytest.approx(cpu + 4 * MIB * 2e-8 + 2e-3)


def test_message_bytes_are_whole_chunks_within_the_limit_and_the_share():
    assert message_bytes(50e6, 4 * MIB + MIB // 2, MIB) == 4 * MIB
    assert message_bytes(50e6, MIB // 2, MIB) == MIB            # never below one chunk
    assert message_bytes(3e6, 8 * MIB, MIB) == 3e6              # never above the share
    assert message_bytes(50e6, 0, MIB) == 50e6                  # 0: one message per server


def test_paced_finds_the_fixed_point_and_clamps():
    # a call of 1e8 bytes taking 1 s + its fill: 10 ms of the rate it reaches
    limit = paced(lambda lim: 1.0 + lim / 1e8, 1e8)
    assert limit == pytest.approx(1e8 / (1 + limit / 1e8) * pace.PACE_SECONDS, abs=1)
    assert paced(lambda lim: 1.0, 1e12) == pace.MAX_BYTES
    assert paced(lambda lim: 1.0, 1e3) == pace.MIN_BYTES


def test_auto_messages_follow_the_pace_and_older_runs_had_8_mib():
    assert run_settings(link_json([], FIXED)) == (4 * MIB, MIB)
    assert run_settings(link_json([]))[0] == "auto"
    assert run_settings(link_json([], started="2026-11-25 01:13:07"))[0] == pace.MAX_BYTES
    # what a run recorded it ran with wins over the guess from its --env and date
    recorded = link_json([], started="2026-11-25 01:13:07")
    recorded["config"]["effective"] = effective_settings(FIXED)
    assert run_settings(recorded) == (4 * MIB, MIB)
    assert effective_settings({}) == {"pipeline_bytes": "auto", "chunk_bytes": 2 * MIB}
    layout = parse("dedicated:2x2")
    auto = predict(layout, "pushpull", N, RATE, "auto", MIB, NO_CPU, cores=2)
    # the worker sends N per call: 10 ms of N / T, as whole 1 MiB chunks
    assert auto["limit"] == int(N / auto["total"] * pace.PACE_SECONDS)
    assert auto["message"] == MIB * max(1, auto["limit"] // MIB)


def test_a_run_without_a_raw_rate_or_unfinished_is_refused(tmp_path):
    with pytest.raises(ValueError, match="800mbit .* no raw TCP rate"):
        points(link_json([("ring:2", "flat", [1.0])], raw=None), NO_CPU)
    data = link_json([("ring:2", "flat", [1.0])])
    del data["finished"]
    path = tmp_path / "link.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="has not finished"):
        model_link.report([str(path)], NO_CPU)


def test_dedicated_arithmetic_by_hand():
    b = 10e9 / 8
    got = model.predict_dedicated(4, 10, N, 0.0, 0.0, 4, 1, 0.0, limit=4 * MIB, chunk=MIB)
    assert got["wire"] == pytest.approx(N / b)                        # M/B, S_m = N
    assert got["fill"] == pytest.approx(4 * 4 * MIB / b)              # one round of 4 MiB
    assert got["T_x"] == pytest.approx(N / b + 4 * 4 * MIB / b)
    assert got["T_x_pipelined"] == pytest.approx(N / b)
    # one server machine of 2 processes for 4 workers: 4M/B on its link, 4M*k_s/2 of CPU
    got = model.predict_dedicated(4, 10, N, 1e-9, 1e-9, 1, 2, 1e-3, limit=4 * MIB, chunk=MIB)
    assert got["wire"] == pytest.approx(4 * N / b)
    assert got["cpu"] == pytest.approx(4 * N * 1e-9 / 2 + 4 * MIB * 2e-9)
    assert got["T_x"] == pytest.approx(4 * N / b + 4 * 2 * 4 * MIB / b + 2e-3)


def test_worth_buying_is_the_fewest_server_machines_near_the_best():
    options = [{"t": 3.0}, {"t": 1.04}, {"t": 1.0}, {"t": 0.999}]
    assert model.fewest(options, "t") == 1
    lines = model.dedicated_table(N, 0.0, 0.0, 1, 0.0)
    row = next(line for line in lines if line.startswith("| 2 | 10 Gbit/s |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "80.0"                          # the ring: 2(N-1)/N M/B
    assert cells[4] == "160 · 160 · 160 · 80"          # S_m = 1, 1, 1, 2
    assert cells[5] == "160 · 160 · 160 · 80"          # no CPU: pipelined = wire
    assert cells[6:8] == ["1/1 (S_m = 2)", "1.00x"]
    assert len([line for line in lines if line.startswith("| ") and "Gbit/s" in line]) == 12


def test_the_command_checks_the_runs_of_record():
    files = model_link.default_files()
    assert files, "the runs of record (benchmarks/results/dedicated/**/link.json) are missing"
    result = CliRunner().invoke(model.main, ["--link", *files])
    assert result.exit_code == 0, result.output
    medians, rates = 0, set()
    for path in files:
        with open(path) as f:
            data = json.load(f)
        assert os.path.relpath(path) in result.output
        medians += len({(r["rate"], r["layout"], r["mode"]) for r in data["rows"]})
        rates |= set(data["rates"])
    rows = [line for line in result.output.splitlines()
            if any(line.startswith(f"| {rate} |") for rate in rates)]
    assert len(rows) == medians                   # a prediction for every median
    assert "Largest |error|" in result.output
    assert CliRunner().invoke(model.main, ["--link"]).output == result.output


def test_the_sweep_report_keeps_its_table_and_gains_the_dedicated_one():
    result = CliRunner().invoke(model.main, [])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Calibration (medians over the sweep)")
    assert "| machines | link | wire T_x ms |" in result.output
    assert "| machines N | link | ring T_x ms |" in result.output
    assert CliRunner().invoke(model.main, [model_link.default_files()[0]]).exit_code == 2
