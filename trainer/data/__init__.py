"""Data pipeline: tokenizers, token shards, sample sources and the data-parallel loader."""

from trainer.data.shards import DataError, ShardInfo, open_shard, write_shard
from trainer.data.sources import DefaultTextSource, ShardSource, StdlibTextSource, SyntheticSource
from trainer.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer, tokenizer_fingerprint

__all__ = [
    "ByteTokenizer", "DataError", "DataPosition", "DefaultTextSource", "HFTokenizer", "ShardInfo", "ShardSource", "StdlibTextSource",
    "SyntheticSource", "TokenDataLoader", "build_data_loader", "build_source", "build_tokenizer", "open_shard",
    "tokenizer_fingerprint", "write_shard",
]


def __getattr__(name):
    # The loader imports torch (~1 s); scripts/prepare_data.py only needs tokenizers and shards.
    if name in ("DataPosition", "TokenDataLoader", "build_data_loader", "build_source"):
        from trainer.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
