from trainer.parallel.build import ParallelModel, build_parallel_model
from trainer.parallel.float8 import apply_float8
from trainer.parallel.parallel_dims import ParallelDims

__all__ = ["ParallelDims", "ParallelModel", "apply_float8", "build_parallel_model"]
