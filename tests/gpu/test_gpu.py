"""GPU checks (run on an H100/H200: `pytest -m gpu tests/gpu`). CPU CI deselects them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SMALL_1B = ["--config", "configs/train/llama3_1b.toml", "--model.n_layers=2", "--train.seq_len=1024",
            "--train.batch_size=2", "--train.steps=6", "--data.source=default", "--checkpoint.enable=false",
            "--metrics.log_freq=1", "--profiling.enable=true", "--profiling.start_step=3", "--profiling.end_step=5"]


def _profiled_run(tmp_path: Path, precision: str, extra: list[str] = ()) -> tuple[str, str]:
    trace_dir = tmp_path / f"trace_{precision}"
    proc = launch([*SMALL_1B, f"--train.mixed_precision={precision}", f"--profiling.trace_dir={trace_dir}",
                   f"--job.dump_folder={tmp_path / precision}", *extra], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (trace_dir / "summary_step3-5.txt").read_text()
    assert (trace_dir / "rank0_step3-5.pt.trace.json.gz").exists()
    return summary, proc.stdout


def test_fp8_run_shows_fp8_gemm_kernels(tmp_path: Path) -> None:
    summary, stdout = _profiled_run(tmp_path, "fp8", ["--train.compile_model=true"])
    print(summary)
    assert "Applied Float8 training: recipe=TENSORWISE, fsdp_float8_all_gather=True" in stdout
    assert "FP8 GEMMs ran: yes" in summary
    assert "this run trained in bf16" not in stdout


def test_bf16_run_says_no_fp8_and_warns_when_fp8_expected(tmp_path: Path) -> None:
    summary, stdout = _profiled_run(tmp_path, "bf16")
    print(summary)
    assert "FP8 GEMMs ran: no" in summary
    # The same trace checked as if fp8 had been asked for: the script flags it.
    proc = launch_summarize(tmp_path / "trace_bf16")
    assert proc.returncode == 1 and "trained in bf16" in proc.stdout + proc.stderr


def launch_summarize(path: Path):
    import subprocess
    import sys

    from tests.helpers import REPO, env

    return subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_trace.py"), str(path), "--expect-fp8"],
                          capture_output=True, text=True, env=env(), cwd=REPO)


def test_float8_linear_close_to_bf16_on_gpu() -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False)).cuda().bfloat16()
    fp8 = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False)).cuda().bfloat16()
    fp8.load_state_dict(ref.state_dict())
    convert_to_float8_training(fp8, config=Float8LinearConfig())
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y_ref, y = ref(x), fp8(x2)
    y_ref.float().pow(2).mean().backward()
    y.float().pow(2).mean().backward()
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(y, y_ref) < 0.1
    assert rel(x2.grad, x.grad) < 0.15
    assert rel(fp8[0].weight.grad, ref[0].weight.grad) < 0.15
