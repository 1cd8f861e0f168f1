"""`python -m lora_ops.demo`: multi-LoRA generation on a real (tiny, random) HF Llama, checked against PEFT.

Builds a Llama-architecture model from a config (no download), creates PEFT LoRA adapters with different ranks,
alphas and target modules (nonzero B), saves them in PEFT format, loads them into an AdapterPool, and runs a
mixed batch (rows on different adapters and on the base model) through a prefill and greedy decode steps with
lora_ops and with PEFT's own mixed-adapter path (adapter_names=). Prints a parity verdict and tokens/s of both.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
import warnings

import torch

from . import backends
from .serving import AdapterPool, greedy_generate, patch_model
from .testing import TOLERANCE

ADAPTERS = {  # name -> PEFT LoraConfig keywords
    "sql": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "chat": dict(r=16, lora_alpha=16, use_rslora=True,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "code": dict(r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"], rank_pattern={"down_proj": 2},
                 alpha_pattern={"down_proj": 3}),
    "math": dict(r=32, lora_alpha=64, target_modules=["gate_proj", "up_proj", "down_proj"]),
}
BATCH = ["sql", "chat", None, "code", "math", "chat", None, "sql"]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--adapter-dir", default=None, help="where to write the PEFT adapters (default: a temp dir)")
    ap.add_argument("-v", "--verbose", action="store_true", default=os.environ.get("LORA_OPS_VERBOSE") == "1",
                    help="show library warnings and progress bars (also LORA_OPS_VERBOSE=1)")
    args = ap.parse_args(argv)
    try:
        from peft import LoraConfig, PeftModel, get_peft_model
        from tqdm import tqdm
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        print(f"the demo needs the [hf] extra (transformers, peft, safetensors, tqdm): {exc}")
        return 2
    if not args.verbose:  # peft 0.21 calls transformers 5 APIs that warn of their deprecation, mid progress bar
        warnings.filterwarnings("ignore", category=FutureWarning)
        import transformers
        transformers.logging.set_verbosity_error()
    bars = dict(file=sys.stdout, disable=None if args.verbose else True)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"lora_ops demo on {device} ({args.dtype}); sgmv served by "
          f"{'cpu' if device.type == 'cpu' else backends.cuda_served_by.get('sgmv')}")
    cfg = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    base = LlamaForCausalLM(cfg).eval()
    adapter_dir = args.adapter_dir or tempfile.mkdtemp(prefix="lora_ops_demo_")
    for name, kw in tqdm(ADAPTERS.items(), desc="creating PEFT adapters", **bars):
        get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **kw)).save_pretrained(
            os.path.join(adapter_dir, name))

    peft = PeftModel.from_pretrained(copy.deepcopy(base), os.path.join(adapter_dir, "sql"), adapter_name="sql")
    for name in list(ADAPTERS)[1:]:
        peft.load_adapter(os.path.join(adapter_dir, name), adapter_name=name)
    peft = peft.to(device, dtype).eval()
    ours = copy.deepcopy(base).to(device, dtype)
    pool = AdapterPool(ours, num_slots=len(ADAPTERS), max_rank=32)
    patch_model(ours, pool)
    for name in ADAPTERS:
        pool.load(name, os.path.join(adapter_dir, name))
    print(f"pool: {len(pool.modules)} target modules x {pool.num_slots} slots, adapters {pool.loaded}")

    ids = torch.randint(0, cfg.vocab_size, (len(BATCH), args.prompt_len), device=device)
    peft_names = [n or "__base__" for n in BATCH]
    for _ in range(2):  # warm-up (kernel compilation, caches), then timed
        bar = tqdm(total=args.new_tokens - 1, desc="lora_ops prefill + decode", leave=False, **bars)
        _sync(device)
        t0 = time.perf_counter()
        tokens, logits = greedy_generate(ours, pool, ids, BATCH, args.new_tokens, progress=bar)
        _sync(device)
        t_ours = time.perf_counter() - t0
        bar.close()
    with torch.no_grad():
        for _ in range(2):
            _sync(device)
            t0 = time.perf_counter()
            peft_tokens = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=peft_names,
                                        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                        do_sample=False, pad_token_id=0)
            _sync(device)
            t_peft = time.perf_counter() - t0
        ref = peft(tokens[:, :-1], adapter_names=peft_names).logits
    err = ((logits.double() - ref.double()).norm() / ref.double().norm()).item()
    same_tokens = torch.equal(tokens, peft_tokens)
    ok = err <= TOLERANCE[dtype]
    n_new = len(BATCH) * args.new_tokens
    print(f"mixed batch of {len(BATCH)} rows: {BATCH}")
    print(f"logits vs PEFT (prefill + {args.new_tokens - 1} decode steps): relative error {err:.2e} "
          f"(tolerance {TOLERANCE[dtype]:.0e}); greedy tokens {'identical' if same_tokens else 'differ'}")
    print(f"throughput: lora_ops {n_new / t_ours:8.1f} tokens/s   PEFT adapter_names {n_new / t_peft:8.1f} tokens/s "
          f"({t_peft / t_ours:.2f}x)")
    print("PARITY: PASS" if ok else "PARITY: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
