"""Bad inputs that once gave tracebacks or misbehaved, each now one `UserError` line before any expensive work
(issue 25, item 8): seeds out of torch's range, NUL bytes and empty dump folders, a shard header with
non-ASCII bytes, and a model too large for the device, refused from its shapes before it is built."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import DEBUG_CONFIG, REPO, launch, run_cli_cases
from trainer.config import load_job_config
from trainer.data import DataError, open_shard, write_shard
from trainer.data.tokenizer import ByteTokenizer
from trainer.errors import ConfigError
from trainer.validate import validate_job

GIB = 2**30


def _cfg(*args: str):
    return load_job_config(["--config", DEBUG_CONFIG, *args])


def _one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message, message
    return message


# -- seeds ----------------------------------------------------------------------


@pytest.mark.parametrize("arg, key, limit", [
    ("--train.seed=9223372036854775807", "train.seed", "18446688729348"),  # torch: Overflow when unpacking long long
    ("--train.seed=18446688729349", "train.seed", "18446688729348"),  # x 1000003 + crc32 just past 2**64 - 1
    ("--train.seed=-1", "train.seed", "18446688729348"),
    ("--data.seed=-1", "data.seed", "18446744073709551615"),  # numpy: expected non-negative integer
    ("--data.seed=18446744073709551616", "data.seed", "18446744073709551615"),
])
def test_seed_out_of_range_is_a_config_error(arg: str, key: str, limit: str) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(arg)
    assert _one_line(e).startswith(f"{key}={arg.split('=', 1)[1]} is outside the allowed range [0, {limit}]")


class _Samples:
    """A source of `n` samples that the loader may permute (only its count and permute flag are read here)."""

    permute = True

    def __init__(self, n: int):
        self.n = n

    def num_samples(self, seq_len: int) -> int:
        return self.n


def test_largest_seeds_initialize_and_shuffle() -> None:
    """The bounds are the real ones: the largest allowed seeds run through the init and the data order, and the
    seed still decides them (a seed clamped or dropped on the way would give the next-lower seed's values)."""
    from trainer.data.loader import TokenDataLoader
    from trainer.distributed import set_determinism
    from trainer.models import build_model, model_args_for
    from trainer.seeds import MAX_DATA_SEED, MAX_TRAIN_SEED

    cfg = _cfg(f"--train.seed={MAX_TRAIN_SEED}", f"--data.seed={MAX_DATA_SEED}")
    assert (cfg.train.seed, cfg.data.seed) == (MAX_TRAIN_SEED, MAX_DATA_SEED)

    def init(seed: int) -> dict[str, torch.Tensor]:
        model = build_model(model_args_for("debug", n_layers=1))
        model.init_weights(seed=seed)
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    largest = init(cfg.train.seed)
    assert all(torch.equal(v, w) for v, w in zip(largest.values(), init(cfg.train.seed).values()))  # reproducible
    below = init(cfg.train.seed - 1)
    drawn = [k for k in largest if not k.endswith("norm.weight")]  # norms start at ones
    assert drawn and all(not torch.equal(largest[k], below[k]) for k in drawn)
    with torch.random.fork_rng():
        set_determinism(seed=cfg.train.seed, deterministic=False)
        assert torch.initial_seed() == MAX_TRAIN_SEED

    def order(seed: int) -> np.ndarray:
        loader = TokenDataLoader(_Samples(64), seq_len=8, batch_size=1, grad_accum_steps=1, dp_rank=0, dp_degree=1,
                                 seed=seed)
        return loader.sample_indices(np.arange(128))  # two epochs

    first = order(cfg.data.seed)
    assert sorted(first[:64]) == list(range(64)) and sorted(first[64:]) == list(range(64))  # permutations
    assert not np.array_equal(first[:64], first[64:])  # a new order each epoch
    assert np.array_equal(first, order(cfg.data.seed)) and not np.array_equal(first, order(cfg.data.seed - 1))
    assert f"0 to {MAX_TRAIN_SEED}" in (REPO / "docs" / "config.md").read_text()  # what the reference says


# -- paths ----------------------------------------------------------------------


def test_dump_folder_with_a_nul_byte_is_a_config_error(tmp_path: Path) -> None:
    toml = tmp_path / "nul.toml"
    toml.write_text(f'[job]\ndump_folder = "{tmp_path}/run\\u0000x"\n')  # TOML's escape: a real NUL in the value
    with pytest.raises(ConfigError) as e:
        load_job_config(["--config", DEBUG_CONFIG, "--config", str(toml)])
    assert _one_line(e).startswith("job.dump_folder=") and "NUL byte" in str(e.value)
    with pytest.raises(ConfigError, match=r"^data.path=.* holds a NUL byte"):
        _cfg("--data.source=shards", "--data.path=shards\x00")


@pytest.mark.parametrize("value", ["", "  "])
def test_empty_dump_folder_is_a_config_error(value: str) -> None:
    """"" is the current directory: config.toml, metrics.jsonl and tb/ would land where the run was started."""
    with pytest.raises(ConfigError) as e:
        _cfg(f"--job.dump_folder={value}")
    assert _one_line(e).startswith(f"job.dump_folder={value!r} is empty")


# -- data -----------------------------------------------------------------------


def test_shard_with_non_ascii_fingerprint_is_a_data_error(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "a.bin", np.arange(300), vocab_size=512,
                       tokenizer_fingerprint=ByteTokenizer.fingerprint)
    raw = bytearray(path.read_bytes())
    raw[45:49] = b"\xff\xfe\xc3\x28"  # the fingerprint field, sizes and checksums untouched
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError) as e:
        open_shard(path)
    assert str(path) in _one_line(e) and "tokenizer fingerprint field" in str(e.value)
    # And through the validation pass, as a run meets it.
    with pytest.raises(DataError, match="tokenizer fingerprint field"):
        validate_job(_cfg("--data.source=shards", f"--data.path={tmp_path}"), world_size=1)


# -- a model too large for the device ----------------------------------------------


def test_model_too_large_for_the_host_is_refused_before_it_is_built() -> None:
    """On a CPU the host's RAM is the device; 10**8 blocks used to build for minutes without a word."""
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        validate_job(_cfg("--model.n_layers=100000000"), world_size=1)
    message = _one_line(e)
    assert time.monotonic() - start < 10
    assert message.startswith("model.n_layers=100000000 (model.flavor='debug'): about 19,686.4B parameters, "
                              "293,350.2 GiB of weights, gradients and optimizer state per rank after sharding "
                              "(dp_shard=1, tp=1, pp=1, ep=1; 16 bytes per parameter: fp32 master weights")
    assert "GiB of host memory (a CPU run)" in message and "lower model.n_layers" in message


@pytest.mark.parametrize("config, world_size, args, per_rank_gib", [
    # The shipped recipes at their world sizes fit an 80 GB GPU, with the margins in the comments.
    ("7b_16gpu_fp8.toml", 16, [], 3.7),  # 8.03B x 8 bytes (bf16 master) / 16
    ("llama3_8b.toml", 1, [], 59.8),  # 1 H100 with its settings: 19 GiB to spare before activations
    ("llama3_8b.toml", 1, ["--optimizer.bf16_update=kahan"], 74.8),  # + 2 bytes of Kahan buffer: still fits
    ("llama3_8b.toml", 2, ["--distributed.master_dtype=fp32", "--distributed.pp=2"], 59.8),  # fp32 over 2 stages
    ("moe_16b_4gpu_fp8.toml", 4, [], 29.2),  # 15.7B over ep=4 x dp_shard=4
])
def test_configs_that_fit_an_80gb_gpu_are_not_refused(on_h100, config: str, world_size: int, args: list[str],
                                                       per_rank_gib: float) -> None:
    from trainer.validate.memory import estimate_train_state
    from trainer.validate.resolve import uses_bf16_master

    cfg = load_job_config(["--config", str(REPO / "configs" / "train" / config), "--data.source=synthetic", *args])
    job = validate_job(cfg, world_size=world_size)
    bf16 = uses_bf16_master(cfg)
    est = estimate_train_state(job.model_args, job.parallel_dims, bf16_master=bf16,
                               kahan=bf16 and cfg.optimizer.bf16_update == "kahan")
    assert est.bytes_per_rank / GIB == pytest.approx(per_rank_gib, abs=0.05)


@pytest.mark.parametrize("config, world_size, args, message", [
    ("llama3_8b.toml", 1, ["--distributed.master_dtype=fp32"],
     "model.flavor='8b': about 8.0B parameters, 119.7 GiB of weights, gradients and optimizer state per rank after "
     "sharding (dp_shard=1, tp=1, pp=1, ep=1; 16 bytes per parameter: fp32 master weights, gradients and 2 AdamW "
     "moments), more than the 79.0 GiB of GPU 0 (H100 80GB, faked by the test), before any activation; pick a "
     "smaller model.flavor, or spread the model over more ranks (distributed.dp_shard, pp or tp), or set "
     "distributed.master_dtype='bf16' (half the bytes)"),
    ("moe_16b_4gpu_fp8.toml", 1, ["--distributed.ep=1"], "model.flavor='moe_16b': about 15.7B parameters, 116.8 GiB"),
    ("debug_model.toml", 8, ["--model.n_layers=100000000", "--distributed.pp=2", "--distributed.dp_shard=2",
                             "--distributed.tp=2"],
     "(dp_shard=2, tp=2, pp=2, ep=1; 16 bytes per parameter"),
])
def test_configs_that_cannot_fit_an_80gb_gpu_are_refused(on_h100, config: str, world_size: int, args: list[str],
                                                         message: str) -> None:
    cfg = load_job_config(["--config", str(REPO / "configs" / "train" / config), "--data.source=synthetic", *args])
    with pytest.raises(ConfigError) as e:
        validate_job(cfg, world_size=world_size)
    assert message in _one_line(e)


def test_cli_refuses_a_huge_model_in_one_line_within_seconds(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = launch(["--config", DEBUG_CONFIG, "--model.n_layers=100000000", f"--job.dump_folder={tmp_path / 'run'}"],
                  timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert time.monotonic() - start < 60  # was minutes of silence; the estimate is instant (the rest is imports)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: model.n_layers=100000000"), proc.stderr
    assert not (tmp_path / "run").exists()



@pytest.mark.slow
def test_data_with_no_label_to_learn_from_exits_2_in_one_line(tmp_path: Path) -> None:
    """data.eod_mask_loss on end-of-document tokens alone (issue 51, item 6): training logged loss 0.0000 and exited
    0; a held-out set of them reported val_loss 0. Now each is one line, exit 2: step 1 stops, or the run stops
    before its first step."""
    eos, text = tmp_path / "eos", tmp_path / "text"
    for folder, tokens in ((eos, np.full(4_000, ByteTokenizer.eos_id)), (text, np.arange(4_000) % 256)):
        folder.mkdir()
        write_shard(folder / "a.bin", tokens, vocab_size=ByteTokenizer.vocab_size,
                    tokenizer_fingerprint=ByteTokenizer.fingerprint)
    common = ["--config", DEBUG_CONFIG, "--train.steps=2", "--train.seq_len=32", "--data.source=shards",
              "--data.eod_mask_loss=true", "--metrics.enable_tensorboard=false"]
    results = run_cli_cases({
        "train": [*common, f"--data.path={eos}", f"--job.dump_folder={tmp_path / 'a'}"],
        "validation": [*common, f"--data.path={text}", "--validation.enable=true", f"--validation.path={eos}",
                       f"--job.dump_folder={tmp_path / 'b'}"],
    })
    for name, says in (("train", "): step 1 has nothing to learn from: every label of its global batch"),
                       ("validation", "): validation: the held-out data (")):
        result = results[name]
        out = result["stdout"] + result["stderr"]
        errors = [line for line in out.splitlines() if line.startswith("error")]
        assert result["rc"] == 2 and "Traceback" not in out and "loss 0.0000" not in out, out[-3000:]
        assert len(errors) == 1 and errors[0].startswith("error (rank 0") and says in errors[0], out[-3000:]
    assert "step 1 " not in results["validation"]["stdout"] + results["validation"]["stderr"]  # before any step


# -- quietly accepted (issue 36, item 7) ----------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_exclude_fqns_matching_no_linear_is_refused_on_every_precision(precision: str) -> None:
    """docs/fp8.md calls an entry that matches no Linear an error; it was one only on fp8 runs."""
    with pytest.raises(ConfigError) as e:
        validate_job(_cfg(f"--train.mixed_precision={precision}", "--float8.exclude_fqns=layers.0.mlp.gate"),
                     world_size=1)
    assert _one_line(e).startswith("float8.exclude_fqns entry 'layers.0.mlp.gate' matches no Linear layer")
    validate_job(_cfg(f"--train.mixed_precision={precision}", "--float8.exclude_fqns=layers.0.mlp"), world_size=1)


def test_profiling_window_after_the_last_step_is_refused() -> None:
    with pytest.raises(ConfigError) as e:
        _cfg("--profiling.enable=true", "--train.steps=2")  # the default window is steps 3-5
    assert _one_line(e).startswith("profiling.start_step=3 is after the run's last step (train.steps=2)")
    _cfg("--profiling.enable=true", "--train.steps=4")  # a window the run reaches, even cut short, is kept
    _cfg("--train.steps=2")  # profiling off: its window is not looked at
