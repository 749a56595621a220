"""The long texts of docs/config.md: a key's whole story, where the docstring in code (what `--help` shows) is one
line. Keyed "section.key"; `python -m trainer.config --markdown` writes each in place of that key's docstring, and a
note that names no key is an error (tests/unit/test_config.py)."""

from __future__ import annotations

NOTES: dict[str, str] = {
    "model.flavor": (
        "Size preset, which also picks the family: dense debug, 1b, 3b, 8b, 70b, 405b (trainer/models/llama.py); MoE "
        "debug_moe, moe_small, moe_16b (trainer/models/moe.py). Every other [model] (and, for an MoE flavor, [moe]) "
        "key set replaces the flavor's value; a key left out keeps it."),
    "model.vocab_size": "Vocabulary size (128256 for the Llama 3 sizes, 512 for debug).",
    "model.norm_eps": "RMSNorm epsilon (1e-5 for every flavor).",
    "model.rope_theta": "RoPE base frequency (500000 for Llama 3, 1e6 for Qwen3).",
    "model.rope_scaling": (
        '"llama3": Llama 3.1\'s long-context frequency scaling (the rope_scaling_* keys; one of them set on a flavor '
        'without scaling turns it on too); "none": plain RoPE.'),
    "model.rope_scaling_factor": "Llama 3 RoPE scaling factor (8 for 3.1, 32 for 3.2); left out: the flavor's, or 8 "
                                 "where it has none.",
    "model.rope_scaling_low_freq_factor": "Llama 3 RoPE scaling low_freq_factor; left out: the flavor's, or 1.",
    "model.rope_scaling_high_freq_factor": "Llama 3 RoPE scaling high_freq_factor; left out: the flavor's, or 4.",
    "model.rope_scaling_original_max_seq_len": "The context the scaled RoPE was trained at; left out: the flavor's, "
                                               "or 8192.",
    "model.max_seq_len": "Positions of the RoPE table (a longer train.seq_len extends it, with a warning).",
    "model.head_dim": (
        "Each head's width, even (RoPE rotates pairs); 0 = dim / n_heads. Qwen3 sets it apart: 128 with dim=1024 and "
        "16 heads."),
    "model.ffn_dim": (
        "The MLP's hidden width; 0 = Llama's rule: 8/3 x dim, times ffn_dim_multiplier, rounded up to multiple_of. An "
        "MoE flavor's dense blocks take moe.dense_ffn_dim."),
    "model.tie_word_embeddings": (
        "One table for the embeddings and the output head (SmolLM2, Qwen3-0.6B, Llama 3.2 1B); no flavor ties. Not "
        "with pipeline or tensor parallel."),
    "model.qk_norm": (
        "RMSNorm over each head's q and k before RoPE (Qwen3, OLMo 2): steadier attention logits; no flavor has it."),
    "moe.route_norm": "Renormalize the chosen top_k scores to sum to 1 (no flavor does).",
}
