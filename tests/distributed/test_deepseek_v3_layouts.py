"""DeepSeek-V3 (MLA with YaRN RoPE, group-limited routing, an MTP module) in the layouts it takes reproduces the 1-process run:
FSDP2 (dp_shard=2), expert parallel (ep=2, with full activation checkpointing too), HSDP, context parallel (x expert
parallel), tensor parallel (x FSDP2) and pipeline parallel (1F1B, Interleaved1F1B, x cp, x tp, x ep: the last stage
holds the MTP module and a copy of the embeddings; x ep with the padded all-to-all too); without MTP modules,
pipeline x expert and x tensor parallel too.

Same seed, same global batch, fp32 on gloo: the loss (with the MTP term), each MTP depth's logged loss, the expert
loads of every MoE block (the MTP module's included), the held-out loss and every gradient after one step agree to
fp32 rounding; under tp, each rank's own gradients of MLA's replicated low-rank projections and norms too; under tp
and cp, each rank's embeddings ahead of the MTP modules, and with document masking; a pp=2 checkpoint with the MTP
module resumes in one process. Each layout
runs as a function in spawned processes (tests/distributed/spawn.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.spawn import gradients_of_one_step, run_distributed, train_and_read_metrics
from tests.distributed.test_token_mean import gradients_and_loss, write_short_documents
from tests.helpers import REPO, column, train

# YaRN RoPE on (DeepSeek-V3's, at an original context of 8 of the 32 positions, mscale apart from mscale_all_dim): its
# table under cp is indexed by global positions, its softmax factor scales each rank's queries.
YARN = ["--deepseek_v3.rope_yarn_factor=4", "--deepseek_v3.rope_yarn_original_max_seq_len=8",
        "--deepseek_v3.rope_yarn_mscale=0.8", "--deepseek_v3.rope_yarn_mscale_all_dim=1"]
ARGS = ["--config", str(REPO / "configs" / "train" / "debug_moe.toml"), "--model.flavor=debug_deepseek_v3",
        "--train.seq_len=32", "--train.mixed_precision=fp32", "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false", *YARN]
STEPS = ["--train.steps=3"]
VAL = ["--validation.enable=true", "--validation.freq=3", "--validation.steps=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return train([*ARGS, *STEPS, *VAL, "--train.batch_size=4"], tmp_path_factory.mktemp("ref"))


@pytest.mark.parametrize("nproc, args", [
    (2, ["--distributed.dp_shard=2", "--train.batch_size=2"]),
    (2, ["--distributed.ep=2", "--train.batch_size=2"]),
    (4, ["--distributed.dp_replicate=2", "--distributed.ep=2", "--train.batch_size=1",
         "--train.activation_checkpointing=full"]),
    # Each rank holds 2 of 4 chunks: an MTP module's embeddings ahead and targets cross into other ranks' chunks.
    (2, ["--distributed.cp=2", "--train.batch_size=4"]),
    (4, ["--distributed.cp=2", "--distributed.ep=2", "--train.batch_size=2"]),
    # Each rank holds a sequence shard: the embeddings ahead cross into the next shard, looked up from whole ids.
    (2, ["--distributed.tp=2", "--train.batch_size=4"]),
    (4, ["--distributed.tp=2", "--distributed.dp_shard=2", "--train.batch_size=2"]),
    # The last stage holds the MTP module and a copy of the embeddings (their gradients summed with the first's).
    (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=1F1B", "--train.batch_size=4"]),
    (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=Interleaved1F1B", "--train.batch_size=4"]),
], ids=["fsdp2", "ep2", "hsdp-x-ep2-full-ac", "cp2", "cp2-x-ep2", "tp2", "tp2-x-fsdp2", "pp2-1f1b", "pp2-interleaved"])
def test_deepseek_v3_layout_matches_single_process(nproc: int, args: list[str], reference, tmp_path: Path) -> None:
    got = run_distributed(train_and_read_metrics, world_size=nproc, args=([*ARGS, *STEPS, *VAL, *args],
                                                                           str(tmp_path)))[0]
    assert column(got, "step") == column(reference, "step") == [1, 2, 3]
    for key in ("loss", "mtp_loss_1", "moe/layer1/imbalance", "moe/layer3/imbalance", "moe/layer4/imbalance"):
        assert column(got, key) == pytest.approx(column(reference, key), rel=1e-5), key
    assert column(got, "grad_norm") == pytest.approx(column(reference, "grad_norm"), rel=1e-4)
    val = [r["val_loss"] for r in got if "val_loss" in r]
    assert val and val == pytest.approx([r["val_loss"] for r in reference if "val_loss" in r], rel=1e-5)


@pytest.mark.parametrize("nproc, args", [(2, ["--distributed.dp_shard=2", "--train.batch_size=2"]),
                                         (2, ["--distributed.ep=2", "--train.batch_size=2"]),
                                         (2, ["--distributed.cp=2", "--train.batch_size=4"]),
                                         (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=1F1B",
                                              "--train.batch_size=4"]),
                                         (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=Interleaved1F1B",
                                              "--train.batch_size=4"]),
                                         # The last stage's ids ahead cross into the other cp rank's chunks.
                                         (4, ["--distributed.pp=2", "--distributed.cp=2", "--train.batch_size=4"]),
                                         # Its ids ahead cross into the other tp rank's sequence shard.
                                         (4, ["--distributed.pp=2", "--distributed.tp=2", "--train.batch_size=4"]),
                                         # The last stage's MTP module routes its tokens to the other ep rank's
                                         # experts; its embeddings' copy sums with the first stage's.
                                         (4, ["--distributed.pp=2", "--distributed.ep=2", "--train.batch_size=2"]),
                                         # The same with the padded all-to-all (fixed slots, no host sync).
                                         (4, ["--distributed.pp=2", "--distributed.ep=2", "--train.batch_size=2",
                                              "--moe.dispatch=padded"])],
                         ids=["fsdp2", "ep2", "cp2", "pp2-1f1b", "pp2-interleaved", "pp2-x-cp2", "pp2-x-tp2",
                              "pp2-x-ep2", "pp2-x-ep2-padded"])
def test_every_deepseek_v3_gradient_matches_single_process(nproc: int, args: list[str], tmp_path: Path) -> None:
    ref = run_distributed(gradients_of_one_step, world_size=1, args=([*ARGS, "--train.batch_size=4"],
                                                                      str(tmp_path / "ref")))[0]
    got = run_distributed(gradients_of_one_step, world_size=nproc, args=([*ARGS, *args], str(tmp_path / "got")))[0]
    assert got.keys() == ref.keys()
    for fqn, g in ref.items():
        err = ((got[fqn] - g).norm() / g.norm().clamp(min=1e-30)).item()
        assert err < 1e-5, (fqn, err)
    # The MTP module trains: its projection, attention and experts have gradients, here and in every layout.
    assert ref["layers.4.eh_proj.weight"].norm() > 0 and ref["layers.4.attention.kv_b_proj.weight"].norm() > 0


NO_MTP = ["--deepseek_v3.mtp_layers=0"]


@pytest.fixture(scope="module")
def reference_without_mtp(tmp_path_factory) -> list[dict]:
    return train([*ARGS, *NO_MTP, *STEPS, *VAL, "--train.batch_size=4"], tmp_path_factory.mktemp("ref_no_mtp"))


@pytest.mark.parametrize("nproc, args", [
    (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=1F1B", "--train.batch_size=4"]),
    (4, ["--distributed.pp=2", "--distributed.ep=2", "--train.batch_size=2"]),
    (2, ["--distributed.cp=2", "--train.batch_size=4"]),
    (2, ["--distributed.tp=2", "--train.batch_size=4"]),
    (4, ["--distributed.tp=2", "--distributed.dp_shard=2", "--train.batch_size=2"]),
    (4, ["--distributed.pp=2", "--distributed.tp=2", "--train.batch_size=4"]),
], ids=["pp2-1f1b", "pp2-x-ep2", "cp2", "tp2", "tp2-x-fsdp2", "pp2-x-tp2"])
def test_deepseek_v3_without_mtp_in_pp_and_cp_matches_single_process(nproc: int, args: list[str],
                                                                     reference_without_mtp, tmp_path: Path) -> None:
    ref = reference_without_mtp
    got = run_distributed(train_and_read_metrics, world_size=nproc,
                          args=([*ARGS, *NO_MTP, *STEPS, *VAL, *args], str(tmp_path)))[0]
    assert column(got, "step") == column(ref, "step") == [1, 2, 3]
    for key in ("loss", "moe/layer1/imbalance", "moe/layer3/imbalance"):
        assert column(got, key) == pytest.approx(column(ref, key), rel=1e-5), key
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-4)
    val = [r["val_loss"] for r in got if "val_loss" in r]
    assert val and val == pytest.approx([r["val_loss"] for r in ref if "val_loss" in r], rel=1e-5)


def gradients_of_every_rank(args: list[str], dump: str) -> dict:
    """gradients_of_one_step's, with each rank's own gradients of the parameters replicated over tp (MLA's low-rank
    projections and norms) beside them: {"all": the full gradients, "replicated": [rank -> {fqn: local grad}]}."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    from tests.distributed.spawn import gathered_gradients
    from trainer.config import load_job_config
    from trainer.distributed import destroy_distributed
    from trainer.models.layers import clean_fqn
    from trainer.run.train import build_trainer

    trainer = build_trainer(load_job_config([*args, f"--job.dump_folder={dump}"]))
    try:
        trainer.step_fn.forward_backward(trainer.data_loader.next_batch())
        replicated = {clean_fqn(n): p.grad.full_tensor().detach().clone() for n, p in trainer.model.named_parameters()
                      if isinstance(p.grad, DTensor) and "_a_" in n
                      and p.grad.placements[p.grad.device_mesh.mesh_dim_names.index("tp")] == Replicate()}
        per_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, replicated)
        return {"all": gathered_gradients(trainer.model), "replicated": per_rank}
    finally:
        trainer.close()
        destroy_distributed()


@pytest.mark.parametrize("q_lora_rank, mtp, compiled", [(64, True, False), (0, False, False), (64, True, True)],
                         ids=["q-lora-mtp", "plain-q-proj", "q-lora-mtp-compile"])
def test_every_deepseek_v3_gradient_under_tp_matches_single_process(q_lora_rank: int, mtp: bool, compiled: bool,
                                                                    tmp_path: Path) -> None:
    """MLA's replicated low-rank projections and norms get the whole gradient on every tp rank: their column-parallel
    successors (and the shared RoPE key) sum the input gradients over tp, so no rank holds only its heads' share. The
    MTP module's embeddings ahead cross the tp ranks' sequence shards. Compiled blocks against one eager process: the
    embeddings' gradient was zeros (docs/distributed.md#compile-under-tensor-parallel)."""
    args = [*ARGS, *([] if mtp else NO_MTP), f"--deepseek_v3.q_lora_rank={q_lora_rank}"]
    ref = run_distributed(gradients_of_one_step, world_size=1, args=([*args, "--train.batch_size=4"],
                                                                      str(tmp_path / "ref")))[0]
    layout = ["--distributed.tp=2", "--train.batch_size=4", *(["--train.compile_model=true"] if compiled else [])]
    got = run_distributed(gradients_of_every_rank, world_size=2, args=([*args, *layout], str(tmp_path / "got")))
    grads, per_rank = got[0]["all"], got[0]["replicated"]
    assert grads.keys() == ref.keys()
    for fqn, g in ref.items():
        err = ((grads[fqn] - g).norm() / g.norm().clamp(min=1e-30)).item()
        assert err < 1e-5, (fqn, err)
    low_rank = {"kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"} | (
        {"q_a_proj.weight", "q_a_layernorm.weight"} if q_lora_rank else set())
    assert {fqn.split("attention.")[1] for fqn in per_rank[0]} == low_rank
    assert ("layers.4.eh_proj.weight" in ref) == mtp
    for rank, grads_of_rank in enumerate(per_rank):
        for fqn, g in grads_of_rank.items():
            err = ((g - ref[fqn]).norm() / ref[fqn].norm()).item()
            assert err < 1e-5, (rank, fqn, err)


def embeddings_ahead_error(args: list[str], dump: str) -> float:
    """The largest difference, on this rank, between the MTP module's embeddings ahead that the model looks up in
    its layout (DeepseekV3.embed_ahead) and this rank's part of the whole sequences' shifted embeddings, zero rows
    past the end (trainer.models.mtp.embeddings_ahead)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from trainer.config import load_job_config
    from trainer.distributed import destroy_distributed
    from trainer.models.mtp import embeddings_ahead
    from trainer.run.train import build_trainer

    trainer = build_trainer(load_job_config([*args, f"--job.dump_folder={dump}"]))
    try:
        model, (tokens, _) = trainer.model, trainer.data_loader.next_batch()[0]
        cp = model.cp
        with torch.no_grad():
            weight = model.tok_embeddings.weight
            table = weight.full_tensor() if isinstance(weight, DTensor) else weight
            want = embeddings_ahead(F.embedding(tokens, table), 2)
            local = tokens if cp is None else cp.shard(tokens)
            got = model.embed_ahead(local, 2)[1]
        if cp is not None:
            want = [cp.shard(w) for w in want]
        elif model.tp_group is not None:  # this rank's sequence shard
            size = got[0].shape[1]
            start = torch.distributed.get_rank(model.tp_group) * size
            want = [w[:, start:start + size] for w in want]
        assert [g.shape for g in got] == [w.shape for w in want]
        return max((g - w).abs().max().item() for g, w in zip(got, want))
    finally:
        trainer.close()
        destroy_distributed()


@pytest.mark.parametrize("layout", [["--distributed.tp=2"], ["--distributed.cp=2"]], ids=["tp2", "cp2"])
def test_the_embeddings_ahead_of_each_rank_are_the_whole_sequences_shifted(layout: list[str], tmp_path: Path) -> None:
    """Two MTP depths: each rank's Emb(t_{i+k}) reach into the next rank's shard or chunk, and are zero past the end
    (which neither loss nor gradients see: those positions have no target)."""
    errors = run_distributed(embeddings_ahead_error, world_size=2,
                             args=([*ARGS, *layout, "--deepseek_v3.mtp_layers=2", "--train.batch_size=4"],
                                   str(tmp_path)))
    assert errors == [0.0, 0.0]


@pytest.mark.parametrize("layout", [["--distributed.tp=2"], ["--distributed.cp=2"]], ids=["tp2", "cp2"])
def test_mtp_with_document_masking_matches_single_process(layout: list[str], tmp_path: Path) -> None:
    """Under document masking the RoPE rows and masks are the tokens' own, not the stacked ids ahead's: the MTP
    module's embeddings ahead ride in the tokens' lookup (tp: whole rows on every rank; cp: the rows' documents)."""
    folder = write_short_documents(tmp_path, seed=1)
    args = [*ARGS, "--train.seq_len=64", "--data.source=shards", f"--data.path={folder}",
            "--data.document_masking=true", "--train.batch_size=4"]
    ref_grads, ref_loss, _ = run_distributed(gradients_and_loss, world_size=1, args=(args, str(tmp_path / "ref")))[0]
    grads, loss, _ = run_distributed(gradients_and_loss, world_size=2,
                                     args=([*args, *layout], str(tmp_path / "got")))[0]
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert grads.keys() == ref_grads.keys() and "layers.4.eh_proj.weight" in grads
    errors = {fqn: ((grads[fqn] - g).norm() / g.norm().clamp(min=1e-30)).item() for fqn, g in ref_grads.items()}
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


def test_a_pp2_checkpoint_with_mtp_resumes_in_one_process(reference, tmp_path: Path) -> None:
    """Both pipeline ends save `tok_embeddings.weight` (the first stage's table, the last stage's copy for the MTP
    module) and its optimizer state: equal tensors under one name, which one process loads as its one table. The
    pp=2 run's Hugging Face export holds the checkpoint's weights, the MTP module left out."""
    from tests.distributed.spawn import train_then_one_process
    from trainer.checkpoint import load_full_model_weights
    from trainer.hf import read_hf_config, read_hf_weights

    ckpt = ["--checkpoint.enable=true", "--checkpoint.interval=2", "--train.batch_size=4"]
    _, resumed = run_distributed(train_then_one_process, world_size=2, args=(
        [*ARGS, "--train.steps=2", "--distributed.pp=2", "--distributed.pipeline_schedule=1F1B", *ckpt,
         "--checkpoint.model_only=true", "--checkpoint.export_dtype=float32"],
        [*ARGS, *STEPS, *VAL, *ckpt], str(tmp_path), "a", "a"))[0]
    _, weights = load_full_model_weights(tmp_path / "a" / "checkpoint" / "step-2")
    folder = tmp_path / "a" / "checkpoint" / "step-2-hf"
    exported = read_hf_weights(folder, args=read_hf_config(folder))
    assert sorted(exported) == sorted(k for k in weights if not k.startswith("layers.4."))
    assert all(torch.equal(exported[k], weights[k]) for k in exported)
    assert column(resumed, "step") == [1, 2, 3]
    for key in ("loss", "mtp_loss_1", "grad_norm"):
        assert column(resumed, key) == pytest.approx(column(reference, key), rel=1e-4), key
    assert [r["val_loss"] for r in resumed if "val_loss" in r] == pytest.approx(
        [r["val_loss"] for r in reference if "val_loss" in r], rel=1e-5)
