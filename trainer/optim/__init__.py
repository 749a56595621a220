"""AdamW and its learning-rate schedule.

    build.py     build_optimizer (the implementation validation resolved), the startup lines
    adamw.py     AdamW: one optimizer over the local shards, by its state dtypes and rounding; its state and resume
    update.py    the AdamW arithmetic as eager torch (the CPU path, the kernel's reference), the roundings, their bits
    kernel.py    the update as one Triton kernel (a GPU's path; imported only where it runs)
    states.py    the state dtypes, the fp8 first moment's 1x128 blocks, moments converted between dtypes
    schedule.py  the learning-rate schedule, and its checkpoint part
    part.py      the optimizer's checkpoint part: moments a resume stages in the checkpoint's dtypes and converts
"""

from trainer.optim.build import (
    build_optimizer, describe_optimizer_state, describe_param_groups, resolve_implementation,
)
from trainer.optim.part import OptimizerPart
from trainer.optim.schedule import SCHEDULE_KEYS, SchedulerPart, build_lr_scheduler, describe_schedule, lr_lambda

__all__ = ["SCHEDULE_KEYS", "OptimizerPart", "SchedulerPart", "build_lr_scheduler", "build_optimizer",
           "describe_optimizer_state", "describe_param_groups", "describe_schedule", "lr_lambda",
           "resolve_implementation"]
