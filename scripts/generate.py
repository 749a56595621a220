"""Sample text from a checkpoint or a Hugging Face export (one process, CPU or one GPU).

    python scripts/generate.py outputs/run/checkpoint --prompt "The Python " \\
        [--max-new-tokens 200] [--temperature 0.8] [--top-k 50] [--seed 0] \\
        [--tokenizer PATH|byte] [--device cuda] [--dtype bfloat16]

PATH is a step-N checkpoint folder, a checkpoint folder (its latest complete checkpoint) or an
export folder (step-N-hf, or what convert_checkpoint.py export wrote), dense or MoE. The
tokenizer is --tokenizer, else the export's tokenizer.json, else the checkpoint's copy of its run's
(read only from inside the folder). The prompt follows the end-of-document token, as every
document did in training. --temperature 0 is greedy. Errors are one line (exit 2). To sample from an export with
transformers instead, see docs/checkpointing.md#generating-text.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

# The checkout this script is in comes first, even when another copy of trainer is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.errors import UserError  # noqa: E402
from trainer.log import setup_logging  # noqa: E402
from trainer.seeds import MAX_TORCH_SEED  # noqa: E402

logger = logging.getLogger("trainer")


def find_tokenizer(path: Path, override: str | None):
    """--tokenizer, else a checkpoint's own copy of its run's tokenizer (checked unchanged), else an export's
    tokenizer.json; read only from inside the folder (trainer/checkpoint/tokenizer.py)."""
    from trainer.checkpoint import CHECKPOINT_JSON, read_checkpoint_json
    from trainer.checkpoint.tokenizer import recorded_tokenizer, why_no_tokenizer
    from trainer.data import ByteTokenizer, build_tokenizer
    from trainer.data.tokenizer import folder_tokenizer_problem
    from trainer.hf.tokenizer import is_byte_tokenizer_json

    if override:
        return build_tokenizer(override)
    file = path / "tokenizer.json"
    why = "an export made without one"
    if os.path.lexists(path / CHECKPOINT_JSON):  # a DCP checkpoint
        info = read_checkpoint_json(path)
        recorded, why = recorded_tokenizer(path, info), why_no_tokenizer(info)
        if recorded:
            spec, fingerprint = recorded
            tok = build_tokenizer(spec)
            if fingerprint and tok.fingerprint != fingerprint:
                raise UserError(f"tokenizer {spec} has changed since the run ({tok.fingerprint}, the run's "
                                f"{fingerprint}); pass --tokenizer=PATH of the run's tokenizer.json")
            return tok
    elif os.path.lexists(file):  # an export
        if problem := folder_tokenizer_problem(file, path):
            raise UserError(problem)
        # A byte-tokenizer run's export holds the byte tokenizer written as a tokenizer.json: the same ids,
        # read without the optional `tokenizers` package.
        if is_byte_tokenizer_json(file):
            return ByteTokenizer()
        return build_tokenizer(str(file))
    raise UserError(f"{path} names no tokenizer ({why}); pass --tokenizer=PATH of the model's tokenizer.json, or "
                    "--tokenizer=byte for the built-in byte tokenizer")


def check_device(text: str):
    """--device as a torch.device this machine has: a one-line UserError for a name torch does not know, or a GPU
    that is not here, before anything is read."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise UserError(f"--device={text!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU build of torch" if torch.version.cuda is None else "no CUDA GPU visible"
        raise UserError(f"--device={text} but this machine has no CUDA GPU ({build}); use --device=cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"--device={text} but this machine has {torch.cuda.device_count()} CUDA GPU(s) "
                        f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device={text}: generation runs on cpu or cuda[:N]")
    return device


# A temperature divides the logits: below the least, fp32 logits overflow to inf (softmax then gives NaN).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4


def check_sampling(args: argparse.Namespace) -> None:
    """Each sampling flag in the range generate() takes, else one UserError line naming it, before anything is read
    (NaN would stop torch.multinomial with a traceback, a seed past 64 bits manual_seed)."""
    t = args.temperature
    if not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        raise UserError(f"--temperature={t} must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, "
                        f"{MAX_TEMPERATURE:g}]")
    if not 0 <= args.seed <= MAX_TORCH_SEED:
        raise UserError(f"--seed={args.seed} must be in [0, {MAX_TORCH_SEED}] (a torch generator's 64-bit seed)")
    if args.max_new_tokens < 1 or args.top_k < 0:
        raise UserError(f"--max-new-tokens={args.max_new_tokens} must be >= 1 and --top-k={args.top_k} >= 0 (0 = "
                        "all tokens)")


def describe_sampling(args: argparse.Namespace) -> str:
    """What decoding does: temperature 0 is argmax, where --top-k plays no part (it is not printed)."""
    if args.temperature == 0:
        return f"{args.max_new_tokens} tokens, greedy"
    return f"sampling {args.max_new_tokens} tokens at temperature {args.temperature:g}" + (
        f", top-{args.top_k}" if args.top_k else "")


def run(args: argparse.Namespace) -> str:
    import torch

    from trainer.checkpoint import load_model, resolve_checkpoint
    from trainer.models.generate import generate
    from trainer.models import num_params

    device = check_device(args.device)
    if not os.path.lexists(args.path):  # before the tokenizer is looked for in it
        raise UserError(f"{args.path} does not exist: give a step-N checkpoint folder, a checkpoint folder or an "
                        "export folder")
    path = resolve_checkpoint(Path(args.path))
    tok = find_tokenizer(path, args.tokenizer)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = load_model(path, device=device, dtype=dtype, weights=args.weights)
    if tok.vocab_size > model.args.vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} ids but the model's vocabulary {model.args.vocab_size}: "
                        "not the run's tokenizer; pass --tokenizer=PATH of the run's tokenizer.json")
    logger.info("loaded %s (%s, %.1fM parameters) on %s; %s", path, type(model).__name__, num_params(model) / 1e6,
                args.device, describe_sampling(args))
    prompt = [tok.eos_id, *tok.encode(args.prompt)]
    new = generate(model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   eos_id=tok.eos_id, seed=args.seed)
    return args.prompt + tok.decode([i for i in new if i != tok.eos_id])


def main(argv: list[str]) -> int:
    setup_logging(0)
    logging.getLogger("trainer").handlers[0].setStream(sys.stderr)  # stdout holds the text alone
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", help="a step-N checkpoint, a checkpoint folder (its latest) or an export folder")
    parser.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0 = all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", choices=["model", "ema"], default="model",
                        help="a training checkpoint's weights, or their EMA (a run with train.ema_decay > 0)")
    parser.add_argument("--tokenizer", help="tokenizer.json or 'byte' (default: the export's or the run's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    try:
        check_sampling(args)
        text = run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
