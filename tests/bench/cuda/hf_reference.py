"""Issue 40's parity reference, made on the GPU host: random Llama and Qwen2
models built by transformers (`from_config`, then `save_pretrained` in bf16,
nothing downloaded) and the logits and greedy tokens transformers computes
for them on that GPU in bf16.

    python3 hf_reference.py OUT

writes OUT/<case>/ (config.json, model.safetensors) and OUT/reference.json in
the parity fixtures' format (engine/tests/fixtures/parity/make_fixture.py,
whose config, weight initialisation and logits it reuses): per case the prompt, the
prompt's last logits, and DECODE_STEPS greedy steps, each the token fed and
the logits after it. Every row is a full forward over the whole sequence (no
KV cache), eager attention, bf16 weights and activations on the GPU.
engine/tests/cuda_gpu.rs (`transformers_on_the_same_gpu_match_within_bf16`)
checks Sluice's GPU backend against it.
"""

import importlib.util
import json
import pathlib
import shutil
import sys

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ROOT = pathlib.Path(__file__).resolve().parents[3]
SEED = 20261129
PROMPT_LEN = 24
DECODE_STEPS = 32

_spec = importlib.util.spec_from_file_location(
    "make_fixture", ROOT / "engine/tests/fixtures/parity/make_fixture.py"
)
make_fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixture)

# What both cases share: 4 layers, GQA 8 query heads over 2 kv heads of 64.
SHAPE = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)

CASES = {
    # Llama: untied, Llama 3's RoPE base.
    "llama_gpu": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(SHAPE, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    ),
    # Qwen2: q/k/v biases, tied embeddings.
    "qwen2_gpu": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(SHAPE, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    ),
}


def main(out):
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reference = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "dtype": "bfloat16",
        "prompt_len": PROMPT_LEN,
        "decode_steps": DECODE_STEPS,
        "cases": {},
    }
    for i, (name, (config_cls, model_cls, kwargs)) in enumerate(CASES.items()):
        generator = torch.Generator().manual_seed(SEED + i)
        config = make_fixture.make_config(config_cls, kwargs)
        model = model_cls(config).to(torch.float32).eval()
        make_fixture.reinit(model, generator)
        model = model.to(torch.bfloat16)
        case_dir = out / name
        if case_dir.exists():
            shutil.rmtree(case_dir)
        model.save_pretrained(case_dir, safe_serialization=True)
        (case_dir / "generation_config.json").unlink(missing_ok=True)
        model = model.to("cuda")
        prompt = torch.randint(4, config.vocab_size, (PROMPT_LEN,), generator=generator).tolist()
        ids = list(prompt)
        prefill = make_fixture.last_logits(model, ids)
        steps = []
        token = int(torch.argmax(prefill))
        for _ in range(DECODE_STEPS):
            ids.append(token)
            logits = make_fixture.last_logits(model, ids)
            steps.append({"token": token, "logits": logits.tolist()})
            token = int(torch.argmax(logits))
        reference["cases"][name] = {
            "cache_consistent": True,
            "prompt": prompt,
            "prefill_logits": prefill.tolist(),
            "decode": steps,
        }
        print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"greedy {[s['token'] for s in steps][:8]}...")
        del model
        torch.cuda.empty_cache()
    (out / "reference.json").write_text(json.dumps(reference))


if __name__ == "__main__":
    main(sys.argv[1])
