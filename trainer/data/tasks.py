"""Multiple-choice tasks for in-loop evaluation ([[validation.tasks]]): a JSON-lines file read as data, each choice
tokenized into one row of the run's batch shape. The scoring is trainer/run/tasks.py's.

Each line of a task file is one item, `{"context": str, "choices": [str, ...], "answer": int}` (other keys are
ignored). Choice j becomes one row, as lm-evaluation-harness builds a loglikelihood request (`_encode_pair`): the
context's trailing whitespace moves to the front of the choice, then

    whole   = encode(context + choice)          context = encode(context)          choice tokens = whole[len(context):]

so a tokenizer that merges across the boundary scores the tokens it would have produced for the whole text. The row's
inputs are whole[:-1], its labels whole[1:] with every label but the choice tokens' masked (IGNORE_INDEX), padded on
the right to train.seq_len (token 0, labels masked: attention is causal, so what follows a row's tokens cannot change
their log-likelihoods). A row longer than train.seq_len + 1 tokens loses tokens from the left of its context (as
lm-evaluation-harness truncates); how many rows did is logged once. A choice of more than train.seq_len tokens, an
empty context or choice, an answer out of range, a line that is not such an object: one line naming the key
(`validation.tasks[1].path`), the file and the line, in the validation pass.

The file is only parsed as JSON (trainer.files.json_object): nothing in it runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.shards import DataError
from trainer.data.tokenizer import ByteTokenizer, HFTokenizer
from trainer.files.confine import special_file_problem
from trainer.files.json_object import json_lines
from trainer.loss import IGNORE_INDEX

MAX_TASK_BYTES = 2**30
"""The largest task file read (MMLU's test split is under 10 MB): a bigger one is refused rather than read whole."""


@dataclass(frozen=True, eq=False)  # arrays: compared by identity
class TaskRows:
    """One task as rows of the run's batch shape: row r is one choice of one item."""

    name: str
    inputs: np.ndarray
    """[rows, seq_len] int64 token ids (padding: 0)."""
    labels: np.ndarray
    """[rows, seq_len] int64: the choice's tokens where they are predicted, IGNORE_INDEX elsewhere."""
    item: np.ndarray
    """[rows] the item each row is a choice of (items in file order, each item's choices in order)."""
    chars: np.ndarray
    """[rows] float64: the choice's length in characters (len(choice), lm-evaluation-harness's acc_norm)."""
    answers: np.ndarray
    """[items] the index of each item's right choice."""
    truncated: int
    """Rows whose context lost tokens on the left to fit train.seq_len."""

    @property
    def num_items(self) -> int:
        return len(self.answers)

    def fingerprint(self) -> str:
        """A digest of the rows and answers: every rank must score the same ones (trainer.validate.ranks)."""
        digest = hashlib.sha256(self.name.encode())
        for array in (self.inputs, self.labels, self.item, self.chars, self.answers):
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()[:16]


def encode_choice(tokenizer: ByteTokenizer | HFTokenizer, context: str, choice: str) -> tuple[list[int], int]:
    """(the whole sequence's tokens, how many of its last tokens are the choice's), as lm-evaluation-harness's
    `_encode_pair` (module docstring)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, choice = context[:-spaces], context[-spaces:] + choice
    whole = tokenizer.encode(context + choice)
    return whole, len(whole) - len(tokenizer.encode(context))


def _item(value: dict, where: str) -> tuple[str, list[str], int]:
    """(context, choices, answer) of one line's object, or a DataError naming the line."""
    context, choices, answer = value.get("context"), value.get("choices"), value.get("answer")
    if not isinstance(context, str) or not context.strip():
        raise DataError(f"{where}: \"context\" must be a non-empty string, not {context!r:.60}")
    if not isinstance(choices, list) or not choices:
        raise DataError(f"{where}: \"choices\" must be a non-empty list of strings, not {choices!r:.60}")
    if bad := [j for j, c in enumerate(choices) if not isinstance(c, str) or not c]:
        raise DataError(f"{where}: choice {bad[0]} must be a non-empty string, not {choices[bad[0]]!r:.60}")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise DataError(f"{where}: \"answer\"={answer!r:.60} must be the index of one of its {len(choices)} choices "
                        f"(0 to {len(choices) - 1})")
    return context, choices, answer


def read_task(path: str, *, name: str, key: str, tokenizer: ByteTokenizer | HFTokenizer, seq_len: int,
              vocab_size: int) -> TaskRows:
    """The task file `path` (config key `key`, e.g. "validation.tasks[1].path") as rows; a DataError naming `key`
    for a missing or special file and for every line that is not an item (module docstring)."""
    file = Path(path)
    if problem := special_file_problem(file, max_bytes=MAX_TASK_BYTES, what="task file"):
        raise DataError(f"{key}='{path}': {problem}")
    if not file.is_file():
        raise DataError(f"{key}='{path}' is not a file: a JSON-lines file of {{\"context\", \"choices\", \"answer\"}} "
                        "items (docs/evaluation.md#multiple-choice-tasks)")
    rows: list[tuple[list[int], int]] = []
    items, chars, answers, truncated = [], [], [], 0
    for line in json_lines(file, what="a task item"):
        if line.problem is not None:
            raise DataError(f"{key}: {line.problem}")
        where = f"{key}: {path} line {line.number}"
        context, choices, answer = _item(line.value, where)
        for j, choice in enumerate(choices):
            whole, n = encode_choice(tokenizer, context, choice)
            if n < 1 or n > seq_len:
                raise DataError(f"{where}: choice {j} is {n} tokens, which must be 1 to train.seq_len={seq_len} "
                                "(the tokens a row of the batch can score)")
            if len(whole) == n:
                raise DataError(f"{where}: the context tokenizes to nothing before choice {j}'s tokens")
            if (top := max(whole)) >= vocab_size:
                raise DataError(f"{where}: token id {top} is outside the model's vocabulary of {vocab_size} "
                                "(data.tokenizer's ids must fit model.vocab_size)")
            truncated += len(whole) > seq_len + 1
            rows.append((whole[-(seq_len + 1):], n))
            items.append(len(answers))
            chars.append(len(choice))
        answers.append(answer)
    if not answers:
        raise DataError(f"{key}='{path}' holds no items")
    inputs = np.zeros((len(rows), seq_len), dtype=np.int64)
    labels = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    for r, (whole, n) in enumerate(rows):
        inputs[r, :len(whole) - 1] = whole[:-1]
        labels[r, len(whole) - 1 - n:len(whole) - 1] = whole[-n:]
    return TaskRows(name=name, inputs=inputs, labels=labels, item=np.array(items, dtype=np.int64),
                    chars=np.array(chars, dtype=np.float64), answers=np.array(answers, dtype=np.int64),
                    truncated=truncated)
