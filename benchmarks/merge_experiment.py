"""Does merging a batch's single adapter into the base weights ("dynamic merge", docs/design.md §8) pay?

For a batch whose rows all use one adapter, times greedy decoding through the sgmv path against decoding with
W' = W + s·B·A merged into every target layer (merge and unmerge included), and measures how far the base weights
drift after merge/unmerge cycles in the model's dtype. Prints a verdict; results go in lora_ops/NOTES.md.
"""
import argparse
import copy
import os
import tempfile
import time

import torch

from lora_ops.serving import AdapterPool, greedy_generate, patch_model


def merged_delta(pool, name):
    """{module: (base nn.Linear, s·B·A)} for adapter `name`, from the pool's own stacked weights."""
    slot = pool.slot(name)
    out = {}
    for m in pool.modules.values():
        r = int(m.ranks[slot])
        if r == 0:
            continue
        delta = torch.zeros(m.out_features, m.in_features, dtype=torch.float32, device=m.lora_a.device)
        R = pool.max_rank
        for s in range(len(m.slice_names)):
            lo, hi = m.slice_offsets[s], m.slice_offsets[s + 1]
            delta[lo:hi] = m.lora_b[slot, lo:hi, :r].float() @ m.lora_a[slot, s * R:s * R + r].float()
        out[m.name] = delta * float(m.scales[slot])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2)
    base = LlamaForCausalLM(cfg).eval()
    d = tempfile.mkdtemp()
    get_peft_model(copy.deepcopy(base), LoraConfig(r=16, lora_alpha=16, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])).save_pretrained(os.path.join(d, "a"))
    model = base.to(device, dtype)
    pool = AdapterPool(model, num_slots=2, max_rank=16)
    patch_model(model, pool)
    pool.load("a", os.path.join(d, "a"))
    ids = torch.randint(0, 4096, (8, 16), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn):
        fn()
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        return time.perf_counter() - t0, out

    t_lora, _ = timed(lambda: greedy_generate(model, pool, ids, ["a"] * 8, args.steps))
    deltas = merged_delta(pool, "a")
    layers = {n: model.get_submodule(n).base for n in deltas}
    original = {n: l.weight.detach().clone() for n, l in layers.items()}

    def merge(sign):
        for n, l in layers.items():
            l.weight.data = (l.weight.float() + sign * deltas[n]).to(dtype)

    t_merge, _ = timed(lambda: (merge(+1), merge(-1)))
    merge(+1)
    t_merged, _ = timed(lambda: greedy_generate(model, pool, ids, [None] * 8, args.steps))
    merge(-1)
    drift = max(((l.weight.float() - original[n].float()).abs().max() / original[n].float().abs().max()).item()
                for n, l in layers.items())
    for _ in range(9):
        merge(+1)
        merge(-1)
    drift10 = max(((l.weight.float() - original[n].float()).abs().max() / original[n].float().abs().max()).item()
                  for n, l in layers.items())
    tokens = 8 * args.steps
    print(f"{device} {args.dtype}: sgmv path {tokens / t_lora:.0f} tok/s | merged {tokens / t_merged:.0f} tok/s "
          f"+ merge/unmerge {t_merge * 1e3:.2f} ms (pays after {t_merge / max(t_lora - t_merged, 1e-9) * args.steps:.0f} "
          f"steps if positive) | base-weight drift after 1 cycle {drift:.2e}, after 10 cycles {drift10:.2e} (max rel)")


if __name__ == "__main__":
    main()
