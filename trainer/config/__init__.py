"""Job configuration: section dataclasses, TOML loading, command-line overrides, reference docs.

A `JobConfig` is built once, from defaults < TOML < command line, and validated
while it is built: every user error (unknown key, wrong type, value outside its
`Literal`, inconsistent combination) raises `ConfigError` with one line that
names the key, before any process group, data or model exists.

    sections.py    the section dataclasses (a docstring under every field) and Sections, whose fields are the sections
    job.py         JobConfig: the sections, checked when built
    model_sections.py  [model] and [moe], generated from the model's dataclasses (trainer.model_values)
    docstrings.py  the docstring under each field: what --help and docs/config.md say of each key
    checks.py      the checks on the config alone, run by JobConfig when built (imports only torch-free leaves)
    phases.py      the syntax of train.precision_schedule (a leaf the checks need; trainer/run/ runs the phases)
    load.py        TOML + command line -> JobConfig, every bad value one line
    reference.py   `train.py --help [SECTION]` and docs/config.md (`python -m trainer.config --markdown`)
"""

from trainer.config.checks import check_config
from trainer.config.docstrings import field_docs
from trainer.config.job import JobConfig
from trainer.config.load import load_job_config, parse_overrides, read_toml
from trainer.config.reference import config_markdown, section_help, usage
from trainer.config.sections import (
    _SECTIONS, SECTION_HELP, CheckpointSection, DataSection, DistributedSection, Float8Section, GptOssSection,
    JobSection, MetricsSection, MixedPrecision, ModelSection, MoESection, OptimizerSection, ProfilingSection,
    SchedulerSection, TrainSection, ValidationSection,
)
from trainer.errors import ConfigError

__all__ = [
    "SECTION_HELP", "CheckpointSection", "ConfigError", "DataSection", "DistributedSection", "Float8Section",
    "GptOssSection", "JobConfig", "JobSection", "MetricsSection", "MixedPrecision", "ModelSection", "MoESection",
    "OptimizerSection", "ProfilingSection", "SchedulerSection", "TrainSection", "ValidationSection", "check_config",
    "config_markdown", "field_docs", "load_job_config", "parse_overrides", "read_toml", "section_help", "usage",
]
