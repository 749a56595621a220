"""FP8 for DeepSeek-V3 (trainer/parallel/float8/linear.py's rules): every MLA projection and the MTP projection
convert, the router and the shared experts stay bf16 as in every MoE model, a low-rank width that is not a multiple
of 16 keeps its GEMMs bf16 with the reason in the report (fp8_layers.json); and the converted model trains on CPU
(torch._scaled_mm and torchao's emulation) close to bf16."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.models.deepseek_v3 import FLAVORS, DeepseekV3
from trainer.parallel.float8 import Float8Options, apply_float8

MLA_PROJ = ("attention.q_a_proj", "attention.q_b_proj", "attention.kv_a_proj_with_mqa", "attention.kv_b_proj",
            "attention.o_proj")


def _model(**changes) -> DeepseekV3:
    args = replace(FLAVORS["debug_deepseek_v3"], n_layers=2, max_seq_len=32, **changes)
    model = DeepseekV3(args)
    model.init_weights(seed=0)
    return model


def test_mla_and_mtp_projections_convert_and_the_router_and_shared_experts_stay_bf16() -> None:
    model = _model()
    report = apply_float8(model, Float8Options(recipe="tensorwise"), device=torch.device("cpu"))
    expected = {f"layers.{i}.{p}" for i in (0, 1, 2) for p in MLA_PROJ} | {
        f"layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")} | {"layers.2.eh_proj", "output_head.proj"}
    assert set(report.linears.converted) == expected
    excluded = report.linears.excluded
    assert excluded["layers.1.moe.router.gate"] == excluded["layers.2.moe.router.gate"] == "MoE router"
    assert excluded["layers.2.moe.shared_expert.up_proj"] == "MoE shared expert"


def test_low_rank_widths_not_a_multiple_of_16_stay_bf16_with_the_reason() -> None:
    # kv_lora_rank=40: kv_a_proj_with_mqa is 128 -> 40 + 16 and kv_b_proj 40 -> ...; q_lora_rank=24: q_a and q_b.
    model = _model(kv_lora_rank=40, q_lora_rank=24, mtp_layers=0)
    report = apply_float8(model, Float8Options(recipe="tensorwise"), device=torch.device("cpu"))
    excluded = report.linears.excluded
    assert excluded["layers.0.attention.kv_a_proj_with_mqa"] == "shape 128x56 not divisible by 16"
    assert excluded["layers.0.attention.kv_b_proj"] == "shape 40x256 not divisible by 16"
    assert excluded["layers.1.attention.q_a_proj"] == "shape 128x24 not divisible by 16"
    assert excluded["layers.1.attention.q_b_proj"] == "shape 24x192 not divisible by 16"
    assert {"layers.0.attention.o_proj", "layers.1.attention.o_proj"} <= set(report.linears.converted)
    # Blockwise (1x128 / 128x128 tiles) keeps every MLA GEMM of the debug widths bf16 but none of 128's multiples.
    blockwise = apply_float8(_model(mtp_layers=0), Float8Options(recipe="blockwise", emulate=True),
                             device=torch.device("cpu"))
    assert "layers.0.attention.kv_a_proj_with_mqa" in blockwise.linears.excluded


@pytest.mark.parametrize("recipe, emulate", [("tensorwise", False), ("blockwise", True)])
def test_a_converted_deepseek_v3_trains_close_to_bf16_on_cpu(recipe: str, emulate: bool) -> None:
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = tokens.roll(-1, dims=1)
    grads, losses = [], []
    # Widths that are multiples of 128 (q_b 128 -> 4 x 64, kv_b 128 -> 4 x (48 + 16)), so blockwise converts them too.
    for convert in (False, True):
        model = _model(q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=48, v_head_dim=16, mtp_layers=0)
        model = model.to(torch.bfloat16)
        if convert:
            report = apply_float8(model, Float8Options(recipe=recipe, emulate=emulate), device=torch.device("cpu"))
            assert {"layers.1.attention.q_b_proj", "layers.1.attention.kv_b_proj"} <= set(report.linears.converted)
        loss = torch.nn.functional.cross_entropy(model.logits(tokens).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append(model.layers["1"].attention.kv_b_proj.weight.grad.float())
    assert losses[1] != losses[0] and losses[1] == pytest.approx(losses[0], rel=2e-2)
    assert ((grads[1] - grads[0]).norm() / grads[0].norm()).item() < 0.2
