"""The training shell under rl/ (GRPO) and sft/ (SFT): the run loop, its folder, checkpoints, trainer state,
metrics and trackers, callbacks, ranks, memory levers, optimizer, profiling and the shared config fields.
The two trainers differ only in what a step does."""
