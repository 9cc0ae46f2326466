"""The families qerl runs, one file each (model/family.py says what a description holds).

Adding a family: a file here with its `FAMILY` (derived from the closest family), its name in FAMILIES
below, and its test (tests/test_families.py: engine greedy tokens equal Hugging Face generate on a tiny
random model); docs/adding-a-family.md says each step.
"""

from . import gemma3, gpt_oss, llama, mistral, mixtral, olmo2, olmo3, phi3, qwen2, qwen3, qwen3_moe

FAMILIES = tuple(m.FAMILY for m in (llama, qwen2, qwen3, mistral, gemma3, phi3, olmo2, olmo3, qwen3_moe, mixtral, gpt_oss))
