"""kvstore.tools.parse_log: parsing MXNet-format logs (any prefix, several workers,
missing fields), the markdown table, the CLI and its --plot."""

import pytest
from click.testing import CliRunner

from kvstore.tools.parse_log import EpochRow, main, parse, select_worker, to_markdown, worker_ranks

HEADER = ("| epoch | train-accuracy | validation-accuracy | time (s) | speed (samples/s) "
          "| sent (MB) | received (MB) |")

PLAIN = """\
INFO:root:Start training with [cpu(0)]
Epoch[0] Batch [20]\tSpeed: 1000.00 samples/sec\taccuracy=0.500000
Epoch[0] Batch [40]\tSpeed: 3000.00 samples/sec\taccuracy=0.600000
Epoch[0] Train-accuracy=0.700000
Epoch[0] Time cost=12.300
Epoch[0] Validation-accuracy=0.650000
Epoch[0] Comm-sent-bytes=123456789
Epoch[0] Comm-received-bytes=23456789
Epoch[1] Batch [0-20]\tSpeed: 2500.50 samples/sec\tTrain-accuracy=0.100000
Epoch[1] Train-accuracy=0.800000
Epoch[1] Time cost=11.000
Epoch[1] Validation-accuracy=0.750000
Epoch[1] Comm-sent-bytes=1000000
Epoch[1] Comm-received-bytes=2000000
"""


def prefixed(text, prefix):
    return "".join(prefix + line + "\n" for line in text.splitlines())


def check_plain(rows):
    assert [r.epoch for r in rows] == [0, 1]
    r0, r1 = rows
    assert (r0.train_accuracy, r0.validation_accuracy, r0.time) == (0.7, 0.65, 12.3)
    assert r0.speed == 2000.0 and r0.speeds == [1000.0, 3000.0]
    assert (r0.sent_bytes, r0.received_bytes) == (123456789, 23456789)
    # a Batch line's own "Train-accuracy=" is the running batch metric, not the epoch's
    assert r1.train_accuracy == 0.8 and r1.speed == 2500.5
    assert (r1.sent_bytes, r1.received_bytes) == (1e6, 2e6)


@pytest.mark.parametrize("prefix", ["", "[worker:0] ", "2026-11-22 04:00:00,123 INFO ",
                                    "[worker:0] 2026-11-22 04:00:00,123 Node[0] ", "INFO:root:"])
def test_any_prefix(prefix):
    check_plain(parse(prefixed(PLAIN, prefix).splitlines()))


def test_several_workers_use_worker_0():
    worker1 = PLAIN.replace("0.7", "0.1").replace("1000.00", "9.00").replace("12.300", "99.0")
    lines = []
    for a, b in zip(prefixed(PLAIN, "[worker:0] ").splitlines(), prefixed(worker1, "[worker:1] ").splitlines()):
        lines += [b, a, "[server:0] Epoch[0] Time cost=1.0"]   # interleaved, worker 1 first
    assert worker_ranks(lines) == [0, 1]
    chosen, rank = select_worker(lines)
    assert rank == 0 and all(line.startswith("[worker:0]") for line in chosen)
    check_plain(parse(lines))
    assert parse(prefixed(worker1, "[worker:1] ").splitlines())[0].train_accuracy == 0.1


def test_one_worker_uses_all_lines():
    lines = prefixed(PLAIN, "[worker:1] ").splitlines()
    assert select_worker(lines) == (lines, None)
    check_plain(parse(lines))
    lines += ["[worker:0] connecting", "[server:0] Epoch[0] ready"]     # no epoch lines of worker 0
    assert worker_ranks(lines) == [1]
    check_plain(parse(lines))


def test_missing_fields_are_empty_cells():
    rows = parse(["Epoch[2] Train-accuracy=0.5", "Epoch[0] Time cost=3.25",
                  "Epoch[0] Batch [10]\tSpeed: 10.00 samples/sec", "noise Epoch[x] nothing"])
    assert rows == [EpochRow(0, time=3.25, speed=10.0, speeds=[10.0]), EpochRow(2, train_accuracy=0.5)]
    table = to_markdown(rows).splitlines()
    assert table[0] == HEADER and table[1] == "|---:|---:|---:|---:|---:|---:|---:|"
    assert table[2] == "| 0 |  |  | 3.25 | 10.0 |  |  |"
    assert table[3] == "| 2 | 0.5000 |  |  |  |  |  |"


def test_markdown_values():
    table = to_markdown(parse(PLAIN.splitlines())).splitlines()
    assert table[2] == "| 0 | 0.7000 | 0.6500 | 12.30 | 2000.0 | 123.46 | 23.46 |"
    assert table[3] == "| 1 | 0.8000 | 0.7500 | 11.00 | 2500.5 | 1.00 | 2.00 |"


def test_nan_and_exponents():
    rows = parse(["Epoch[0] Train-accuracy=nan", "Epoch[0] Comm-sent-bytes=1.5e+06"])
    assert to_markdown(rows).splitlines()[2] == "| 0 | nan |  |  |  | 1.50 |  |"


def test_cli_tables_for_several_logs(tmp_path):
    one, two = tmp_path / "one.log", tmp_path / "two.log"
    one.write_text(prefixed(PLAIN, "[worker:0] ") + prefixed(PLAIN, "[worker:1] "))
    two.write_text(PLAIN)
    result = CliRunner().invoke(main, [str(one), str(two)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"## {one}" in out and f"## {two}" in out
    assert "2 workers in this log (ranks 0, 1): using worker 0's lines" in out
    assert out.count("workers in this log") == 1
    assert out.count(HEADER) == 2
    assert out.count("| 0 | 0.7000 | 0.6500 | 12.30 | 2000.0 | 123.46 | 23.46 |") == 2


def test_cli_log_without_epochs_fails_clearly(tmp_path):
    good, empty = tmp_path / "good.log", tmp_path / "empty.log"
    good.write_text(PLAIN)
    empty.write_text("[worker:0] starting\n[server:0] ready\n")
    result = CliRunner().invoke(main, [str(empty), str(good)])
    assert result.exit_code != 0
    assert f"{empty}: no epoch lines found" in result.stderr
    assert f"no epochs in {empty}" in result.stderr
    assert "| 1 | 0.8000 |" in result.stdout                  # the good log is still summarised


def test_cli_needs_existing_logs(tmp_path):
    result = CliRunner().invoke(main, [str(tmp_path / "nope.log")])
    assert result.exit_code == 2 and "does not exist" in result.stderr
    assert CliRunner().invoke(main, []).exit_code == 2


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    logs = []
    for name, text in [("a.log", PLAIN), ("b.log", PLAIN.replace("0.7", "0.6")), ("sub/a.log", PLAIN)]:
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        logs.append(str(path))
    png = tmp_path / "curves.png"
    result = CliRunner().invoke(main, logs + ["--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert f"plot written to {png}" in result.stdout


def test_cli_plot_without_matplotlib(tmp_path, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    log = tmp_path / "a.log"
    log.write_text(PLAIN)
    result = CliRunner().invoke(main, [str(log), "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 1
    assert "--plot needs matplotlib" in result.stderr and "pip install matplotlib" in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_module_runs_as_script(tmp_path):
    import subprocess
    import sys
    log = tmp_path / "a.log"
    log.write_text(PLAIN)
    done = subprocess.run([sys.executable, "-m", "kvstore.tools.parse_log", str(log)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert HEADER in done.stdout


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_cli_help(flag):
    result = CliRunner().invoke(main, [flag])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout and "--plot" in result.stdout


# what older MXNet releases print (e.g. the logs of MXNet's multi-machine test notes)
OLD_MXNET = """\
INFO:root:Start training with [cpu(0)]
INFO:root:Iter[0] Batch [20]\tSpeed: 1000.00 samples/sec\tTrain-accuracy=0.500000
INFO:root:Iter[0] Batch [40]\tSpeed: 3000.00 samples/sec\tTrain-accuracy=0.600000
INFO:root:Iteration[0] Train-accuracy=0.700000
INFO:root:Iteration[0] Time cost=12.300
INFO:root:Iteration[0] Validation-accuracy=0.650000
INFO:root:Iteration[1] Train-accuracy=0.800000
INFO:root:Iteration[1] Time cost=11.000
INFO:root:Iteration[1] Validation-accuracy=0.750000
"""


def test_iteration_lines_of_older_mxnet(tmp_path):
    rows = parse(OLD_MXNET.splitlines())
    assert [r.epoch for r in rows] == [0, 1]
    assert (rows[0].train_accuracy, rows[0].validation_accuracy, rows[0].time, rows[0].speed) == \
        (0.7, 0.65, 12.3, 2000.0)
    assert (rows[1].train_accuracy, rows[1].time) == (0.8, 11.0)
    log = tmp_path / "old.log"
    log.write_text(OLD_MXNET)
    result = CliRunner().invoke(main, [str(log)])
    assert result.exit_code == 0, result.output
    assert "| 0 | 0.7000 | 0.6500 | 12.30 | 2000.0 |  |  |" in result.stdout


def test_several_workers_without_prefixes_are_averaged(tmp_path):
    worker1 = PLAIN.replace("0.700000", "0.500000").replace("12.300", "14.300") \
                   .replace("123456789", "123456791").replace("0.650000", "0.450000")
    lines = [line for pair in zip(PLAIN.splitlines(), worker1.splitlines()) for line in pair]
    r0 = parse(lines)[0]
    assert r0.train_accuracy == pytest.approx(0.6) and r0.validation_accuracy == pytest.approx(0.55)
    assert r0.time == pytest.approx(13.3) and r0.sent_bytes == 123456790
    assert r0.speed == 2000.0                           # the mean of every Batch line
    log = tmp_path / "mixed.log"
    log.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(main, [str(log)])
    assert result.exit_code == 0, result.output
    assert "up to 2 values per epoch and no [worker:N] prefixes" in result.stdout
    assert "| 0 | 0.6000 | 0.5500 | 13.30 | 2000.0 | 123.46 | 23.46 |" in result.stdout


def test_several_workers_with_prefixes_get_a_column_each(tmp_path):
    worker1 = PLAIN.replace("0.700000", "0.100000").replace("12.300", "99.000")
    log = tmp_path / "two.log"
    log.write_text(prefixed(PLAIN, "[worker:0] ") + prefixed(worker1, "[worker:1] "))
    result = CliRunner().invoke(main, [str(log)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "| 0 | 0.7000 | 0.6500 | 12.30 | 2000.0 | 123.46 | 23.46 |" in out     # worker 0's, as before
    assert "| epoch | train-accuracy w0 | train-accuracy w1 | validation-accuracy w0 |" in out
    assert "| 0 | 0.7000 | 0.1000 | 0.6500 | 0.6500 | 12.30 | 99.00 |" in out
