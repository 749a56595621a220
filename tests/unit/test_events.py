"""metrics.event_log: the writer (trainer/metrics/events.py) from marks on a fake clock, and the straggler table
(trainer/metrics/event_summary.py, scripts/summarize_events.py) from crafted files of two ranks with known times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import REPO
from trainer.metrics import events as events_module
from trainer.metrics.event_summary import EventLogError, format_summary, quantile, read_run, summarize
from trainer.metrics.events import CPU_TRACE, EventLog, config_hash, events_file, profile_record
from trainer.metrics.profiling import TRACE_SUFFIX, maybe_enable_profiling
from trainer.metrics.trace_summary import TraceSummary, load_trace_events, summarize_events

LAYOUT = {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "ep": 1, "pp": 1, "cp": 1, "world_size": 2}


class NonFinite(Exception):
    pass


class StopBeforeStep(BaseException):
    pass


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _fake_clock(monkeypatch: pytest.MonkeyPatch, perf: list[float], wall: list[float]) -> None:
    perf_it, wall_it = iter(perf), iter(wall)
    monkeypatch.setattr(events_module, "perf_counter", lambda: next(perf_it))
    monkeypatch.setattr(events_module, "wall_clock", lambda: next(wall_it))


def _step(log: EventLog, step: int) -> None:
    assert log.next_batch(SimpleNamespace(next_batch=lambda: "batch")) == "batch"
    log.after_forward_backward(step)
    log.after_optimizer_step(step, torch.tensor(False))


def test_step_records_are_the_marks_differences_written_at_log_steps(tmp_path: Path, monkeypatch) -> None:
    log = EventLog(True, dump_folder=str(tmp_path), rank=3, device=torch.device("cpu"), layout=LAYOUT,
                   config={"train": {"steps": 2}})
    # perf_counter: step 1's fetch 10.0-10.5, forward/backward to 12.0, optimizer to 12.25; step 2: 20, 20.25, 21, 22.
    # time.time: the run_start's stamp, then each batch's readiness, then the error's stamp.
    _fake_clock(monkeypatch, [10.0, 10.5, 12.0, 12.25, 20.0, 20.25, 21.0, 22.0], [500.0, 501.0, 502.0, 503.0])
    state = SimpleNamespace(step=0, preempted=False, stopped_by=None)
    path = events_file(tmp_path, 3)
    assert path == tmp_path / "events" / "rank-00003.jsonl"
    with pytest.raises(RuntimeError, match="boom"):
        with log.recording(state, nonfinite=NonFinite):
            _step(log, 1)
            assert [r["event"] for r in _lines(path)] == ["run_start"]  # buffered: no sync outside log steps
            assert log.on_log(1) == {}
            _step(log, 2)
            state.step = 2
            raise RuntimeError("boom\nsecond line")
    start, step1, step2, error = _lines(path)
    assert start["time"] == 500.0 and start["rank"] == 3 and start["layout"] == LAYOUT
    assert start["config_hash"] == config_hash({"train": {"steps": 2}}) and start["resumed_step"] == 0
    assert set(start["versions"]) == {"python", "torch", "torchao", "trainer", "git_commit"}
    assert start["versions"]["torch"] == torch.__version__
    assert step1 == {"event": "step", "time": 501.0, "rank": 3, "step": 1, "data_s": 0.5, "forward_backward_s": 1.5,
                     "optimizer_s": 0.25, "step_s": 2.25, "comm_s": None}  # 2 ranks: exposed comm is not known
    assert step2 == {"event": "step", "time": 502.0, "rank": 3, "step": 2, "data_s": 0.25, "forward_backward_s": 0.75,
                     "optimizer_s": 1.0, "step_s": 2.0, "comm_s": None}  # flushed by the error
    assert error == {"event": "error", "time": 503.0, "rank": 3, "step": 2, "type": "RuntimeError", "message": "boom"}


def test_endings_and_the_file_of_a_fresh_run(tmp_path: Path) -> None:
    def run(state, error: BaseException | None = None) -> list[dict]:
        log = EventLog(True, dump_folder=str(tmp_path), rank=0, device=torch.device("cpu"),
                       layout={**LAYOUT, "world_size": 1}, config={})
        try:
            with log.recording(state, nonfinite=NonFinite):
                _step(log, state.step + 1)
                if error is not None:
                    raise error
        except BaseException as e:  # what the test raised, and nothing else
            assert e is error
        log.close()
        return _lines(events_file(tmp_path, 0))

    records = run(SimpleNamespace(step=0, preempted=False, stopped_by=None))
    assert [r["event"] for r in records] == ["run_start", "step", "run_end"] and records[1]["comm_s"] == 0.0
    # A resumed run appends; a fresh one moves the earlier file aside.
    records = run(SimpleNamespace(step=4, preempted=True, stopped_by="SIGTERM"))
    assert [r["event"] for r in records] == ["run_start", "step", "run_end", "run_start", "step", "stop"]
    assert records[-1] == {**records[-1], "step": 4, "reason": "signal", "signal": "SIGTERM"}
    records = run(SimpleNamespace(step=0, preempted=False, stopped_by=None), NonFinite("non-finite loss\nmore"))
    assert [r["event"] for r in records] == ["run_start", "step", "stop"]
    assert records[-1] == {**records[-1], "reason": "nonfinite", "message": "non-finite loss"}
    assert (tmp_path / "events" / "rank-00000.jsonl.prev-1").exists()
    # A stop signal before the first step ends in a BaseException (StoppedBeforeFirstStep) after the state says so; an
    # Exception during a stop (its save failed) is an error.
    stopping = SimpleNamespace(step=3, preempted=True, stopped_by="SIGINT")
    stop = run(stopping, StopBeforeStep())[-1]
    assert stop == {"event": "stop", "time": stop["time"], "rank": 0, "step": 3, "reason": "signal", "signal": "SIGINT"}
    error = run(stopping, OSError(28, "No space left"))[-1]
    assert error == {"event": "error", "time": error["time"], "rank": 0, "step": 3, "type": "OSError",
                     "message": "[Errno 28] No space left"}


def test_a_disabled_log_writes_nothing_and_is_no_hook(tmp_path: Path) -> None:
    log = EventLog(False, dump_folder=str(tmp_path), rank=0, device=torch.device("cpu"), layout=LAYOUT, config={})
    assert log.hooks == []
    with log.recording(SimpleNamespace(step=0, preempted=False, stopped_by=None), nonfinite=NonFinite):
        assert log.next_batch(SimpleNamespace(next_batch=lambda: 7)) == 7
    log.checkpoint("checkpoint_begin", 2, tmp_path / "step-2")
    log.close()
    assert not (tmp_path / "events").exists()


# -- the summary ---------------------------------------------------------------------------------------------------

def _start(rank: int, time: float, world: int = 2, config: str = "abc") -> dict:
    return {"event": "run_start", "time": time, "rank": rank, "versions": {"python": "3.11", "torch": "2.x",
            "torchao": None, "trainer": "0.1.0", "git_commit": None}, "layout": {**LAYOUT, "world_size": world},
            "device": "cpu", "config_hash": config, "resumed_step": 0}


def _steps(rank: int, *, data: float, late: float, steps: list[float]) -> list[dict]:
    """Step 1 (warm-up, 5 s) then steps 2.. with these step_s; optimizer 0.125, forward/backward the rest; each batch
    ready at 1000 + step (+ late)."""
    out = []
    for step, step_s in enumerate([5.0, *steps], start=1):
        out.append({"event": "step", "time": 1000.0 + step + late, "rank": rank, "step": step, "data_s": data,
                    "forward_backward_s": step_s - data - 0.125, "optimizer_s": 0.125, "step_s": step_s,
                    "comm_s": None})
    return out


def _write(path: Path, records: list[dict], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


@pytest.fixture
def crafted(tmp_path: Path) -> Path:
    events = tmp_path / "events"
    rank0 = [_start(0, 900.0), *_steps(0, data=0.0625, late=0.0, steps=[0.5, 0.5, 0.75, 0.5, 0.5, 1.0]),
             {"event": "stop", "time": 1010.0, "rank": 0, "step": 7, "reason": "signal", "signal": "SIGTERM"}]
    rank1 = [_start(1, 900.0), *_steps(1, data=0.25, late=0.25, steps=[0.75, 0.75, 1.0, 0.75, 0.75, 1.25]),
             {"event": "checkpoint_begin", "time": 1008.0, "rank": 1, "step": 7, "path": "ck/step-7"},
             {"event": "checkpoint_end", "time": 1008.5, "rank": 1, "step": 7, "path": "ck/step-7", "seconds": 0.5,
              "error": None}]
    _write(events / "rank-00000.jsonl", rank0[:3], tail="not json\n")  # a line that is no record, mid-file
    with open(events / "rank-00000.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rank0[3:]))
    _write(events / "rank-00001.jsonl", rank1, tail='{"event": "step", "time": 10')  # the crash cut the last line
    _write(events / "rank-00002.jsonl", [_start(2, 100.0, world=4, config="old")])  # an earlier, larger run's
    return tmp_path


def test_the_straggler_table_of_two_ranks(crafted: Path) -> None:
    summary = summarize(read_run(crafted), skip_first=1)
    r0, r1 = summary.ranks
    # Steps 2-7: rank 0's sorted [.5 .5 .5 .5 .75 1]: median .5, p90 at position 4.5 = .75 + .5 x .25; rank 1's +.25.
    assert (r0.rank, r0.steps, r0.step) == (0, 6, (0.5, 0.875, 1.0))
    assert (r1.rank, r1.steps, r1.step) == (1, 6, (0.75, 1.125, 1.25))
    assert r0.medians == {"data_s": 0.0625, "forward_backward_s": 0.3125, "optimizer_s": 0.125, "comm_s": None}
    assert r1.medians == {"data_s": 0.25, "forward_backward_s": 0.375, "optimizer_s": 0.125, "comm_s": None}
    assert (r0.behind, r1.behind, r0.late, r1.late) == (0.0, 0.25, 0.0, 0.25)
    assert (summary.fastest, summary.straggler) == (0, 1)
    # .25 - .0625, more than forward/backward's .0625
    assert summary.gap == "against rank 0 it loses most in data wait (median +0.188 s)"
    assert r0.endings == ["launch 1 stopped at step 7 by SIGTERM"]
    assert r1.endings == ["launch 1 has no end record (still running, or killed: SIGKILL, out of memory)"]
    assert r1.checkpoints == "1 saved (max 0.500 s)" and r0.checkpoints == ""
    assert [n.split(": ")[-1] for n in summary.notes] == ["skipped", "skipped", "left out"]
    assert "rank-00000.jsonl line 4 is corrupted (not valid JSON" in summary.notes[0], summary.notes
    assert "rank-00001.jsonl line 11 is cut short" in summary.notes[1]
    assert "rank 2's file is from an earlier run (the latest launch has 2 ranks)" in summary.notes[2]
    text = format_summary(summary)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"])}
    assert rows["0"] == ["0", "6", "0.500", "0.875", "1.000", "0.062", "0.312", "0.125", "n/a", "0.000", "+0.000",
                         "(+0.0%)", "fastest"]
    assert rows["1"] == ["1", "6", "0.750", "1.125", "1.250", "0.250", "0.375", "0.125", "n/a", "0.250", "+0.250",
                         "(+50.0%)", "straggler"]
    assert ("straggler: rank 1, its batch ready a median 0.250 s after the first rank's; against rank 0 it loses most "
            "in data wait (median +0.188 s)") in text
    # Every step: the warm-up step's 5 s is each rank's max.
    every = summarize(read_run(crafted), skip_first=0)
    assert [(s.steps, s.step[2]) for s in every.ranks] == [(7, 5.0), (7, 5.0)]


def test_quantile_is_numpys_linear_interpolation() -> None:
    assert quantile([4.0], 90) == 4.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0], 90) == 10.0
    assert quantile([0.0, 1.0], 90) == pytest.approx(0.9)


def test_the_script_on_bad_input(tmp_path: Path, crafted: Path) -> None:
    def script(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_events.py"), *args],
                              capture_output=True, text=True, cwd=REPO)

    missing = script(str(tmp_path / "nowhere"))
    assert (missing.returncode, missing.stderr) == (2, f"summarize_events.py: no such folder: {tmp_path / 'nowhere'}\n")
    (tmp_path / "empty").mkdir()
    empty = script(str(tmp_path / "empty"))
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1
    assert "no event files (rank-NNNNN.jsonl) in" in empty.stderr and "--metrics.event_log=true" in empty.stderr
    with pytest.raises(EventLogError, match="no such folder"):
        read_run(tmp_path / "nowhere")
    ok = script(str(crafted / "events"))  # the events/ folder itself reads the same
    assert ok.returncode == 0, ok.stderr
    assert "straggler: rank 1" in ok.stdout and "is cut short" in ok.stdout


# -- the profiler window's exposed communication ------------------------------------------------------------------

def _trace_summary(device: str, *, wall_us: float, comm_us: float, exposed_us: float) -> TraceSummary:
    return TraceSummary(device=device, num_steps=3, steps=(3, 5), total_us=0.0, wall_us=wall_us, busy_us=0.0,
                        category_us={}, ops=[], num_gemm_calls=0, fp8_gemm_calls=0, fp8_gemm_names=[],
                        gemm_dtypes={}, comm_us=comm_us, exposed_comm_us=exposed_us)


def test_the_profile_record_is_the_trace_summary_in_seconds_per_step(tmp_path: Path, monkeypatch) -> None:
    cuda = _trace_summary("cuda", wall_us=1_500_000.0, comm_us=750_000.0, exposed_us=375_000.0)
    assert profile_record(cuda, "t/rank1_step3-5.pt.trace.json.gz") == {
        "event": "profile", "step": 5, "steps": [3, 5], "num_steps": 3, "trace": "t/rank1_step3-5.pt.trace.json.gz",
        "device": "cuda", "wall_s": 0.5, "comm_s": 0.25, "exposed_comm_s": 0.125, "reason": None}
    # A CPU trace times aten ops on the host: its comm_us is 0 because nothing timed the collectives, so null.
    cpu = profile_record(_trace_summary("cpu", wall_us=3_000_000.0, comm_us=0.0, exposed_us=0.0), "t")
    assert (cpu["wall_s"], cpu["comm_s"], cpu["exposed_comm_s"], cpu["reason"]) == (1.0, None, None, CPU_TRACE)
    # The log writes it (flushed at once) as maybe_enable_profiling's on_summary; a disabled log gives none.
    log = EventLog(True, dump_folder=str(tmp_path), rank=1, device=torch.device("cpu"), layout=LAYOUT, config={})
    assert EventLog(False, dump_folder=str(tmp_path), rank=1, device=torch.device("cpu"), layout=LAYOUT,
                    config={}).on_profile is None
    _fake_clock(monkeypatch, [], [700.0, 701.0, 702.0])  # run_start, profile, run_end
    with log.recording(SimpleNamespace(step=0, preempted=False, stopped_by=None), nonfinite=NonFinite):
        log.on_profile(cuda, "t/trace")
        assert _lines(events_file(tmp_path, 1))[-1] == {
            "event": "profile", "time": 701.0, "rank": 1, "step": 5, "steps": [3, 5], "num_steps": 3,
            "trace": "t/trace", "device": "cuda", "wall_s": 0.5, "comm_s": 0.25, "exposed_comm_s": 0.125,
            "reason": None}


def test_a_cpu_profiler_window_writes_a_profile_record_on_every_rank(tmp_path: Path) -> None:
    # The trainer's wiring on CPU, rank 1 of 2: maybe_enable_profiling hands its own trace's summary to the log.
    log = EventLog(True, dump_folder=str(tmp_path), rank=1, device=torch.device("cpu"), layout=LAYOUT, config={})
    weight = torch.randn(16, 16, requires_grad=True)
    with log.recording(SimpleNamespace(step=0, preempted=False, stopped_by=None), nonfinite=NonFinite):
        with maybe_enable_profiling(enable=True, start_step=2, end_step=3, trace_dir=str(tmp_path / "traces"), rank=1,
                                    record_shapes=False, with_stack=False, profile_memory=False, expect_fp8=False,
                                    on_summary=log.on_profile) as profiler:
            for step in range(1, 5):
                (torch.randn(8, 16) @ weight).square().sum().backward()
                profiler.step(step)
    log.close()
    [record] = [r for r in _lines(events_file(tmp_path, 1)) if r["event"] == "profile"]
    trace = str(tmp_path / "traces" / f"rank1_step2-3{TRACE_SUFFIX}")
    wall_us = summarize_events(load_trace_events(trace), num_steps=2, steps=(2, 3)).wall_us
    assert record == {"event": "profile", "time": record["time"], "rank": 1, "step": 3, "steps": [2, 3],
                      "num_steps": 2, "trace": trace, "device": "cpu", "wall_s": wall_us / 1e6 / 2, "comm_s": None,
                      "exposed_comm_s": None, "reason": CPU_TRACE}
    assert record["wall_s"] > 0
    assert not (tmp_path / "traces" / "summary_step2-3.txt").exists()  # rank 0's alone


def _profile(rank: int, exposed: float | None, *, steps: tuple[int, int] = (3, 5)) -> dict:
    return {"event": "profile", "time": 1050.0, "rank": rank, "step": steps[1], "steps": list(steps), "num_steps": 3,
            "trace": f"t/rank{rank}.pt.trace.json.gz", "device": "cpu" if exposed is None else "cuda", "wall_s": 0.5,
            "comm_s": None if exposed is None else 2 * exposed, "exposed_comm_s": exposed,
            "reason": CPU_TRACE if exposed is None else None}


def _two_ranks(folder: Path, profiles: dict[int, dict]) -> Path:
    """Two ranks' files of 4 steps each (step records' comm_s null), with these profile records."""
    for rank in (0, 1):
        records = [_start(rank, 900.0), *_steps(rank, data=0.0, late=0.125 * rank, steps=[0.5, 0.5, 0.75]),
                   profiles[rank], {"event": "run_end", "time": 1060.0, "rank": rank, "step": 4}]
        _write(folder / "events" / f"rank-{rank:05d}.jsonl", records)
    return folder


def _comm_column(text: str) -> dict[str, str]:
    return {row[0]: row[8] for line in text.splitlines() if (row := line.split())[:1] in (["0"], ["1"])}


def test_the_comm_column_is_the_profiled_windows_exposed_communication(tmp_path: Path) -> None:
    summary = summarize(read_run(_two_ranks(tmp_path / "a", {0: _profile(0, 0.0625), 1: _profile(1, 0.25)})))
    assert [s.exposed_comm for s in summary.ranks] == [0.0625, 0.25] and summary.most_exposed == 1
    assert [s.medians["comm_s"] for s in summary.ranks] == [None, None]  # the step records' own stay unknown
    text = format_summary(summary)
    assert _comm_column(text) == {"0": "0.062*", "1": "0.250*"}
    assert ("*comm: exposed communication per step (no other kernel running beside it) in the profiler trace of "
            "steps 3-5, not a median of the step records") in text.splitlines()
    assert "most exposed communication: rank 1, 0.250 s/step in steps 3-5's trace, 50.0% of its wall" in text
    # A tie goes to the lower rank; windows that differ are named per rank.
    text = format_summary(summarize(read_run(_two_ranks(tmp_path / "b", {0: _profile(0, 0.25, steps=(6, 8)),
                                                                          1: _profile(1, 0.25)}))))
    assert "most exposed communication: rank 0, 0.250 s/step in steps 6-8's trace" in text
    assert "in the profiler trace of steps 6-8 (rank 0), steps 3-5 (rank 1), not a median" in text
    # CPU traces time no communication: the column stays n/a and says why.
    text = format_summary(summarize(read_run(_two_ranks(tmp_path / "c", {0: _profile(0, None), 1: _profile(1, None)}))))
    assert _comm_column(text) == {"0": "n/a", "1": "n/a"}
    assert "most exposed" not in text and "*comm" not in text
    assert f"the profiler trace of steps 3-5 times no communication: {CPU_TRACE}" in text.splitlines()
