"""Sampling from a trained model (what scripts/generate.py runs), from a checkpoint or an export:

    from trainer.checkpoint import load_model
    from trainer.models.generate import generate
    model = load_model("outputs/run/checkpoint")                 # the latest checkpoint, or an export folder
    new_ids = generate(model, prompt_ids, max_new_tokens=64, temperature=0.8, top_k=50, seed=0)

No KV cache: every new token reruns the forward over the context (at most the model's RoPE
table: the run's sequence length, or the export's max_position_embeddings). That is what a
short sample needs; for serving, export and use transformers (docs/checkpointing.md).
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], *, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             eos_id: int | None = None, seed: int = 0) -> list[int]:
    """The ids that follow `prompt` (not empty), stopping after `eos_id`; temperature 0 = greedy (argmax).

    Sampling draws from softmax(logits / temperature), restricted to the top_k most likely ids
    when top_k > 0, with a generator seeded by `seed` (the same seed gives the same text).
    """
    assert prompt, "the prompt needs at least one token"
    device = model.rope.device
    context = model.rope.shape[0]
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-context:]], device=device)  # the last `context` tokens: RoPE's table ends there
        logits = model.logits(window)[0, -1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = int(torch.multinomial(logits.softmax(dim=-1), 1, generator=gen))
        ids.append(token)
        new.append(token)
        if token == eos_id:
            break
    return new
