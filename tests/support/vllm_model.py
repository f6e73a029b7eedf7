"""The made-up model vLLM runs on the simulated GPU (tests/clients/test_vllm.py,
benchmarks/bench_vllm.py): a Llama config.json and nothing else. vLLM makes up its weights
(load_format="dummy") and runs without a tokenizer (skip_tokenizer_init, prompts as token ids),
so nothing is fetched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# One made-up Llama for every test and benchmark (the OOM test scales it up): bf16, 2 layers,
# a 32k vocabulary.
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_model(d: Path, **overrides: Any) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(dict(MODEL, **overrides)))
    return d
