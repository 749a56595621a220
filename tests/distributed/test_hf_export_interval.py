"""checkpoint.export_interval on 2 spawned gloo ranks: the weights are gathered whole (FSDP2's shards; under pp=2 the
other stage's tensors) to rank 0, whose background write gives the tensors, byte for byte, that
`convert_checkpoint.py export` writes from the checkpoint of the same step; with async checkpoints of the same steps
writing beside it (the checkpoint's own gloo group is busy while the export gathers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.spawn import run_distributed
from tests.helpers import FAST, load_script

pytestmark = pytest.mark.slow

ARGS = [*FAST, "--train.seq_len=32", "--train.steps=4", "--checkpoint.enable=true", "--checkpoint.interval=2",
        "--checkpoint.async_mode=async", "--checkpoint.export_interval=2", "--checkpoint.export_keep_latest_k=1"]


def _train(args: list[str], dump: str) -> list[str]:
    """One training run in this rank's process; the lines it printed."""
    import contextlib
    import io
    import os

    from trainer.config import load_job_config
    from trainer.log import setup_logging
    from trainer.run.train import train

    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        setup_logging(int(os.environ["RANK"]))
        train(load_job_config([*args, f"--job.dump_folder={dump}"]))
    return out.getvalue().splitlines()


def _convert(checkpoint: Path, out: Path) -> None:
    assert load_script("convert_checkpoint").main(["export", str(checkpoint), str(out)]) == 0


@pytest.mark.parametrize("layout", [["--distributed.dp_shard=2", "--train.batch_size=2"],
                                    ["--distributed.pp=2", "--train.batch_size=4"]], ids=["fsdp", "pp"])
def test_export_of_two_ranks_equals_the_checkpoints_conversion(tmp_path: Path, layout: list[str]) -> None:
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    logs = run_distributed(_train, world_size=2, args=([*ARGS, *layout], str(tmp_path / "run")), timeout=180)
    folder = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4", "step-4-hf"]  # step-2-hf pruned
    assert any("export step-4-hf: blocked training" in line for line in logs[0])
    assert not any("export step-" in line for line in logs[1])  # rank 0 writes, and alone says so
    _convert(folder / "step-4", tmp_path / "converted")
    ours, theirs = folder / "step-4-hf", tmp_path / "converted"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    exported, converted = load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors"))
    assert exported.keys() == converted.keys() and len(exported) == 39  # the debug model's 4 blocks, all of them
    for name, t in converted.items():
        assert exported[name].dtype == t.dtype == torch.bfloat16 and torch.equal(exported[name], t), name
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
