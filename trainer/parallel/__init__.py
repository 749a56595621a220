from trainer.parallel.apply import ACOptions, BuildOptions, BuildResult, FSDPOptions, build_parallel_model
from trainer.parallel.parallel_dims import ParallelDims

__all__ = ["ACOptions", "BuildOptions", "BuildResult", "FSDPOptions", "ParallelDims", "build_parallel_model"]
