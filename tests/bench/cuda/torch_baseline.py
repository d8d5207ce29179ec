"""Issue 40's limits and peer, measured on the GPU host in the device run:
the device's copy bandwidth and bf16 dense peak through PyTorch, and
transformers' own `generate` and prefill on a random model of Llama-3-8B's
shape (made on the GPU by `from_config`, bf16; nothing downloaded).

    python3 torch_baseline.py OUT.json

Copy bandwidth counts bytes read + written, as Sluice's
`CudaBackend::copy_bandwidth` does. `generate` runs greedy with a static KV
cache (transformers' fastest cache that needs no compile step here) at
batch 1 from a CONTEXT-token prompt; its decode rate is the new tokens over
the time past the prompt's own forward pass.
"""

import json
import sys
import time

import torch
import transformers
from hf_reference import make_fixture
from transformers import LlamaConfig, LlamaForCausalLM

CONTEXT = 256
NEW_TOKENS = 128


def timed(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def copy_bandwidth():
    n = (1 << 30) // 4
    src = torch.empty(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    secs = timed(lambda: dst.copy_(src), 10)
    return 2 * 4 * n / secs


def bf16_peak():
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    secs = timed(lambda: a @ b, 10, warmup=3)
    return 2 * n**3 / secs


def llama_8b():
    # The parity fixtures' config maker puts the RoPE base where the
    # installed transformers keeps it; its fastest attention here.
    config = make_fixture.make_config(
        LlamaConfig,
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=128000,
            eos_token_id=[128001, 128009],
        ),
        attn_implementation="sdpa",
    )
    torch.manual_seed(8)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(config).eval()
        torch.set_default_dtype(torch.float32)
    return model


def main(path):
    out = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
    }
    out["copy_bandwidth_bytes_per_s"] = copy_bandwidth()
    out["bf16_dense_flops_per_s"] = bf16_peak()
    print(f"copy {out['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, "
          f"bf16 {out['bf16_dense_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    start = time.perf_counter()
    model = llama_8b()
    out["model_init_s"] = time.perf_counter() - start
    vocab = model.config.vocab_size
    prompt = torch.randint(4, vocab, (1, CONTEXT), device="cuda")
    with torch.no_grad():
        prompt_secs = timed(lambda: model(prompt, use_cache=False), 3, warmup=1)
        for tokens in (512, 2048):
            ids = torch.randint(4, vocab, (1, tokens), device="cuda")
            out[f"prefill_{tokens}_ms"] = 1e3 * timed(lambda: model(ids, use_cache=False), 3, warmup=1)

        def generate():
            return model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                cache_implementation="static",
                pad_token_id=0,
            )

        secs = timed(generate, 2, warmup=1)
    out["generate"] = {
        "batch": 1,
        "context": CONTEXT,
        "new_tokens": NEW_TOKENS,
        "cache": "static",
        "total_s": secs,
        "decode_tokens_per_s": NEW_TOKENS / max(secs - prompt_secs, 1e-9),
    }
    print(json.dumps(out, indent=1), flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
