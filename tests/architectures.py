"""Tiny random models of many transformers architectures, saved as transformers saves them.

Each entry is a model type and the config fields that make it small (2 layers, hidden 128, every
matrix's column count a multiple of the default group of 128). Experts get weights large enough
that routing differs between tokens. The tokenizer is the trained fixture's (4096 tokens), so
the command line can calibrate on text.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

SMALL = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=4096, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
MOE = dict(num_experts_per_tok=2)
EXPERT_MLP = dict(moe_intermediate_size=128)  # for the families whose config has that field
MLA = dict(kv_lora_rank=128, q_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, num_key_value_heads=4)

DENSE = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 32},
    "gemma": {"head_dim": 32},
    "gemma2": {"head_dim": 32},
    "gemma3_text": {"head_dim": 32},
    "phi": {"num_key_value_heads": 4},
    "phi3": {},
    "gpt_neox": {"num_key_value_heads": 4},
    "gptj": {"n_embd": 128, "n_layer": 2, "n_head": 4, "rotary_dim": 16, "n_positions": 256},
    "opt": {"ffn_dim": 256, "word_embed_proj_dim": 128},
    "falcon": {"num_kv_heads": 1, "new_decoder_architecture": False, "multi_query": True},
    "bloom": {"n_head": 4, "n_layer": 2},
    "stablelm": {},
    "starcoder2": {},
    "olmo2": {},
    "cohere": {},
    "granite": {},
    "gpt2": {"n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 256},
    "openai-gpt": {"n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 256},
}
EXPERTS = {
    "mixtral": {"num_local_experts": 4},
    "qwen2_moe": {"num_experts": 4, "shared_expert_intermediate_size": 128, **EXPERT_MLP},
    "qwen3_moe": {"num_experts": 4, **EXPERT_MLP},
    "olmoe": {"num_experts": 4, "intermediate_size": 128},
    "phimoe": {"num_local_experts": 4},
    "deepseek_v3": {"n_routed_experts": 4, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, **MLA, **EXPERT_MLP},
    "glm4_moe": {"n_routed_experts": 4, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, **EXPERT_MLP},
    "gpt_oss": {"num_local_experts": 4, "intermediate_size": 128, "head_dim": 32},
    "granitemoe": {"num_local_experts": 4, "intermediate_size": 128},
}
#: where transformers (+ compressed-tensors) cannot read a compressed checkpoint, and why
TRANSFORMERS_CANNOT = {
    # transformers keeps these experts fused in checkpoints too and has no per-expert layout to
    # read quantized experts from; llmpress saves them per expert, as llm-compressor does
    "gpt_oss": "experts fused in transformers' checkpoint layout",
    "granitemoe": "experts fused in transformers' checkpoint layout",
    # FalconPreTrainedModel._init_weights reads FalconLinear.weight, which compressed-tensors'
    # packed module no longer has
    "falcon": "transformers' Falcon init fails on packed FalconLinear",
}
#: where transformers reads a compressed checkpoint only with ``CompressedTensorsConfig(dequantize=True)``
TRANSFORMERS_DEQUANTIZES = {
    # compressed-tensors' compressed route initializes nn.Linear only; Conv1D keeps its own layout
    "gpt2": "Conv1D: read with dequantize=True (transformers >= 5.24)",
    "openai-gpt": "Conv1D: read with dequantize=True (transformers >= 5.24)",
}
ENCODERS = {"bert": {"intermediate_size": 256}}
#: vision-language models: a text stack calibrated on text alone, a vision tower it never runs
VISION = {
    "llava": {"text_config": {"model_type": "llama", **SMALL}, "image_token_index": 4000,
              "vision_config": {"model_type": "clip_vision_model", "hidden_size": 128, "intermediate_size": 256,
                                "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8}},
    "qwen2_vl": {"text_config": {"model_type": "qwen2_vl_text", **SMALL, "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}},
                 "vision_config": {"depth": 2, "embed_dim": 128, "hidden_size": 128, "num_heads": 2, "mlp_ratio": 2,
                                   "patch_size": 14, "spatial_merge_size": 2},
                 "image_token_id": 4000, "video_token_id": 4001, "vision_start_token_id": 4002},
}

ARCHITECTURES = {**DENSE, **{k: {**MOE, **v} for k, v in EXPERTS.items()}, **ENCODERS, **VISION}


RECIPE = """
quant_stage:
  quant_modifiers:
    {modifier}:
      scheme: W4A16
      targets: [Linear]
      ignore: [lm_head, "re:.*mlp\\\\.gate$", "re:.*router$", "re:.*shared_expert_gate$", "re:.*vision_tower.*", "re:.*visual.*",
               "re:.*multi_modal_projector.*"]
"""
#: matrices a W4A16 recipe leaves dense: embeddings, the head, routers (not Linear in transformers 5)
#: and a vision-language model's vision tower and projector: its text stack is calibrated on
#: text, and the recipe leaves the vision side dense, as llm-compressor's examples do
DENSE_ALLOWED = re.compile(r"(embed|wte|wpe|lm_head|embed_out|router|\.gate\.|shared_expert_gate|position|token_type"
                           r"|vision_tower|visual|multi_modal_projector)")

def auto_class(model_type: str):
    """The Auto class a user loads ``model_type`` with."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModel if model_type in ENCODERS else AutoModelForImageTextToText if model_type in VISION else AutoModelForCausalLM


def save_tiny(model_type: str, folder: Path, tokenizer_from: Path | None = None, seed: int = 0) -> Path:
    """Build the tiny model of ``model_type`` and save it (and the tokenizer) to ``folder``."""
    from transformers import AutoConfig

    torch.manual_seed(seed)
    fields = ARCHITECTURES[model_type] if model_type in VISION else {**SMALL, **ARCHITECTURES[model_type]}
    config = AutoConfig.for_model(model_type, **fields)
    model = auto_class(model_type).from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 3 or "router" in name or name.endswith("mlp.gate.weight"):
                parameter.normal_(0, 0.05)  # experts and routers that tell tokens apart
    model.save_pretrained(folder)
    if tokenizer_from is not None:
        for file in tokenizer_from.glob("tokenizer*"):
            shutil.copy(file, folder / file.name)
    return folder
