"""The benchmark harness pieces that compute, the command line, and end-to-end runs of the step,
kernel, offload, muon and overhead suites (their output included). No timing is asserted."""

from __future__ import annotations

import csv
import itertools
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench.__main__ as bench_main  # noqa: E402
from bench import harness, muon, overhead, step  # noqa: E402
from bench.formulas import zero_bytes  # noqa: E402
from bench.harness import RATIO_LEGEND, Table, Timing, format_table, percentile, ratio, write_csv  # noqa: E402
from bench.offload import without_profiler_noise  # noqa: E402


@pytest.mark.parametrize(
    "stage, mixed, expected",
    [
        (0, True, 16_000),  # 2 + 2 + 12 bytes per param
        (1, True, 4_000 + 12_000 / 4),
        (2, True, 2_000 + 14_000 / 4),
        (0, False, 16_000),  # 4 + 4 + 8
        (1, False, 8_000 + 8_000 / 4),
        (2, False, 4_000 + 12_000 / 4),
    ],
)
def test_zero_formula_matches_the_paper(stage, mixed, expected):
    assert zero_bytes(1_000, 4, stage, mixed) == expected


def test_zero_formula_without_sharding_is_ddp():
    for stage in (1, 2):
        for mixed in (True, False):
            assert zero_bytes(777, 1, stage, mixed) == zero_bytes(777, 1, 0, mixed)


def test_zero_formula_rejects_bad_arguments():
    with pytest.raises(ValueError, match="stage=3"):
        zero_bytes(10, 2, 3, True)
    with pytest.raises(ValueError, match="world_size=0"):
        zero_bytes(10, 0, 1, True)


def test_percentiles_and_ratio_against_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 50):
        samples = rng.random(n).tolist()
        for q in (0, 20, 50, 80, 100):
            assert percentile(samples, q) == pytest.approx(np.percentile(samples, q), rel=1e-12)
    fast, slow = Timing("a", (1.0, 2.0, 3.0)), Timing("b", (4.0, 4.0, 5.0, 6.0))
    assert (fast.median, fast.p20, fast.p80) == (2.0, pytest.approx(1.4), pytest.approx(2.6))
    assert ratio(fast, slow) == 2.0 / 4.5
    with pytest.raises(ValueError):
        percentile([], 50)


def test_csv_is_stamped_and_keeps_every_column(tmp_path):
    path = write_csv("demo", [{"method": "a", "ms": 1.5}, {"method": "b", "ratio": 0.9}], tmp_path)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["a", "b"]
    assert rows[0]["ms"] == "1.5" and rows[1]["ratio"] == "0.9" and rows[0]["ratio"] == ""
    assert all(r["device"] and r["torch"] and r["date"] for r in rows)
    assert path.name.startswith("demo-" + rows[0]["date"])
    with pytest.raises(ValueError, match="no rows"):
        write_csv("demo", [], tmp_path)
    assert "1.5" in format_table([{"method": "a", "ms": 1.5}])
    table = format_table([{"method": "a", "ratio": ""}, {"method": "b", "ms": 2.0, "ratio": ""}])
    assert table.splitlines()[0].split() == ["method", "ms"]  # a column empty in every row is left out


def test_help_lists_the_suites_and_what_each_measures(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_main.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "{step,memory,kernel,offload,muon,overhead}" in out
    assert "{," not in out and "[]" not in out  # no empty choice
    for name, suite in bench_main.SUITES.items():
        assert f"  {name}  " in out and suite.SUMMARY in out


def test_a_suite_needing_more_gpus_than_the_machine_has_is_skipped_by_name_and_fails_the_command(monkeypatch, tmp_path, capsys):
    # A lent GPU machine has one GPU, and NCCL refuses two ranks on one ("Duplicate GPU detected"):
    # the multi-rank suites must say so, before any process starts, and leave the others to run.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(harness.mp, "get_context", lambda *a: pytest.fail("a process was started"))
    with pytest.raises(SystemExit) as exit_info:
        bench_main.main(["step", "memory", "--quick", "--out", str(tmp_path)])
    assert exit_info.value.code == "skipped for want of GPUs: step, memory"
    out = capsys.readouterr().out
    assert "step: skipped: bench.step.rank_main needs 2 ranks, one per GPU, and this machine has 1 GPU(s)" in out
    assert "memory: skipped: bench.memory.rank_main needs 2 ranks" in out
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_suite_is_refused_before_any_runs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_main.main(["kernel", "stpe"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "invalid choice: 'stpe' (choose from 'step', 'memory', 'kernel', 'offload', 'muon', 'overhead')" in captured.err
    assert captured.out == ""


def test_no_suite_runs_every_suite_and_prints_each_table_under_its_legend(monkeypatch, tmp_path, capsys):
    def fake(name: str) -> types.SimpleNamespace:
        rows = [{"kind": "time", "method": name, "median_ms": 1.0}, {"kind": "ratio", "method": name, "ratio": 0.5}]
        tables = (Table(("time",), f"{name} times legend"), Table(("ratio",), f"{name} ratios legend"))
        return types.SimpleNamespace(SUMMARY=name, TABLES=tables, run=lambda quick: rows)

    monkeypatch.setattr(bench_main, "SUITES", {name: fake(name) for name in ("one", "two")})
    bench_main.main(["--quick", "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    for name in ("one", "two"):
        times, ratios = lines.index(f"{name} times legend"), lines.index(f"{name} ratios legend")
        assert lines[times - 3].split() == ["kind", "method", "median_ms"] and name in lines[times - 1]
        assert lines[ratios - 3].split() == ["kind", "method", "ratio"] and name in lines[ratios - 1]
        assert len(list(tmp_path.glob(f"{name}-*.csv"))) == 1
    assert lines.count(harness.measured_on()) == 2  # under each suite's tables: where and when it ran


def test_every_table_has_a_one_line_legend():
    for suite in bench_main.SUITES.values():
        assert suite.SUMMARY and "\n" not in suite.SUMMARY
        for table in suite.TABLES:
            assert table.legend and "\n" not in table.legend


def test_profiler_notices_are_dropped_and_the_rest_of_stderr_kept(capfd):
    with without_profiler_noise(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        torch.ones(3).add_(1)
        os.write(2, b"USDT:2026-11-22 07:21:23 2785:2785 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a warning that stays\n")
        os.write(2, b"STAGE:2026-11-22 07:22:02 3053:3053 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n")
    assert capfd.readouterr().err == "a warning that stays\n"


# The suites run end to end here, with the world size each needs: a suite needing more ranks than the machine has GPUs
# runs on CPU ranks (NCCL takes one GPU per rank).
SUITE_RANKS = {"step": 4, "kernel": 1, "offload": 1, "muon": muon.WORLD_SIZE, "overhead": 2}


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory) -> dict[str, tuple[list[str], list[dict]]]:
    """Per suite: the lines ``python -m bench ... --quick`` printed for it and the rows of the CSV it wrote.

    The suites share a command (one ``python -m bench`` per set of suites that see the same GPUs): a
    command starts its rank processes from one server that imported torch once."""
    out = tmp_path_factory.mktemp("bench")
    hidden = {name for name, ranks in SUITE_RANKS.items() if 0 < torch.cuda.device_count() < ranks}
    stdout = []
    for names in ([n for n in SUITE_RANKS if n not in hidden], [n for n in SUITE_RANKS if n in hidden]):
        if not names:
            continue
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if names[0] in hidden else dict(os.environ)
        result = subprocess.run([sys.executable, "-m", "bench", *names, "--quick", "--out", str(out)],
                                capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        noise = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith(("USDT:", "STAGE:"))]
        assert not noise, noise
        stdout += result.stdout.splitlines()
    runs = {}
    for name in SUITE_RANKS:  # each suite's lines end with "<name>: <seconds> s, wrote <csv>"
        (last,) = [i for i, line in enumerate(stdout) if line.startswith(f"{name}: ") and ", wrote " in line]
        lines, stdout = stdout[:last + 1], stdout[last + 1:]
        (path,) = out.glob(f"{name}-*.csv")
        with open(path) as f:
            runs[name] = (list(itertools.dropwhile(lambda line: not line, lines)), list(csv.DictReader(f)))
    return runs


def _run_suite(runs: dict, name: str, phases: int) -> list[dict]:
    """The rows of suite ``name``'s CSV from :func:`quick_runs`, after checking what it printed: ``phases`` progress lines
    before the first table, each table's legend under its last row (the shared ratio legend where it has a ``ratio``
    column), and none of the profiler's own notices."""
    lines, rows = runs[name]
    progress = [i for i, line in enumerate(lines) if line.startswith(f"{name}: ") and line.endswith(" ...")]
    assert len(progress) == phases and progress == list(range(phases)), lines
    for table in bench_main.SUITES[name].TABLES:
        legend = lines.index(table.legend)
        header = lines[legend - len(table.select(rows)) - 2]
        assert set(lines[legend - len(table.select(rows)) - 1]) == {"-", " "}, lines
        assert ("ratio" in header.split()) == (RATIO_LEGEND in table.legend), header
    return rows


def test_step_suite_runs_end_to_end(quick_runs):
    rows = _run_suite(quick_runs, "step", phases=2)
    times = {r["method"]: float(r["median_ms"]) for r in rows if r["kind"] == "time"}
    # DeepSpeed's stages join when it is installed (the bench extra)
    assert set(times) == {"ddp", "torch_zero", "fsdp2", "zeroshard_stage1", "zeroshard_stage2"} | (set(step.DEEPSPEED) if step.HAS_DEEPSPEED else set())
    assert all(t > 0 for t in times.values())
    ratios = [r for r in rows if r["kind"] == "ratio"]
    assert len(ratios) == len(step.RATIOS) == (7 if step.HAS_DEEPSPEED else 4)
    for r in ratios:  # each ratio is the two medians of this same run
        assert float(r["ratio"]) == pytest.approx(times[r["method"]] / times[r["baseline"]], rel=1e-6)
    sent = {r["method"]: float(r["bytes_per_param"]) for r in rows if r["kind"] == "bytes"}
    assert set(sent) == {"ddp", "zeroshard_flat", "zeroshard_hybrid"}
    # Counted bytes are at least what the collectives must move (ring algorithms, 4 ranks, fp32):
    # DDP's all-reduce 2*(3/4)*4 bytes per param; flat sharding's all-gather alone (3/4)*4.
    assert sent["ddp"] >= 6.0 and sent["zeroshard_flat"] >= 3.0 and sent["zeroshard_hybrid"] > 0
    for r in (r for r in rows if r["kind"] == "bytes"):
        assert float(r["vs_flat"]) == pytest.approx(sent[r["method"]] / sent["zeroshard_flat"], rel=1e-6)


def test_kernel_suite_runs_end_to_end(quick_runs):
    rows = _run_suite(quick_runs, "kernel", phases=1)
    times = {r["method"]: float(r["median_us"]) for r in rows if r["kind"] == "time"}
    assert all(t > 0 for t in times.values()) and len(times) == 4
    for r in (r for r in rows if r["kind"] == "ratio"):  # zeroshard's time over the baseline's, same run
        assert float(r["ratio"]) == pytest.approx(times[r["method"]] / times[r["baseline"]], rel=1e-6)


def test_offload_suite_runs_end_to_end(quick_runs):
    rows = _run_suite(quick_runs, "offload", phases=2)
    times = {r["method"]: float(r["median_ms"]) for r in rows if r["kind"] == "time"}
    assert set(times) == {"zeroshard_offload", "zeroshard_offload_cpu_adam", "zeroshard_on_device", "torch_adamw_fused", "torch_adamw_fused_profiled"}
    assert times["zeroshard_offload_cpu_adam"] > 0  # the CPU-update ranges were found in the profile
    for r in (r for r in rows if r["kind"] == "ratio"):  # zeroshard's time over the baseline's, as in every table
        assert float(r["ratio"]) == pytest.approx(times[r["method"]] / times[r["baseline"]], rel=1e-6)
    train = {r["method"]: float(r["median_ms"]) for r in rows if r["kind"] == "train_time"}
    assert set(train) == {"on_device", "offload", "offload_half", "offload_half_cpu_adam"}
    ratios = {r["method"]: float(r["ratio"]) for r in rows if r["kind"] == "train_ratio"}
    assert ratios["offload"] == pytest.approx(train["offload"] / train["on_device"], rel=1e-6)
    assert ratios["offload_half"] == pytest.approx(train["offload_half"] / max(train["on_device"], train["offload_half_cpu_adam"]), rel=1e-6)


def test_muon_suite_runs_end_to_end(quick_runs):
    rows = _run_suite(quick_runs, "muon", phases=1)
    times = {r["method"]: float(r["median_ms"]) for r in rows if r["kind"] == "time"}
    assert set(times) == {"torch_muon", "zeroshard_muon", "all_gather", "zeroshard_adamw"}
    assert all(t > 0 for t in times.values())
    ratios = {(r["method"], r["baseline"]): r for r in rows if r["kind"] == "ratio"}
    assert set(ratios) == {("zeroshard_muon", "torch_muon"), ("zeroshard_muon", "zeroshard_adamw")}
    for (method, baseline), r in ratios.items():  # the two medians of this same run
        assert float(r["ratio"]) == pytest.approx(times[method] / times[baseline], rel=1e-6)
    goal = float(ratios["zeroshard_muon", "torch_muon"]["goal"])  # 1/N plus the all-gather's share
    assert goal == pytest.approx(0.5 + times["all_gather"] / times["torch_muon"], rel=1e-6)
    state = [r for r in rows if r["kind"] == "state"]
    assert [(r["method"], r["rank"]) for r in state] == [("torch_muon", "every"), ("zeroshard_muon", "0"), ("zeroshard_muon", "1")]
    unsharded = float(state[0]["state_MiB"])
    assert unsharded > 0 and float(state[0]["ideal_MiB"]) == pytest.approx(unsharded / 2, rel=1e-6)
    # Each matrix's momentum lives on its owner only: the ranks' state adds up to the unsharded state.
    assert sum(float(r["state_MiB"]) for r in state[1:]) == pytest.approx(unsharded, rel=1e-6)
    for r in state:
        assert float(r["vs_ideal"]) == pytest.approx(float(r["state_MiB"]) / float(r["ideal_MiB"]), rel=1e-6)


def test_host_syncs_are_scalar_reads_and_blocking_copies_to_the_host():
    accelerator = torch.empty(3, device="meta")  # stands for a GPU tensor: the rule reads devices only
    host = torch.zeros(3)
    assert overhead.is_host_sync("aten::_local_scalar_dense", (host,), {})
    assert overhead.is_host_sync("aten::_to_copy", (accelerator,), {"device": torch.device("cpu")})
    assert overhead.is_host_sync("aten::copy_", (host, accelerator), {})
    assert not overhead.is_host_sync("aten::_to_copy", (accelerator,), {"device": "cpu", "non_blocking": True})
    assert not overhead.is_host_sync("aten::copy_", (host, accelerator, True), {})
    assert not overhead.is_host_sync("aten::_to_copy", (host,), {"dtype": torch.float16})
    assert not overhead.is_host_sync("aten::copy_", (accelerator, host), {})  # host to device: no wait
    with overhead.OpCounter() as counter:
        host.sum().item()
    counts = counter.counts()
    assert (counts.aten, counts.c10d, dict(counts.host_syncs)) == (2, 0, {"aten::_local_scalar_dense": 1})
    with overhead.OpCounter() as counter:
        host.tolist()  # a CPU tensor's list reads memory, dispatching nothing
    assert counter.counts().aten == 0


def test_overhead_suite_runs_end_to_end(quick_runs):
    rows = _run_suite(quick_runs, "overhead", phases=1)
    forwards = [r for r in rows if r["kind"] == "forward"]
    rows = [r for r in rows if r["kind"] == "overhead"]
    assert [(r["size"], r["method"]) for r in rows] == [("small-compute", m) for m in overhead.METHODS]  # --quick: the small size only
    assert [r["method"] for r in forwards] == [m for m in overhead.METHODS if m.startswith("zeroshard")]
    for r in forwards:  # the forward with gathers in flight against the same forward with none
        assert float(r["pending_over_none"]) == pytest.approx(float(r["pending_ms"]) / float(r["none_ms"]), rel=1e-6)
    for r in rows:
        counts = {column: r[column] for column in ("aten_ops", "host_syncs", "c10d_ops")}
        assert all(value.isdigit() for value in counts.values()), counts
        assert int(r["aten_ops"]) > 0 and int(r["c10d_ops"]) > 0, counts
        named = [entry.rsplit("=", 1) for entry in r["sync_ops"].split()]  # "op=calls" for each sync op
        assert sum(int(n) for _, n in named) == int(r["host_syncs"]) and all(op.startswith("aten::") for op, _ in named), r
        assert int(r["param_tensors"]) > 0 and float(r["median_ms"]) > 0
    times = {(r["size"], r["method"]): float(r["median_ms"]) for r in rows}
    for r in rows:  # each ratio is the two medians of this same run and size
        assert float(r["ratio"]) == pytest.approx(times[r["size"], r["method"]] / times[r["size"], overhead.BASELINE], rel=1e-6)


def test_host_phases_prints_a_line_per_size_and_method():
    result = subprocess.run([sys.executable, "-m", "bench.host_phases", "--steps", "1", "--warmup", "1", "--profile-step"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "MASTER_PORT": "29547"})
    lines = [line for line in result.stdout.splitlines() if "ms/step" in line]
    assert result.returncode == 0 and len(lines) == 6, result.stdout + result.stderr
    assert all("forward" in line and "zero_grad" in line for line in lines)
    for method in ("zeroshard_stage1", "zeroshard_stage2"):  # --profile-step: a profile of step() for each
        assert f"example {method}: opt.step() under cProfile, 1 steps" in result.stdout, result.stdout
    assert result.stdout.count("Ordered by: internal time") == 2, result.stdout


def test_host_phases_under_torchrun_prints_rank_0s_times_once():
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29549", "-m",
                             "bench.host_phases", "--steps", "2", "--warmup", "1", "--rounds", "2"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    lines = [line for line in result.stdout.splitlines() if "ms/step" in line]
    assert result.returncode == 0 and len(lines) == 6, result.stdout + result.stderr
    assert {line.split()[1] for line in lines} == {"ddp_adamw_fused", "zeroshard_stage1", "zeroshard_stage2"}


def test_step_parts_times_the_step_and_its_parts_per_method():
    """``python -m bench.step_parts`` wraps zeroshard internals by name: this fails once one of them is renamed."""
    result = subprocess.run([sys.executable, "-m", "bench.step_parts", "small-compute", "--steps", "2"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "MASTER_PORT": "29548"})
    assert result.returncode == 0, result.stdout + result.stderr
    for method in ("zeroshard_stage1", "zeroshard_stage2"):
        section = result.stdout.split(f"== small-compute {method}")[1].split("==")[0]
        times = {line.split()[-1]: float(line.split()[0]) for line in section.splitlines()[1:] if line.strip()}
        assert times["ShardedOptimizer.step"] == max(times.values()) > 0, section
        assert times["UpdateMixin._gather_stats"] > 0 and times["FusedAdam.step"] > 0, section
