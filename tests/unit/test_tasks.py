"""[[validation.tasks]] (trainer/data/tasks.py, trainer/run/tasks.py): the scorer against a plain float64 loop over
each choice's tokens, the rows (lm-evaluation-harness's whitespace rule, left truncation), and every error naming
its key. Whole runs: tests/cli/test_tasks.py; layouts: tests/distributed/test_tasks.py."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.helpers import DEBUG_CONFIG
from trainer.config import load_job_config
from trainer.data import DataError
from trainer.data.tasks import encode_choice, read_task
from trainer.data.tokenizer import ByteTokenizer
from trainer.errors import ConfigError
from trainer.loss import build_loss_fn
from trainer.models import Llama, ModelArgs
from trainer.run.tasks import TaskScorer, accuracies
from trainer.validate import validate_job

SEQ_LEN = 16
ITEMS = [  # contexts without trailing whitespace: the plain loop below concatenates as is
    {"context": "The cat sat on the", "choices": [" mat", " hat and coat", " x"], "answer": 0},
    {"context": "ab", "choices": ["c", "cdefgh", "zz"], "answer": 1},
    {"context": "1 2 3 4 5 6 7 8 9 10 11 12 13", "choices": [" 14", " fourteen", " 15 16"], "answer": 2},
    {"context": "def f(x):\n    return", "choices": [" x", " None"], "answer": 0},
    {"context": "é", "choices": ["è", "ê!"], "answer": 1},  # 2-byte characters: characters, not bytes, normalise
]


def write_task(path: Path, items: list) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    return path


def tiny_model() -> Llama:
    torch.manual_seed(0)
    model = Llama(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, multiple_of=32))
    model.init_weights(seed=3)
    return model


def reference_log_likelihoods(model: Llama, items: list, seq_len: int) -> list[list[float]]:
    """Each choice's log-likelihood by a plain loop over its tokens, in float64 (a float64 copy of the model): the
    bytes of context + choice, the last seq_len + 1 of them (the context cut on the left), each choice byte's
    log-probability given all before it."""
    model = copy.deepcopy(model).double()
    out = []
    with torch.no_grad():
        for item in items:
            lls = []
            for choice in item["choices"]:
                tokens = list((item["context"] + choice).encode())[-(seq_len + 1):]
                start = len(tokens) - len(choice.encode())  # the first choice byte
                logp = torch.log_softmax(model.logits(torch.tensor([tokens[:-1]])).double()[0], dim=-1)
                lls.append(sum(float(logp[t - 1, tokens[t]]) for t in range(start, len(tokens))))
            out.append(lls)
    return out


def scorer(tasks, model: Llama, *, batch_size: int) -> TaskScorer:
    loss_fn = build_loss_fn(model, chunk_tokens=0, compile=False)
    evaluator = SimpleNamespace(model=model, batch_size=batch_size, dp_degree=1, dp_rank=0, freq=1, device="cpu",
                                dp_group=None, loss_context=contextlib.nullcontext, bf16_matmuls=None,
                                log_due=lambda step: True)
    return TaskScorer(tasks, evaluator=evaluator, row_losses=lambda inputs, labels: loss_fn.row_sums(model(inputs),
                                                                                                    labels))


def test_scorer_equals_a_float64_loop_over_each_choices_tokens(tmp_path: Path) -> None:
    model = tiny_model()
    task = read_task(str(write_task(tmp_path / "t.jsonl", ITEMS)), name="t", key="validation.tasks[0].path",
                     tokenizer=ByteTokenizer(), seq_len=SEQ_LEN, vocab_size=258)
    lengths = [len((item["context"] + c).encode()) for item in ITEMS for c in item["choices"]]
    assert task.truncated == sum(n > SEQ_LEN + 1 for n in lengths) == 8  # items 0, 2 and 3 lose context on the left
    hook = scorer((task,), model, batch_size=4)  # 13 rows: 4 batches, the last one 3 rows of padding
    got = -hook.score(model)
    want = reference_log_likelihoods(model, ITEMS, SEQ_LEN)
    np.testing.assert_allclose(got, np.concatenate(want), rtol=1e-5, atol=1e-4)
    picks = [int(np.argmax(lls)) for lls in want]
    norm_picks = [int(np.argmax(np.array(lls) / [len(c) for c in item["choices"]])) for lls, item in zip(want, ITEMS)]
    assert picks != norm_picks  # the normalisation changes some answer: both are tested
    answers = [item["answer"] for item in ITEMS]
    expected = {"acc": np.mean(np.equal(picks, answers)), "acc_norm": np.mean(np.equal(norm_picks, answers))}
    assert accuracies(got, task) == pytest.approx(expected, abs=0)
    assert hook.on_log(1) == {"val/acc_norm/t": expected["acc_norm"], "val/acc/t": expected["acc"]}


def test_two_tasks_share_the_batches_and_each_gets_its_own_rows(tmp_path: Path) -> None:
    model = tiny_model()
    tasks = tuple(read_task(str(write_task(tmp_path / f"{name}.jsonl", items)), name=name, key="k",
                            tokenizer=ByteTokenizer(), seq_len=SEQ_LEN, vocab_size=258)
                  for name, items in (("a", ITEMS[:2]), ("b", ITEMS[2:])))
    alone = -scorer((read_task(str(tmp_path / "b.jsonl"), name="b", key="k", tokenizer=ByteTokenizer(),
                               seq_len=SEQ_LEN, vocab_size=258),), model, batch_size=3).score(model)
    together = -scorer(tasks, model, batch_size=3).score(model)
    np.testing.assert_allclose(together[len(tasks[0].item):], alone, rtol=1e-6)
    metrics = scorer(tasks, model, batch_size=3).on_log(1)
    assert metrics["val/acc/b"] == accuracies(alone, tasks[1])["acc"]


def test_rows_follow_lm_eval_harness() -> None:
    """The context's trailing whitespace moves to the choice; the choice's tokens are the whole text's after the
    context's; labels hold them where they are predicted."""
    tok = ByteTokenizer()
    assert encode_choice(tok, "Q: 2+2= ", "4") == (list(b"Q: 2+2= 4"), 2)  # " 4": the space is scored
    assert encode_choice(tok, "ab", "cd") == (list(b"abcd"), 2)


def test_row_layout_and_left_truncation(tmp_path: Path) -> None:
    items = [{"context": "0123456789", "choices": ["ab", "c"], "answer": 0}]
    task = read_task(str(write_task(tmp_path / "t.jsonl", items)), name="t", key="k", tokenizer=ByteTokenizer(),
                     seq_len=8, vocab_size=258)
    whole = list(b"0123456789ab")[-9:]  # 12 bytes, the last 9 kept: 3 lost on the left
    assert task.inputs[0].tolist() == whole[:-1]
    assert task.labels[0].tolist() == [-100] * 6 + list(b"ab")
    assert task.inputs[1].tolist() == list(b"23456789") and task.labels[1].tolist() == [-100] * 7 + list(b"c")
    assert task.truncated == 2 and task.item.tolist() == [0, 0] and task.chars.tolist() == [2, 1]
    short = read_task(str(write_task(tmp_path / "s.jsonl", [{"context": "x", "choices": ["y"], "answer": 0}])),
                      name="s", key="k", tokenizer=ByteTokenizer(), seq_len=8, vocab_size=258)
    assert short.inputs[0].tolist() == [ord("x")] + [0] * 7  # padded on the right, its labels masked
    assert short.labels[0].tolist() == [ord("y")] + [-100] * 7 and short.truncated == 0


BAD_LINES = [
    ('{"context": "a", "choices": ["b"], "answer": 1}', r"line 2: \"answer\"=1 must be the index of one of its 1 "
                                                        r"choices \(0 to 0\)"),
    ('{"context": "a", "choices": [], "answer": 0}', r"line 2: \"choices\" must be a non-empty list of strings"),
    ('{"context": "a", "choices": ["b", ""], "answer": 0}', r"line 2: choice 1 must be a non-empty string"),
    ('{"context": "", "choices": ["b"], "answer": 0}', r"line 2: \"context\" must be a non-empty string"),
    ('{"context": "a", "choices": ["b"], "answer": true}', r"line 2: \"answer\"=True must be the index"),
    ('{"context": "a", "choices": ["b"]', r"line 2 is corrupted \(not valid JSON"),
    ('["a"]', r"line 2 is not a task item \(a JSON list\)"),
    ('{"context": "a", "choices": ["' + "b" * 20 + '"], "answer": 0}', r"line 2: choice 0 is 20 tokens, which must be "
                                                                       r"1 to train.seq_len=16"),
]


@pytest.mark.parametrize("line,message", BAD_LINES)
def test_a_bad_line_is_one_error_naming_the_key_and_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ITEMS[0]) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"^validation.tasks\[1\].path: .*" + message):
        read_task(str(path), name="t", key="validation.tasks[1].path", tokenizer=ByteTokenizer(), seq_len=16,
                  vocab_size=258)


def test_token_ids_outside_the_vocabulary_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"^validation.tasks\[0\].path: .* line 1: token id 116 is outside the model's "
                                        r"vocabulary of 100"):
        read_task(str(write_task(tmp_path / "t.jsonl", ITEMS)), name="t", key="validation.tasks[0].path",
                  tokenizer=ByteTokenizer(), seq_len=16, vocab_size=100)


TASKS = ["--validation.enable=true"]


@pytest.mark.parametrize("override,message", [
    (["--validation.tasks=a=x.jsonl,a=y.jsonl"], r"validation.tasks\[1\].name='a' is validation.tasks\[0\]'s too"),
    (["--validation.tasks=a b=x.jsonl"], r"validation.tasks\[0\].name='a b' must be letters, digits"),
    (["--validation.tasks==x.jsonl"], r"validation.tasks\[0\].name='' must be letters"),
    (["--validation.tasks=a="], r"validation.tasks\[0\].path is empty"),
])
def test_bad_task_entries_are_one_line_naming_the_key(override: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_job_config(["--config", DEBUG_CONFIG, *TASKS, *override])


def test_tasks_need_validation_enable() -> None:
    with pytest.raises(ConfigError, match=r"validation.tasks are scored with the held-out loss: set "
                                          r"validation.enable=true"):
        load_job_config(["--config", DEBUG_CONFIG, "--validation.tasks=a=x.jsonl"])


def test_the_validation_pass_reads_each_file_and_names_its_key(tmp_path: Path) -> None:
    good = write_task(tmp_path / "good.jsonl", ITEMS)
    missing = tmp_path / "missing.jsonl"
    toml = tmp_path / "job.toml"
    toml.write_text(f'[model]\nflavor = "debug"\n[train]\nseq_len = 64\nmixed_precision = "fp32"\n'
                    f'[validation]\nenable = true\n[[validation.tasks]]\nname = "good"\npath = "{good}"\n'
                    f'[[validation.tasks]]\nname = "gone"\npath = "{missing}"\n')
    cfg = load_job_config([], toml_path=str(toml))
    with pytest.raises(DataError, match=rf"^validation.tasks\[1\].path='{missing}' is not a file"):
        validate_job(cfg, world_size=1)
    cfg = load_job_config(["--config", DEBUG_CONFIG, "--train.seq_len=64", "--validation.enable=true",
                           f"--validation.tasks=good={good}"])
    (task,) = validate_job(cfg, world_size=1).tasks
    assert task.name == "good" and task.num_items == len(ITEMS) and task.inputs.shape == (13, 64)  # a row per choice
