"""The run: what scripts/train.py starts once the config is loaded.

    train.py               train(cfg): validate once, then one Trainer(job), or one per phase of the precision
                           schedule; the Trainer builds, loops, evaluates and saves (it reads no config)
    step.py                one optimizer step for every layout: forward/backward, accumulation, grad norm, the skip
    evaluate.py            the held-out loss (a step hook), in every layout
    precision_schedule.py  train.precision_schedule: each phase's job, run one Trainer at a time
    train_state.py         what a stop and a resume need besides the model: the step, how it stopped, exit codes
    lock.py                one run per dump folder: an exclusive lock file, taken before anything is written
    dry_run.py             --dry-run: the validation pass and the per-GPU memory plan, without a GPU

This face imports nothing: the command line reads the exit codes of train_state.py without importing torch.
"""
