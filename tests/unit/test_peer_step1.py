"""scripts/peer_step1.py: the peer's cold start read from its log's timestamps."""

from __future__ import annotations

from tests.helpers import REPO, load_script

peer_step1 = load_script("peer_step1")


def test_from_the_first_training_start_to_the_first_step_1_line() -> None:
    lines = [
        "[titan] 2026-11-27 15:02:23,100 - root - INFO - Compiling each TransformerBlock with torch.compile\n",
        "[titan] 2026-11-27 15:02:23,547 - root - INFO - Training starts at step 1\n",
        "[titan] 2026-11-27 15:02:23,800 - root - INFO - Training starts at step 1\n",  # the second rank's
        "[titan] 2026-11-27 15:02:30,000 - root - INFO - \x1b[31mstep: 10  \x1b[32mloss: 9.1\n",  # not step 1
        "[titan] 2026-11-27 15:02:40,917 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.24043\n",
        "[titan] 2026-11-27 15:02:41,000 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.24043\n",
    ]
    assert abs(peer_step1.step1_seconds(lines) - 17.37) < 1e-9


def test_none_without_a_step_1_line() -> None:
    lines = ["[titan] 2026-11-27 15:02:23,547 - root - INFO - Training starts at step 1\n",
             "torch.OutOfMemoryError: CUDA out of memory.\n"]
    assert peer_step1.step1_seconds(lines) is None


def test_a_kept_peer_log() -> None:
    """The 2026-11-27 dp_shard=2 run's logs (docs/benchmark_data): 17.4 s fp8, 9.8 s bf16."""
    logs = REPO / "docs" / "benchmark_data" / "session_2026-11-27" / "defaults"
    for name, seconds in (("peer8b_fp8.log", 17.4), ("peer8b_bf16.log", 9.8)):
        got = peer_step1.step1_seconds((logs / name).read_text(errors="replace").splitlines())
        assert round(got, 1) == seconds


def test_launch_to_step_1_of_either_trainer_from_the_arrival_stamps() -> None:
    """gpu_checks.sh stamps each line with its arrival (epoch): the first step-1 line, ours or torchtitan's, counts;
    a step-1 line that is neither's (a step 10, a loss line) does not."""
    ours = ["@1000.0 [rank0     0.0s] job: Llama 3 8B\n",
            "@1020.5 [rank0    19.0s] step 10 done\n",
            "@1031.25 [rank0    30.2s] step 1 done 21.3 s after training started; 20.3 s compiling\n",
            "@1032.0 [rank1    30.9s] step 1 done 21.9 s after training started\n"]
    assert peer_step1.launch_to_step1(ours, 1000.5) == 30.75
    titan = ["@2000.0 [titan] 2026-11-27 15:02:23,547 - root - INFO - Training starts at step 1\n",
             "@2017.5 [titan] 2026-11-27 15:02:40,917 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.24043\n"]
    assert peer_step1.launch_to_step1(titan, 1990.0) == 27.5
    assert abs(peer_step1.step1_seconds(titan) - 17.37) < 1e-9  # the stamps leave its own clock as it was
    assert peer_step1.launch_to_step1(ours[:2], 1000.0) is None


def test_a_log_with_neither_says_so_in_one_line() -> None:
    """Our trainer's log without --launched (no torchtitan stamps, no arrival stamps asked for): one line that says
    why there is no number, not silence."""
    ours = ["[rank0    30.2s] step 1 done 21.3 s after training started; 20.3 s compiling\n"]
    (line,) = peer_step1.report(ours, None)
    assert line.startswith("no torchtitan line") and "--launched" in line
    assert peer_step1.report(["@1031.25 " + ours[0]], 1000.0) == ["launch to step 1: 31.2 s"]
