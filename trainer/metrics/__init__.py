"""What a run measures and where it goes: the step line, metrics.jsonl, TensorBoard, W&B, profiler traces.

    logger.py         MetricsLogger: throughput, MFU (the bf16 peak table), memory and health on the console line,
                      in metrics.jsonl and TensorBoard; a fresh run sets earlier metrics aside, a resume truncates
    wandb_run.py      the same values to Weights & Biases (optional: metrics.wandb)
    profiling.py      a window of profiled steps and memory snapshots
    trace_summary.py  the kernel summary of a profiler trace (FP8 / bf16 GEMMs, attention, communication) and
                      whether FP8 GEMMs ran; torch-free, as scripts/summarize_trace.py reads it
    events.py         the per-rank event log (metrics.event_log): run start, step times, checkpoints, stops, errors
    event_summary.py  its straggler table across the ranks; torch-free, as scripts/summarize_events.py reads it

Import the modules themselves: this face imports nothing, so the trace summary loads without torch.
"""
