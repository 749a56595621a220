"""Hugging Face Llama layout: weight names, config.json, safetensors export and import.

Our RoPE uses transformers' "rotate half" layout (see trainer/models/llama.py), so
weights map one to one by name, with no permutation of q/k. The output head is
never tied to the embeddings here; a tied HF model (Llama 3.2 1B/3B) is imported
by copying `embed_tokens` into the head.

Export writes `config.json` and either `model.safetensors` or, above
`max_shard_bytes`, `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json`: the two layouts `LlamaForCausalLM.from_pretrained`
reads. Tensors are fetched one shard at a time, so the writer never holds more
than one shard in memory. Needs the `safetensors` package (the `hf` extra).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from trainer.errors import UserError
from trainer.models.llama import ModelArgs

logger = logging.getLogger(__name__)

# HF's own default shard size for save_pretrained in transformers 4.x.
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

# max_position_embeddings of every RoPE-scaled reference config (Llama 3.1 with factor 8, 3.2 with factor 32).
LLAMA3_SCALED_CONTEXT = 131072

SAFETENSORS_HINT = "pip install safetensors (or pip install -e '.[hf]')"

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# (our fqn pattern, HF name pattern); {i} is the layer index.
_NAME_MAP = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output_head.proj.weight", "lm_head.weight"),
]


class ExportError(UserError, ValueError):
    """A user-facing problem with an export or import; its message is one line."""


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(re.escape("{i}"), r"(\d+)") + "$")


_TO_HF = [(_compile(ours), hf) for ours, hf in _NAME_MAP]
_FROM_HF = [(_compile(hf), ours) for ours, hf in _NAME_MAP]


def _rename(name: str, table: list[tuple[re.Pattern, str]], what: str) -> str:
    for pattern, target in table:
        m = pattern.match(name)
        if m:
            return target.format(i=m.group(1)) if m.groups() else target
    raise ExportError(f"{name!r} is not a {what} Llama weight name")


def to_hf_name(fqn: str) -> str:
    """`layers.0.attention.q_proj.weight` -> `model.layers.0.self_attn.q_proj.weight`."""
    return _rename(fqn, _TO_HF, "known (trainer)")


def from_hf_name(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.weight` -> `layers.0.attention.q_proj.weight`."""
    return _rename(name, _FROM_HF, "known Hugging Face")


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama with these args, by our fqn, in module order."""
    kv = args.n_kv_heads * args.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        shapes.update({
            f"layers.{i}.attention_norm.weight": (args.dim,),
            f"layers.{i}.attention.q_proj.weight": (args.n_heads * args.head_dim, args.dim),
            f"layers.{i}.attention.k_proj.weight": (kv, args.dim),
            f"layers.{i}.attention.v_proj.weight": (kv, args.dim),
            f"layers.{i}.attention.o_proj.weight": (args.dim, args.n_heads * args.head_dim),
            f"layers.{i}.mlp_norm.weight": (args.dim,),
            f"layers.{i}.mlp.gate_proj.weight": (args.ffn_dim, args.dim),
            f"layers.{i}.mlp.up_proj.weight": (args.ffn_dim, args.dim),
            f"layers.{i}.mlp.down_proj.weight": (args.dim, args.ffn_dim),
        })
    shapes["norm.weight"] = (args.dim,)
    shapes["output_head.proj.weight"] = (args.vocab_size, args.dim)
    return shapes


def hf_config(args: ModelArgs, *, dtype: torch.dtype) -> dict:
    """config.json for `LlamaForCausalLM` (keys read by transformers 4.x and 5.x)."""
    s = args.rope_scaling
    rope_scaling = None if s is None else {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_seq_len,
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        # What the reference configs write: the scaled context, not original_max_position_embeddings
        # (transformers warns when the two are equal).
        "max_position_embeddings": args.max_seq_len if s is None else max(args.max_seq_len, LLAMA3_SCALED_CONTEXT),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def check_hf_config(config: dict, args: ModelArgs, *, where: str) -> None:
    """Raise ExportError naming the first field where an HF config.json disagrees with args."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = config.get("rope_theta", rope.get("rope_theta"))
    expected = {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "vocab_size": args.vocab_size,
        "intermediate_size": args.ffn_dim,
    }
    for key, value in expected.items():
        if config.get(key) != value:
            raise ExportError(f"{where}: {key}={config.get(key)} but the trainer model has {value} "
                              f"({_describe(args)})")
    if config.get("model_type", "llama") != "llama":
        raise ExportError(f"{where}: model_type={config.get('model_type')!r}, expected 'llama'")
    if config.get("hidden_act", "silu") != "silu" or config.get("attention_bias") or config.get("mlp_bias"):
        raise ExportError(f"{where}: only hidden_act='silu' without attention/mlp biases is supported")
    if theta is not None and float(theta) != args.rope_theta:
        raise ExportError(f"{where}: rope_theta={theta} but the trainer model has {args.rope_theta}")
    has_scaling = rope.get("rope_type", rope.get("type", "default")) == "llama3"
    if has_scaling != (args.rope_scaling is not None) or (
        has_scaling and float(rope.get("factor", 0)) != args.rope_scaling.factor
    ):
        raise ExportError(f"{where}: rope scaling {rope or None} does not match the trainer model's "
                          f"{args.rope_scaling}")


def args_from_hf_config(config: dict, *, where: str) -> ModelArgs:
    """ModelArgs of a Hugging Face Llama config.json (checked back against it with `check_hf_config`)."""
    from trainer.models.llama import FLAVORS, RopeScaling

    try:
        dim, ffn = int(config["hidden_size"]), int(config["intermediate_size"])
        n_heads = int(config["num_attention_heads"])
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        scaling = None
        if rope.get("rope_type", rope.get("type", "default")) == "llama3":
            scaling = RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                                  high_freq_factor=float(rope["high_freq_factor"]),
                                  original_max_seq_len=int(rope["original_max_position_embeddings"]))
        # The FFN width comes from (multiple_of, ffn_dim_multiplier): a flavor's when it gives this width,
        # else the pair that gives exactly `intermediate_size`.
        hidden = int(2 * 4 * dim / 3)
        multiple_of, multiplier = ffn, (None if ffn >= hidden else ffn / hidden)
        for flavor in FLAVORS.values():
            if flavor.dim == dim and flavor.ffn_dim == ffn:
                multiple_of, multiplier = flavor.multiple_of, flavor.ffn_dim_multiplier
                break
        args = ModelArgs(
            dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads", n_heads)), vocab_size=int(config["vocab_size"]),
            multiple_of=multiple_of, ffn_dim_multiplier=multiplier, norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))), rope_scaling=scaling,
            max_seq_len=int(config.get("max_position_embeddings", 8192)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{where}: not a Llama config ({type(e).__name__}: {e})") from None
    if config.get("head_dim", args.head_dim) != args.head_dim:
        raise ExportError(f"{where}: head_dim={config['head_dim']} but hidden_size/num_attention_heads is "
                          f"{args.head_dim}; this trainer's Llama has no separate head_dim")
    check_hf_config(config, args, where=where)
    return args


def read_hf_config(folder: str | os.PathLike) -> ModelArgs:
    """ModelArgs from a Hugging Face Llama folder's config.json."""
    return args_from_hf_config(_read_config(Path(folder)), where=str(Path(folder) / "config.json"))


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise ExportError(f"{folder} does not exist or is not a folder")
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ExportError(f"{config_path} is missing: not a Hugging Face model folder") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ExportError(f"{config_path} is not a model config (a JSON {type(config).__name__})")
    return config


def _describe(args: ModelArgs) -> str:
    shape = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim")
    return ", ".join(f"{k}={getattr(args, k)}" for k in shape)


def plan_shards(sizes: dict[str, int], *, max_shard_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most max_shard_bytes; a bigger tensor gets its own shard."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes.items():
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def require_safetensors(what: str) -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ExportError(f"{what} needs the safetensors package: {SAFETENSORS_HINT}") from None


def write_hf_export(
    out_dir: str | os.PathLike,
    *,
    args: ModelArgs,
    shapes: dict[str, tuple[int, ...]],
    fetch: Callable[[list[str]], dict[str, torch.Tensor]],
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    is_writer: bool = True,
) -> Path:
    """Write config.json and safetensors for `shapes` (our fqns), fetching one shard's tensors at a time.

    `fetch(fqns)` returns those tensors (any dtype/device; cast here). In a
    distributed export every rank calls this with the same arguments (fetch may
    be collective) and only the writer rank writes; it returns {} elsewhere. The
    folder appears complete or not at all: it is written as `{out_dir}.tmp` and renamed.
    """
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {fqn: itemsize * _numel(shape) for fqn, shape in shapes.items()}
    shards = plan_shards(sizes, max_shard_bytes=max_shard_bytes)
    if is_writer:
        require_safetensors("writing a Hugging Face export")
        from safetensors.torch import save_file

        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    weight_map: dict[str, str] = {}
    for fqns, file_name in zip(shards, names):
        tensors = fetch(fqns)
        if not is_writer:
            continue
        out_tensors = {}
        for fqn in fqns:
            t = tensors[fqn].detach().to("cpu", dtype)
            assert tuple(t.shape) == tuple(shapes[fqn]), (fqn, t.shape, shapes[fqn])
            # clone: safetensors refuses tensors that share storage (a 1-process "gather" may alias a parameter).
            out_tensors[to_hf_name(fqn)] = t.contiguous().clone()
            weight_map[to_hf_name(fqn)] = file_name
        save_file(out_tensors, str(tmp / file_name), metadata={"format": "pt"})
        del out_tensors, tensors
    if not is_writer:
        return out
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(hf_config(args, dtype=dtype), indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    logger.info(
        "exported %d tensors (%s, %.1f MiB) in Hugging Face Llama layout to %s (%s)",
        len(shapes), _DTYPE_NAMES[dtype], sum(sizes.values()) / 2**20, out,
        names[0] if len(names) == 1 else f"{len(names)} shards",
    )
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_hf_weights(folder: str | os.PathLike, *, args: ModelArgs) -> dict[str, torch.Tensor]:
    """Read an HF Llama folder (config.json + single or sharded safetensors) as our fqns.

    Checks config.json and every tensor's shape against args before returning;
    tensors keep the folder's dtype. A tied model's head is a copy of the embeddings.
    """
    folder = Path(folder)
    config = _read_config(folder)
    check_hf_config(config, args, where=str(folder / "config.json"))
    require_safetensors("reading a Hugging Face model")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    # Only safetensors are read: pytorch_model.bin and *.pt files are pickles, and unpickling runs code.
    index_path = folder / "model.safetensors.index.json"
    if index_path.exists():
        try:
            files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ExportError(f"{index_path} is not a safetensors index ({type(e).__name__}: {e})") from None
        for name in files:
            if not (isinstance(name, str) and re.fullmatch(r"[\w.-]+\.safetensors", name)):
                raise ExportError(f"{index_path} names {name!r}, not a .safetensors file of this folder")
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
        raise ExportError(
            f"{folder} has neither model.safetensors nor model.safetensors.index.json"
            + (f" ({', '.join(pickles)} not read: pickled weights can run code when loaded; only safetensors are "
               "read)" if pickles else "")
        )
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise ExportError(f"{path} is not a readable safetensors file: {str(e).splitlines()[0]}") from None
        for hf_name, tensor in tensors.items():
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # a buffer some old exports include; derived from the config
            weights[from_hf_name(hf_name)] = tensor
    expected = expected_shapes(args)
    if "output_head.proj.weight" not in weights and config.get("tie_word_embeddings"):
        weights["output_head.proj.weight"] = weights["tok_embeddings.weight"].clone()
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    if missing or unexpected:
        raise ExportError(
            f"{folder}: {len(missing)} missing weights (first: {to_hf_name(missing[0]) if missing else '-'}), "
            f"{len(unexpected)} unexpected (first: {to_hf_name(unexpected[0]) if unexpected else '-'})"
        )
    for fqn, shape in expected.items():
        if tuple(weights[fqn].shape) != shape:
            raise ExportError(f"{folder}: {to_hf_name(fqn)} has shape {list(weights[fqn].shape)}, "
                              f"expected {list(shape)}")
    return {fqn: weights[fqn] for fqn in expected}
