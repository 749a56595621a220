"""Checkpoints with torch.distributed.checkpoint (DCP): save, resume, verify, prune, export, load a model.

    format.py    file names, format constants, CheckpointError, checksums
    writer.py    a rank's shards written at disk speed (several threads), with each file's size and crc32
    parts.py     CheckpointState (the one Stateful a resume loads): a dict of parts, each owning its state
    state.py     RunInfo, the tensor/JSON split, the model's plain tensors
    verify.py    scan, checksums, checkpoint.json, model/key checks, reading DCP's index without running code
    options.py   CheckpointOptions: what the manager needs of the config, resolved once by trainer.validate
    manager.py   CheckpointManager: resume (falling back past corrupt checkpoints), save (sync/async), prune, export
    staging.py   async saves' host buffers, allocated (and pinned) in the background after step 1
    space.py     a checkpoint's size, free space (a warning before a save), pruning, a full disk in one line
    offline.py   one process, no process group: load_model, load_full_model_weights, save_model_only
    ema.py       train.ema_decay: the weights' EMA (a step hook, sharded like them) and its checkpoint part

docs/checkpointing.md describes the layout on disk and what survives what.
"""

from trainer.checkpoint.format import (
    CHECKPOINT_JSON, FORMAT, METADATA, STATE_JSON, CheckpointError, CorruptCheckpointError, file_digest, write_json,
)
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.offline import (
    build_model, load_full_model_weights, load_model, resolve_checkpoint, save_model_only,
)
from trainer.checkpoint.options import CheckpointOptions
from trainer.checkpoint.parts import CheckpointState, DelayedScalingPart, ModelPart, RngPart
from trainer.checkpoint.space import prune_checkpoints
from trainer.checkpoint.state import (
    RunInfo, args_from_json, describe_layout, merge_tensors, model_state_dict, run_tokenizer, split_tensors,
)
from trainer.checkpoint.verify import (
    SafeReader, check_file, load_dcp_metadata, read_checkpoint_json, read_dcp_metadata, scan_checkpoints,
)

__all__ = [
    "CHECKPOINT_JSON", "FORMAT", "METADATA", "STATE_JSON", "CheckpointError", "CheckpointManager", "CheckpointOptions", "CheckpointState",
    "CorruptCheckpointError", "DelayedScalingPart", "ModelPart", "RngPart", "RunInfo", "SafeReader", "args_from_json",
    "build_model", "check_file",
    "describe_layout", "file_digest", "load_dcp_metadata", "load_full_model_weights", "load_model", "merge_tensors",
    "model_state_dict", "prune_checkpoints", "read_checkpoint_json", "read_dcp_metadata",
    "resolve_checkpoint", "run_tokenizer", "save_model_only", "scan_checkpoints", "split_tensors", "write_json",
]
