from trainer.parallel.build import (
    ACOptions, BuildOptions, BuildResult, Float8Options, FSDPOptions, build_parallel_model,
)
from trainer.parallel.float8 import apply_float8
from trainer.parallel.parallel_dims import ParallelDims

__all__ = [
    "ACOptions", "BuildOptions", "BuildResult", "FSDPOptions", "Float8Options", "ParallelDims", "apply_float8",
    "build_parallel_model",
]
