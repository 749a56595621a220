"""Convert between our DCP checkpoints and Hugging Face folders (one process, no GPU needed).

Export a training checkpoint's model weights (safetensors + config.json, loadable by
transformers' AutoModelForCausalLM: LlamaForCausalLM for dense flavors, Ernie4_5_MoeForCausalLM,
Glm4MoeForCausalLM or Qwen3MoeForCausalLM for MoE flavors, DeepseekV3ForCausalLM and GptOssForCausalLM for theirs;
docs/checkpointing.md#exporting-weights-hugging-face),
with the run's tokenizer when checkpoint.json records one:

    python scripts/convert_checkpoint.py export outputs/run/checkpoint/step-1000 outputs/run/hf \\
        [--dtype bfloat16|float32] [--max-shard-size 5GB] [--tokenizer PATH | --no-tokenizer]

    (a checkpoint folder instead of a step-N folder means its latest complete checkpoint)

Import Hugging Face weights (one of our exports, a Llama-family or Qwen3 model of any shape, or an
Ernie4_5_Moe / Glm4Moe / Qwen3Moe / DeepseekV3 / GptOss one) as a model-only checkpoint for
checkpoint.initial_load_path. The shape comes from its config.json and is recorded in the checkpoint, so a run
started from it takes the shape (and vocabulary) from there, with a config that sets no [model] keys:

    python scripts/convert_checkpoint.py import /models/SmolLM2-135M outputs/smollm2-init
    python scripts/train.py --config ... --checkpoint.initial_load_path=outputs/smollm2-init

    (--flavor 1b instead checks that the folder holds that flavor's shapes)

Needs safetensors (pip install -e '.[hf]'). Errors are one line, naming the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
from pathlib import Path

# The checkout this script is in comes first, even when another copy of trainer is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.log import setup_logging  # noqa: E402

logger = logging.getLogger("trainer")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m:
        raise ValueError(f"--max-shard-size={text!r}: expected a size like 5GB, 500MB or 1000000")
    unit = m.group(2).rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit])


def export_tokenizer(args: argparse.Namespace, info: dict, source: Path):
    """The tokenizer to copy: --tokenizer, else the checkpoint's own copy of the run's (checked unchanged), else
    none."""
    from trainer.checkpoint.tokenizer import recorded_tokenizer, why_no_tokenizer
    from trainer.hf import resolve_tokenizer

    if args.no_tokenizer:
        return None
    if args.tokenizer:
        return resolve_tokenizer(args.tokenizer, where="--tokenizer")
    recorded = recorded_tokenizer(source, info)
    if not recorded:
        logger.info("%s records no tokenizer (%s): the export has none; --tokenizer=PATH (a tokenizer.json, or "
                    "'byte') adds one", source / "checkpoint.json", why_no_tokenizer(info))
        return None
    spec, fingerprint = recorded
    return resolve_tokenizer(spec, fingerprint=fingerprint, where=f"{source / 'checkpoint.json'}")


def warn_nonfinite(weights: dict, *, where: str) -> None:
    """Export and import carry what they are given (a diverged run can be worth inspecting), and say so."""
    from trainer.checkpoint.values import nonfinite_problem

    if problem := nonfinite_problem(weights, where=where):
        logger.warning("%s; loading it for generation or a run is refused", problem)


def export(args: argparse.Namespace) -> None:
    import torch

    from trainer.checkpoint import args_from_json, load_full_model_weights, resolve_checkpoint
    from trainer.hf import family, require_safetensors, write_hf_export
    from trainer.hf.output_folder import EXPORT, check_output

    require_safetensors("export")
    check_output(args.out, kind=EXPORT)  # before reading any weights: never into a folder of checkpoints
    source = resolve_checkpoint(Path(args.checkpoint))
    info, weights = load_full_model_weights(source, allow_unverified=args.allow_unverified, weights=args.weights)
    model_args = args_from_json(info["model"], where=str(source / "checkpoint.json"))
    tokenizer = export_tokenizer(args, info, source)
    warn_nonfinite(weights, where=str(source))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    logger.info("exporting %s%s (step %s, %s %s, saved with mixed_precision=%s) as %s", source,
                "'s EMA weights" if args.weights == "ema" else "", info.get("step"), info["model"].get("name", "llama3"),
                info["model"].get("flavor"), info.get("mixed_precision"), family(model_args).architecture(model_args))
    write_hf_export(Path(args.out), args=model_args, shapes={k: tuple(v.shape) for k, v in weights.items()},
                    fetch=lambda fqns: {k: weights[k] for k in fqns}, dtype=dtype,
                    max_shard_bytes=parse_size(args.max_shard_size), tokenizer=tokenizer)


def import_hf(args: argparse.Namespace) -> None:
    from trainer.checkpoint import RunInfo, save_model_only
    from trainer.hf import open_hf_folder
    from trainer.hf.tokenizer import folder_tokenizer
    from trainer.models import family_of, model_args_for
    from trainer.hf.output_folder import IMPORT, check_output

    check_output(args.out, kind=IMPORT)  # before reading any weights: never into a folder of checkpoints
    tokenizer = folder_tokenizer(Path(args.hf_folder))  # copied into the checkpoint, as a run's is
    if args.flavor:
        model_args = model_args_for(args.flavor, vocab_size=args.vocab_size, n_layers=args.n_layers)
    elif args.vocab_size or args.n_layers:
        raise ValueError("--vocab-size and --n-layers go with --flavor: without it the shape is the folder's own")
    else:
        model_args = None  # the folder's own shape
    folder = open_hf_folder(args.hf_folder, args=model_args)  # everything checked before a weight is read
    model_args, weights = folder.args, folder.read()
    warn_nonfinite(weights, where=str(args.hf_folder))
    if family_of(model_args).has_router and args.flavor:
        model_args = _routing_of_folder(model_args, Path(args.hf_folder))
    if getattr(model_args, "mtp_layers", 0):  # a DeepSeek-V3 flavor's MTP modules: no weights in the folder
        logger.info("the imported model has no MTP modules (the flavor's deepseek_v3.mtp_layers=%d): transformers' "
                    "export holds none, so the checkpoint records deepseek_v3.mtp_layers=0", model_args.mtp_layers)
        model_args = dataclasses.replace(model_args, mtp_layers=0)
    run = RunInfo(flavor=args.flavor or "imported", model_args=model_args, mixed_precision="hf-import", **tokenizer)
    out = save_model_only(Path(args.out), weights, run=run, source=str(Path(args.hf_folder).resolve()))
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()})
    logger.info("imported %d tensors (%s)%s from %s into %s; continue from it with --checkpoint.initial_load_path=%s "
                "(the run takes the model's shape and vocabulary from it: its config needs no [model] keys)",
                len(weights), ", ".join(dtypes), " and tokenizer.json" if tokenizer.get("tokenizer") not in
                (None, "byte") else "", args.hf_folder, out, out)


def _routing_of_folder(model_args, folder: Path):
    """The flavor's MoE args with the folder's top_k and route_norm (recorded in the checkpoint; a run routes with
    its own [moe] settings, and says so when they differ)."""
    from trainer.hf import family
    from trainer.hf.folder import read_config

    where = str(folder / "config.json")
    routed = family(model_args).with_routing_of(model_args, read_config(folder), where=where)
    if (routed.top_k, routed.route_norm) != (model_args.top_k, model_args.route_norm):
        logger.info("%s routes top-%d (route_norm=%s), the flavor top-%d (route_norm=%s): recorded as the folder's; "
                    "a run started from it routes so too, unless its config sets moe.top_k or moe.route_norm", where,
                    routed.top_k, routed.route_norm, model_args.top_k, model_args.route_norm)
    return routed


def main(argv: list[str]) -> int:
    setup_logging(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="DCP checkpoint -> Hugging Face safetensors + config.json")
    e.add_argument("checkpoint", help="a step-N checkpoint folder, or a checkpoint folder (its latest)")
    e.add_argument("out", help="output folder: new, empty, or an earlier export (moved aside to OUT.old)")
    e.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    e.add_argument("--weights", choices=["model", "ema"], default="model",
                   help="the trained weights, or their EMA (a run with train.ema_decay > 0)")
    e.add_argument("--max-shard-size", default="5GB", help="split into model-0000i-of-0000n files above this")
    e.add_argument("--allow-unverified", action="store_true",
                   help="export a checkpoint whose checkpoint.json has no \"files\" list (its shards go unverified)")
    tok = e.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", help="tokenizer.json (or 'byte') to put in the export, instead of the run's")
    tok.add_argument("--no-tokenizer", action="store_true", help="copy no tokenizer")
    i = sub.add_parser("import", help="Hugging Face folder -> model-only DCP checkpoint (initial_load_path)")
    i.add_argument("hf_folder")
    i.add_argument("out", help="output folder: new, empty, or an earlier import (moved aside to OUT.old)")
    i.add_argument("--flavor", default="", help="model.flavor the weights must match (debug, 1b, 8b, ..., debug_moe, moe_16b, ...); default: the folder's own shape")
    i.add_argument("--vocab-size", type=int, default=0, help="model.vocab_size, if not the flavor's")
    i.add_argument("--n-layers", type=int, default=0, help="model.n_layers, if not the flavor's")
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            export(args)
        else:
            import_hf(args)
    except ValueError as e:
        if type(e).__module__.startswith(("trainer", "builtins", "__main__")):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
