"""One example per subcommand, shown at the end of its --help."""

EXAMPLES = {
    "inspect": "qerl inspect Qwen/Qwen2.5-0.5B-Instruct --quant nvfp4",
    "quantize": "qerl quantize Qwen/Qwen2.5-7B-Instruct ./qwen7b-nvfp4 --format nvfp4",
    "export": "qerl export ./merged --adapter runs/default/adapter   # the base the adapter records",
    "generate": "qerl generate smollm2 --adapter runs/default/adapter --prompt 'What is 7 * 8?' --n 2",
    "bench": "qerl bench kernels --help",
    "train": ("qerl train                            # the default run (SmolLM2, DAPO, AQN)\n"
              "  qerl train --print_config > my.yaml   # every field, documented\n"
              "  qerl train my.yaml --model Qwen/Qwen2.5-0.5B-Instruct --dataset_name gsm8k --max_steps 200\n"
              "  qerl train --resume runs/qerl --max_steps 300"),
    "sft": ("qerl sft --model smollm2 --max_steps 20 --assistant_only_loss   # the tool task's transcripts\n"
            "  qerl train --model_name_or_path runs/sft/adapter --dataset_name tool_arithmetic --max_turns 2"),
    "eval": ("qerl eval runs/default                # a run's adapter on its own task and evaluation settings\n"
             "  qerl eval smollm2 --adapter runs/default/adapter --dataset_name gsm8k-offline --limit 50 --samples 4"),
    "plot": "qerl plot runs/default",
    "study": "qerl study run --arms nvfp4,bf16 --seeds 0,1 && qerl study report",
}


def epilog(name: str) -> str:
    return f"example:\n  {EXAMPLES[name]}"
