"""Issue 51, item 1: nothing a user saved is deleted.

- A save whose `step-N` name is taken by a folder the startup scan calls incomplete (no .metadata, no
  checkpoint.json, a user's own files) moved it to `.replaced` and deleted it; a `step-N.tmp` was removed whoever made
  it. Now the one rule of trainer/files/publish.py: only a folder holding the marker a save writes first is removed;
  anything else is moved aside (`step-N.incomplete`, `step-N.tmp.incomplete`) with one warning line.
- `convert_checkpoint.py import HF OUT` deleted a complete checkpoint sitting in `OUT.tmp`: now moved aside to
  `OUT.tmp.old`; an interrupted import of this trainer's (marked) is still removed.
- `train.steps` beyond int64 trained and saved checkpoints that every relaunch refused: each config key a checkpoint
  saves is held to the rule the resume checks the saved field by (trainer/model_values.py SAVED_FROM_CONFIG).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.faults.test_disk_and_lock import _convert, _manager, _tree, log, one_process, run_folder  # noqa: F401 (fixtures)
from tests.unit.test_hf_moe import _tokenizer_json
from trainer.checkpoint import load_model
from trainer.checkpoint.values import CHECKPOINT_FIELDS, STATE_FIELDS, check_fields
from trainer.config import load_job_config
from trainer.errors import ConfigError, UserError
from trainer.files.publish import PARTIAL, start_partial
from trainer.model_values import SAVED_FROM_CONFIG, SAVED_INTEGERS
from trainer.validate import validate_job


def test_a_save_moves_what_holds_its_name_aside_and_removes_only_its_own_partial_saves(tmp_path, one_process, log):
    ckpt = tmp_path / "checkpoint"
    user = ckpt / "step-1"  # a user's own files under a checkpoint's name: the scan says "no .metadata"
    user.mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    half = ckpt / "step-2"  # a copy that stopped before checkpoint.json
    half.mkdir()
    (half / ".metadata").write_bytes(b"index")
    stray = ckpt / "step-3.tmp"  # named like an unfinished save, but no save made it (no marker)
    stray.mkdir()
    (stray / "notes.txt").write_text("mine too")
    interrupted = ckpt / "step-4.tmp"  # what a save killed midway leaves: marked, so removed
    start_partial(interrupted)
    (interrupted / "__0_0.distcp").write_bytes(b"half a shard")
    manager = _manager(tmp_path)
    for step in (1, 2, 3, 4):
        manager.save(step)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "step-1", "step-1.incomplete", "step-2", "step-2.incomplete", "step-3", "step-3.tmp.incomplete", "step-4"]
    assert (ckpt / "step-1.incomplete" / "notes.txt").read_text() == "mine"
    assert (ckpt / "step-2.incomplete" / ".metadata").read_bytes() == b"index"
    assert (ckpt / "step-3.tmp.incomplete" / "notes.txt").read_text() == "mine too"
    assert not any((ckpt / f"step-{s}" / PARTIAL).exists() for s in (1, 2, 3, 4))  # published: no marker left
    warnings = [line for line in log.lines if line.startswith("moved ")]
    assert warnings == [
        f"moved {user} aside to step-1.incomplete (no .metadata): this run's save of step 1 takes its name (kept, "
        "never resumed; delete it when done)",
        f"moved {half} aside to step-2.incomplete (no checkpoint.json): this run's save of step 2 takes its name "
        "(kept, never resumed; delete it when done)",
        f"moved {stray} aside to step-3.tmp.incomplete: named like an unfinished save, but without the .partial "
        "marker every save writes first (kept; delete it when done)",
    ]


def test_import_never_deletes_a_complete_checkpoint_in_its_tmp_folder(run_folder, tmp_path, capsys):  # noqa: F811
    convert = _convert()
    hf = tmp_path / "hf"
    tokenizer = _tokenizer_json(tmp_path / "tok.json")  # copied into the export, then into each import
    assert convert.main(["export", str(run_folder / "checkpoint" / "step-2"), str(hf), f"--tokenizer={tokenizer}"]) == 0
    out = tmp_path / "init"
    complete = tmp_path / "init.tmp"  # a complete checkpoint someone put (or an import renamed by hand) there
    shutil.copytree(run_folder / "checkpoint" / "step-4", complete)
    before = _tree(complete)
    capsys.readouterr()
    assert convert.main(["import", str(hf), str(out), "--flavor=debug"]) == 0
    kept = tmp_path / "init.tmp.old"
    assert _tree(kept) == before and load_model(kept).args.n_layers == load_model(out).args.n_layers
    said = capsys.readouterr().out  # the CLI logs to stdout
    assert (f"WARNING: moved {complete} aside to {kept}: it holds files of an imported model-only checkpoint but not "
            "the .partial marker of an interrupted import, so it may be a complete one (kept; delete it when done)"
            in said), said
    # An interrupted import of this trainer's is its own partial output: removed, nothing moved aside.
    again = tmp_path / "again"
    start_partial(tmp_path / "again.tmp")
    (tmp_path / "again.tmp" / "__0_0.distcp").write_bytes(b"half a shard")
    assert convert.main(["import", str(hf), str(again), "--flavor=debug"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("again")) == ["again"]
    # A second import over the first (which holds the export's tokenizer.json: it was refused) moves it aside.
    assert (again / "tokenizer.json").is_file()
    assert convert.main(["import", str(hf), str(again), "--flavor=debug"]) == 0
    assert load_model(tmp_path / "again.old").args.n_layers == load_model(again).args.n_layers


def _nested(dotted: str, value: int) -> dict:
    """{"a": {"b": value}} for "a.b" ("layout.*": one degree of the layout)."""
    tree: dict = {}
    node = tree
    *parents, last = dotted.replace("*", "tp").split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return tree


def test_every_key_a_checkpoint_saves_is_held_to_the_rule_a_resume_checks(tmp_path):
    """One table: at its bound a key loads and its saved field passes the resume's check; one past it, the config is
    refused in one line naming the key and the field (it used to train, and every relaunch refused the checkpoint)."""
    assert set(SAVED_FROM_CONFIG) >= {"train.steps", "scheduler.warmup_steps", "train.seq_len", "distributed.tp"}
    for key, fields in SAVED_FROM_CONFIG.items():
        for field in fields:
            rule = SAVED_INTEGERS[field]
            tables = CHECKPOINT_FIELDS if field.startswith("layout.") else STATE_FIELDS
            assert tables.get(field) is rule, field  # the resume's table is this one, not a copy
            high = int(rule.high)
            check_fields(_nested(field, high), tables, file=tmp_path / "state.json")
            with pytest.raises(UserError, match=r"must be an integer in \["):
                check_fields(_nested(field, high + 1), tables, file=tmp_path / "state.json")
        high = min(int(SAVED_INTEGERS[f].high) for f in fields)
        load_job_config([f"--{key}={high}"])
        saved_as = fields[0].replace("*", key.rpartition(".")[2])
        with pytest.raises(ConfigError) as e:
            load_job_config([f"--{key}={high + 1}"])
        assert str(e.value) == (f"{key}={high + 1} must be an integer in [{SAVED_INTEGERS[fields[0]].low:g}, {high}]: "
                                f"a checkpoint saves it as {saved_as}, which every resume holds to that range")
    # The samples read (train.steps x the global batch) are the checkpoint's dataloader.consumed_samples.
    with pytest.raises(ConfigError, match=r"train.steps=2305843009213693952 x a global batch of 8 samples reads "
                                          r"18,446,744,073,709,551,616 samples, more than the 9,223,372,036,854,775,807"):
        validate_job(load_job_config(["--train.steps=2305843009213693952", "--train.batch_size=8"]), world_size=1)
