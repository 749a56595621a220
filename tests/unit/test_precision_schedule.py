"""train.precision_schedule: the phases, the config of each (the manual relaunch), a bad schedule as one config error
naming the key, and in one process the previous phase freed before the next is built. The whole runs (one
scheduled run equals the manual three-launch sequence, a relaunch resumes the right phase):
tests/cli/test_precision_schedule.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, read_metrics
from trainer.config import load_job_config
from trainer.config.phases import Phase, decay_onset, parse_precision_schedule, phase_index, resolved_entries, schedule_phases
from trainer.errors import ConfigError
from trainer.run.precision_schedule import phase_config

SCHEDULE = "--train.precision_schedule=bf16:4,fp8:8,bf16"
# Tiny and deterministic. wsd with the last 20% as decay: the decay starts after step 8, so the manual
# sequence (constant, constant, then wsd over the whole run) has the same learning rate at every step.
BASE = [
    "--config", DEBUG_CONFIG, "--train.seq_len=32", "--train.batch_size=2", "--train.steps=10",
    "--train.deterministic=true", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
    "--checkpoint.enable=true", "--checkpoint.interval=100", "--scheduler.warmup_steps=2",
    "--scheduler.wsd_decay_ratio=0.2",
]
SCHEDULED = [*BASE, SCHEDULE, "--scheduler.decay_type=wsd"]


# -- parsing and validation -----------------------------------------------------------------------


def test_phases_cover_the_run() -> None:
    phases = parse_precision_schedule(["bf16:2000", "fp8:9_500", "bf16"], total_steps=10_000)
    assert phases == [Phase("bf16", 1, 2000), Phase("fp8", 2001, 9500), Phase("bf16", 9501, 10000)]
    # The phase that trains the step after a (resumed) step: a boundary checkpoint starts the next phase.
    assert [phase_index(phases, s) for s in (0, 1999, 2000, 2001, 9499, 9500, 9999, 10000)] == [0, 0, 1, 1, 1, 2, 2, 2]


def test_phase_config_is_the_manual_relaunch() -> None:
    cfg = load_job_config([*SCHEDULED, "--train.mixed_precision=fp32", "--checkpoint.load_step=2",
                           "--profiling.enable=true", "--profiling.start_step=5", "--profiling.end_step=6"])
    phases = parse_precision_schedule(cfg.train.precision_schedule, total_steps=10)
    first, second = phase_config(cfg, phases, 0, load_step=-1), phase_config(cfg, phases, 1, load_step=4)
    assert (first.train.mixed_precision, second.train.mixed_precision) == ("bf16", "fp8")
    assert first.train.steps == second.train.steps == 10  # the LR schedule spans the whole run
    assert (first.checkpoint.load_step, second.checkpoint.load_step) == (2, 4)  # the user's pin, then the boundary
    assert (first.profiling.enable, second.profiling.enable) == (False, True)  # the window's phase only
    assert not first.train.precision_schedule and cfg.train.precision_schedule == ["bf16:4", "fp8:8", "bf16"]


@pytest.mark.parametrize("args, message", [
    (["--train.precision_schedule=bf16:4,fp9:8,bf16"],
     "train.precision_schedule[1]='fp9:8': 'fp9' is not one of 'fp32', 'fp16', 'bf16', 'fp8'"),
    (["--train.precision_schedule=bf16:4,fp8:4,bf16"],
     "train.precision_schedule[1]='fp8:4': steps must increase; step 4 must be after the previous entry's step 4"),
    (["--train.precision_schedule=bf16:6,fp8:3,bf16"], "train.precision_schedule[1]='fp8:3': steps must increase"),
    (["--train.precision_schedule=bf16:4,fp8:10,bf16"],
     "train.precision_schedule[1]='fp8:10': step 10 must be < train.steps=10"),
    (["--train.precision_schedule=bf16:0,fp8"], "train.precision_schedule[0]='bf16:0': steps must increase; "
                                                "step 0 must be >= 1"),
    (["--train.precision_schedule=bf16,fp8"], "train.precision_schedule[0]='bf16': every entry but the last needs"),
    (["--train.precision_schedule=bf16:4,fp8:10"], "train.precision_schedule[1]='fp8:10': the last entry has no step"),
    (["--train.precision_schedule=bf16:x,fp8"], "train.precision_schedule[0]='bf16:x': the step 'x' must be an"),
    (["--train.precision_schedule=bf16:4,bf16:8,fp8"], "train.precision_schedule[1]='bf16:8': the same precision"),
    (["--train.precision_schedule=fp8"], "train.precision_schedule=['fp8'] has a single phase: set "
                                         "train.mixed_precision='fp8' instead"),
    (["--train.precision_schedule=bf16:4,fp8", "--distributed.tp=2"],
     "train.precision_schedule has an fp8 phase (fp8 steps 5-10) but distributed.tp=2"),
    (["--train.precision_schedule=bf16:4,fp8", "--checkpoint.enable=false"],
     "train.precision_schedule needs checkpoint.enable=true"),
    (["--train.precision_schedule=bf16:4,fp8", "--profiling.enable=true", "--profiling.start_step=3",
      "--profiling.end_step=5"], "the window crosses the train.precision_schedule switch bf16 -> fp8 after step 4"),
])
def test_bad_schedule_is_one_line_naming_the_key(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_job_config([*BASE, *args])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_schedule_overrides_mixed_precision() -> None:
    # fp8 + tp is rejected for train.mixed_precision only when no schedule replaces it.
    cfg = load_job_config([*BASE, "--train.precision_schedule=bf16:4,fp32", "--train.mixed_precision=fp8",
                           "--distributed.tp=2"])
    assert cfg.train.precision_schedule == ["bf16:4", "fp32"]


# -- runs ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_previous_phase_is_freed_before_the_next_is_built(tmp_path: Path) -> None:
    """In one process: the old model and optimizer are garbage before the new phase allocates its own (on a GPU,
    two copies of an 8B model and its optimizer would not fit), and one process group serves every phase."""
    import gc
    import weakref

    import torch.distributed as dist

    import trainer.run.train as train_module
    from trainer.distributed import destroy_distributed
    from trainer.run.precision_schedule import PrecisionSchedule
    from trainer.run.train import Trainer, run_schedule

    cfg = load_job_config([*BASE, "--train.steps=3", "--train.precision_schedule=bf16:1,fp32:2,bf16",
                           "--scheduler.decay_type=wsd", f"--job.dump_folder={tmp_path}"])
    earlier: list[weakref.ref] = []
    alive_at_build: list[int] = []
    groups: list[object] = []

    class Recording(Trainer):
        def __init__(self, *args, **kwargs):
            alive_at_build.append(sum(ref() is not None for ref in earlier))
            super().__init__(*args, **kwargs)
            earlier.extend([weakref.ref(self.model), weakref.ref(self.optimizer)])
            groups.append(dist.group.WORLD)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(train_module, "Trainer", Recording)  # run_schedule builds each phase's Trainer
            state = run_schedule(PrecisionSchedule(cfg, world_size=1))
    finally:
        destroy_distributed()
    gc.collect()
    assert state.step == 3 and state.mixed_precision == "bf16"
    assert alive_at_build == [0, 0, 0]
    assert len(groups) == 3 and all(g is groups[0] for g in groups)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


# -- "decay" and the fp8 roles ---------------------------------------------------------------------


@pytest.mark.parametrize("decay_type, warmup, ratio", [("wsd", 2, 0.2), ("wsd", 3, 0.5), ("cosine", 3, 0.2),
                                                       ("linear", 1, 0.2), ("wsd", 0, 0.3)])
def test_decay_onset_is_where_the_learning_rate_schedule_decays(decay_type: str, warmup: int, ratio: float) -> None:
    """The onset is the last step at the peak learning rate before the decay, as lr_lambda computes it (log step s
    runs lr_lambda(s - 1)) and as the startup's schedule line words it."""
    from trainer.optim.schedule import describe_schedule, lr_lambda

    total = 20
    schedule = dict(warmup_steps=warmup, total_steps=total, decay_type=decay_type, min_lr_ratio=0.1,
                    wsd_decay_ratio=ratio)
    onset = decay_onset(warmup_steps=warmup, decay_type=decay_type, wsd_decay_ratio=ratio, total_steps=total).step
    assert all(lr_lambda(s - 1, **schedule) == 1.0 for s in range(max(warmup, 1), onset + 2))
    assert all(lr_lambda(s - 1, **schedule) < 1.0 for s in range(onset + 2, total + 1))
    assert f"over steps {onset + 1}-{total}" in describe_schedule(1.0, **schedule)


def test_decay_and_roles_in_the_schedule() -> None:
    cfg = load_job_config([*SCHEDULED, "--train.precision_schedule=fp8-bwd:4,fp8:decay,bf16"])
    phases = schedule_phases(cfg)
    assert phases == [Phase("fp8-bwd", 1, 4), Phase("fp8", 5, 8, at_decay=True), Phase("bf16", 9, 10)]
    assert str(phases[1]) == "fp8 steps 5-8 (to the learning rate's decay onset)"
    assert resolved_entries(phases) == ["fp8-bwd:4", "fp8:8", "bf16"]
    first, second = phase_config(cfg, phases, 0, load_step=-1), phase_config(cfg, phases, 1, load_step=4)
    assert (first.train.mixed_precision, first.float8.forward, first.float8.backward) == ("fp8", "bf16", "fp8")
    assert (second.train.mixed_precision, second.float8.forward, second.float8.backward) == ("fp8", "fp8", "fp8")
    fwd = load_job_config([*SCHEDULED, "--train.precision_schedule=fp8-fwd:decay,bf16", "--scheduler.decay_type=cosine"])
    assert schedule_phases(fwd) == [Phase("fp8-fwd", 1, 2, at_decay=True), Phase("bf16", 3, 10)]
    assert phase_config(fwd, schedule_phases(fwd), 0, load_step=-1).float8.backward == "bf16"


@pytest.mark.parametrize("args, message", [
    (["--train.precision_schedule=fp8:decay,bf16", "--scheduler.decay_type=constant"],
     "train.precision_schedule[0]='fp8:decay': 'decay' names the learning rate's decay onset, but "
     "scheduler.decay_type='constant' never decays; write a step"),
    (["--train.precision_schedule=fp8:decay,bf16", "--scheduler.warmup_steps=10"],
     "but the run ends inside the warm-up (scheduler.warmup_steps=10 >= train.steps=10)"),
    (["--train.precision_schedule=fp8:decay,bf16", "--scheduler.warmup_steps=0", "--scheduler.decay_type=cosine"],
     "train.precision_schedule[0]='fp8:decay': the learning rate decays from step 1"),
    (["--train.precision_schedule=bf16:9,fp8:decay,bf16"],
     "train.precision_schedule[1]='fp8:decay': steps must increase; step 8 must be after the previous entry's step 9"),
    (["--train.precision_schedule=fp8-bwd:4,fp8-bwd:8,bf16"], "the same precision as the entry before it"),
])
def test_bad_decay_or_roles_schedule_is_one_line(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_job_config([*SCHEDULED, *args])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_roles_and_decay_switch_in_one_process(tmp_path: Path) -> None:
    """fp8-bwd (bf16 forward GEMMs, FP8 backward), then fp8 to the decay onset, then bf16, in one process: each
    phase's Linears run the roles it names, every step is logged once, and resolved.toml has the steps resolved."""
    from torchao.float8 import ScalingType
    from torchao.float8.float8_linear import Float8Linear

    import trainer.run.train as train_module
    from trainer.distributed import destroy_distributed
    from trainer.run.precision_schedule import PrecisionSchedule
    from trainer.run.train import Trainer, run_schedule

    cfg = load_job_config([*SCHEDULED, "--train.precision_schedule=fp8-bwd:4,fp8:decay,bf16", "--float8.emulate=true",
                           f"--job.dump_folder={tmp_path}"])
    roles: list[tuple] = []

    class Recording(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            configs = {m.config for m in self.model.modules() if isinstance(m, Float8Linear)}
            roles.append(tuple((c.cast_config_input.scaling_type is ScalingType.DISABLED,
                                c.cast_config_grad_output.scaling_type is ScalingType.DISABLED) for c in configs))

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(train_module, "Trainer", Recording)
            state = run_schedule(PrecisionSchedule(cfg, world_size=1))
    finally:
        destroy_distributed()
    assert state.step == 10 and state.mixed_precision == "bf16"
    assert roles == [((True, False),), ((False, False),), ()]  # bf16 forward + fp8 backward; all fp8; bf16
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 11))
    assert 'precision_schedule = ["fp8-bwd:4", "fp8:8", "bf16"]' in (tmp_path / "resolved.toml").read_text()
