"""trainer/hooks.py: the base hook does nothing, and the training loop calls the protocol in the order the module
documents (step_context around the step, after_optimizer_step, log_due, on_log at log steps only)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers import DEBUG_CONFIG
from trainer.config import load_job_config
from trainer.distributed import destroy_distributed
from trainer.hooks import StepHook
from trainer.run.train import build_trainer


def test_the_base_hook_does_nothing() -> None:
    hook = StepHook()
    with hook.step_context(1):
        pass
    hook.after_optimizer_step(1, torch.tensor(True))
    assert hook.log_due(1) is False and hook.on_log(1) == {}


class Recording(StepHook):
    """Appends (name, call, step) to a shared list; asks for a log line at `log_at`."""

    def __init__(self, name: str, events: list, *, log_at: int = 0):
        self.name, self.events, self.log_at = name, events, log_at

    def step_context(self, step):
        events, name = self.events, self.name

        class Context:
            def __enter__(self):
                events.append((name, "enter", step))

            def __exit__(self, *exc):
                events.append((name, "exit", step))

        return Context()

    def after_optimizer_step(self, step, found_inf):
        assert isinstance(found_inf, torch.Tensor) and found_inf.dtype == torch.bool  # never a host bool
        self.events.append((self.name, "after", step, bool(found_inf)))

    def log_due(self, step):
        self.events.append((self.name, "log_due", step))
        return step == self.log_at

    def on_log(self, step):
        self.events.append((self.name, "on_log", step))
        return {f"{self.name}/step": float(step)}


def test_the_loop_calls_the_protocol_in_order(tmp_path: Path) -> None:
    cfg = load_job_config(["--config", DEBUG_CONFIG, "--model.n_layers=1", "--train.steps=4", "--train.seq_len=16",
                           "--train.batch_size=2", "--metrics.log_freq=4", "--metrics.enable_tensorboard=false",
                           "--train.mixed_precision=fp32", "--data.source=synthetic", f"--job.dump_folder={tmp_path}"])
    trainer = build_trainer(cfg)
    events: list[tuple] = []
    try:
        trainer.hooks[:] = [Recording("a", events, log_at=3), Recording("b", events)]
        forward_backward = trainer.step_fn.forward_backward

        def step(microbatches):  # the step itself: what the contexts must enclose
            events.append(("step", trainer.state.step + 1))
            return forward_backward(microbatches)

        trainer.step_fn.forward_backward = step
        trainer.run()
    finally:
        trainer.close()
        destroy_distributed()

    def one_step(n: int, logged: bool) -> list[tuple]:
        # Contexts nest (entered in hook order, left in reverse); the hooks see each step after the optimizer.
        calls = [("a", "enter", n), ("b", "enter", n), ("step", n), ("b", "exit", n), ("a", "exit", n),
                 ("a", "after", n, False), ("b", "after", n, False)]
        # log_due is asked only when the loop's own rule does not log the step already (any() stops early).
        if n not in (1, 4):
            calls += [("a", "log_due", n)] + ([] if n == 3 else [("b", "log_due", n)])
        return calls + ([("a", "on_log", n), ("b", "on_log", n)] if logged else [])

    # Logged: the first step, log_freq's step 4 (also the last), and step 3, which hook "a" asked for.
    assert events == [call for n in range(1, 5) for call in one_step(n, logged=n != 2)]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["a/step"], r["b/step"]) for r in rows] == [(1, 1.0, 1.0), (3, 3.0, 3.0), (4, 4.0, 4.0)]
