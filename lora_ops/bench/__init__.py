"""`python -m lora_ops.bench`: the op bench (sgmv and build_segments on every backend against baselines) and
`--decode-step`, the LoRA overhead of a whole model's decode step (docs/design.md §6). See ops.py and
decode_step.py; results go to JSON/CSV/PNG under benchmarks/results/, and report.py renders the README table."""
