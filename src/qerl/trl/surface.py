"""What a TRL script calls on its trainer around train(): transformers' Trainer surface over qerl's run loop.

`train(resume_from_checkpoint=None | True | path)` returns transformers' TrainOutput; `args`,
`processing_class`, `save_model`, `save_state`, `log_metrics`, `save_metrics` (transformers' own
functions), `push_to_hub` (the adapter and a model card; offline, one line saying so), and
`trainer.model.save_pretrained(dir)` writing a PEFT adapter, as TRL's PeftModel does.

Re-running a script into its own output_dir: `resume_from_checkpoint` continues the run there (True: its
newest checkpoint), `overwrite_output_dir=True` deletes it; with neither, TRL would write over it, and
qerl moves the earlier run aside to output_dir/previous_runs/N (said in one line) so a finished run is
never lost.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import trainer_pt_utils
from transformers.trainer_utils import TrainOutput


class HubUnreachable(RuntimeError):
    pass


# what a script's save_model / save_state / save_metrics / log_completions left in output_dir: an earlier
# run's, moved with it
SURFACE_FILES = ("config.yaml", "trainer_state.json", "completions", "adapter_model.safetensors",
                 "adapter_config.json", "README.md", "train_results.json", "eval_results.json", "all_results.json",
                 "wandb")


def move_earlier_run(out: Path) -> Path | None:
    """Move an earlier run's files in `out` to out/previous_runs/N; the new folder, or None if none."""
    from ..train.run_folder import earlier_run

    found = earlier_run(out)
    if not found:
        return None
    keep = out / "previous_runs"
    n = 1
    while (keep / str(n)).exists():
        n += 1
    dest = keep / str(n)
    dest.mkdir(parents=True)
    for name in found + [x for x in SURFACE_FILES if (out / x).exists()]:
        os.replace(out / name, dest / name)
    return dest


def adapter_saver(trainer):
    """trainer.model.save_pretrained as a PeftModel's: the adapter (PEFT's format) and nothing else."""
    def save_pretrained(save_directory, **_):
        return trainer.save_model(str(save_directory), tokenizer=False)
    return save_pretrained


class TrainerSurface:
    """Mixed into qerl.trl's trainers (before qerl's trainer class)."""

    @property
    def args(self):
        """The config (TRL's trainer.args)."""
        return self.cfg

    @property
    def processing_class(self):
        return self.tok

    def run_name(self) -> str | None:
        """The trackers' name of the run: run_name, or, unset, none (wandb, trackio and mlflow name it
        themselves), as transformers' integrations pass args.run_name."""
        return self.trl.run_name

    def is_world_process_zero(self) -> bool:
        return self.dist.is_main

    def is_local_process_zero(self) -> bool:
        return self.dist.local_rank == 0

    # transformers' own functions: the same output and files as TRL's trainer writes
    log_metrics = trainer_pt_utils.log_metrics
    save_metrics = trainer_pt_utils.save_metrics
    save_state = trainer_pt_utils.save_state
    metrics_format = trainer_pt_utils.metrics_format

    def base_name(self) -> str:
        """The base the adapter records: the model the script named, not qerl's temporary folder of it."""
        return getattr(self, "_base_id", None) or super().base_name()

    def surface_ready(self) -> None:
        """After qerl's trainer is built: trainer.model.save_pretrained writes the adapter."""
        object.__setattr__(self.model, "save_pretrained", adapter_saver(self))

    def name_given_model(self, model, processing_class) -> None:
        """After qerl's trainer is built from a temporary copy (data.model_folder; removed by now): the run's
        config (config.yaml, a checkpoint's, the trackers') names the model the script gave, its name_or_path,
        so a resume or an export from them finds a real model; config.yaml notes what came as in-memory objects
        (trl_fields.IN_MEMORY), as the copy may hold changes made in memory that the name does not."""
        from ..train import paths

        name = self._base_id or f"<in-memory {type(model).__name__} without a name_or_path>"
        self.cfg.model_name_or_path = paths.expand(name) if paths.is_local_model(name) else name
        given = (("model", model), ("processing_class", processing_class))
        self._in_memory = ", ".join(f"{what} {type(v).__name__}" for what, v in given
                                    if v is not None and not isinstance(v, (str, Path)))

    def _open_log(self):
        log = super()._open_log()
        if log is not None and getattr(self, "_in_memory", None):  # rank 0 has written config.yaml
            import yaml

            from ..train.trl_fields import IN_MEMORY, IN_MEMORY_COMMENT, IN_MEMORY_NOTE, in_memory_note

            line = yaml.safe_dump({IN_MEMORY: self._in_memory}, default_flow_style=True, width=1000).strip()
            path = self.out / "config.yaml"
            text = path.read_text()
            if not in_memory_note(text):  # a resume kept it already
                field = line.removeprefix("{").removesuffix("}")
                path.write_text(f"{text}{IN_MEMORY_COMMENT}{IN_MEMORY_NOTE}\n{field}\n")
        return log

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None,
              stop_after: int | None = None, **kwargs) -> TrainOutput:
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments: {', '.join(kwargs)}")
        if trial is not None:
            raise NotImplementedError("train(trial=...): hyperparameter search is not supported by qerl")
        out = Path(self.cfg.output_dir)
        if resume_from_checkpoint not in (None, False) and self._resumed_from is None and self.step == 0:
            from ..train import checkpoints as ckpt

            if resume_from_checkpoint is True:
                if not ckpt.checkpoints(out, complete=False):
                    raise ValueError(f"No valid checkpoint found in output directory ({out})")  # transformers' words
                self.resume()
            else:
                self.resume(resume_from_checkpoint)
        elif self._resumed_from is None and self.step == 0 and not self.cfg.overwrite_output_dir \
                and self.dist.is_main:
            moved = move_earlier_run(out)
            if moved is not None:
                print(f"qerl: {out} held an earlier run: moved to {moved} (train(resume_from_checkpoint=True) "
                      "continues a run; overwrite_output_dir=True deletes it)", flush=True)
        rows = super().train(stop_after)
        summary = self.state.log_history[-1] if self.state.log_history else {}
        metrics = {k: v for k, v in summary.items() if k != "step"}
        metrics["train_samples_per_second"] = metrics.get("train_steps_per_second", 0.0) * self.state.train_batch_size
        self.train_rows_logged = rows
        return TrainOutput(self.state.global_step, metrics.get("train_loss", 0.0), metrics)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False, tokenizer: bool = True) -> Path:
        """TRL's save_model: the trained LoRA adapter in PEFT's format (adapter_config.json +
        adapter_model.safetensors, loadable on the original base model) and the tokenizer."""
        from ..checkpoint.peft_adapter import save_adapter

        out = Path(output_dir or self.cfg.output_dir)
        if self.dist.is_main:
            save_adapter(self.model, out, base_model_name_or_path=self.base_name())
            if tokenizer:
                self.tok.save_pretrained(out)
        return out

    def create_model_card(self, output_dir: str | None = None, model_name: str | None = None) -> Path:
        out = Path(output_dir or self.cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        card = out / "README.md"
        card.write_text(f"---\nbase_model: {self.base_name()}\nlibrary_name: peft\ntags: [qerl, trl, lora, "
                        f"{self.KIND_TAG}]\n---\n\n# {model_name or out.name}\n\nA LoRA adapter of {self.base_name()} "
                        f"trained with qerl ({self.KIND_TAG}) on its 4-bit base, through qerl.trl.\n")
        return card

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, **kwargs) -> str:
        """The adapter, tokenizer and a model card to the hub repository hub_model_id (default: the
        output_dir's name), as TRL's push_to_hub; offline a one-line HubUnreachable."""
        out = Path(self.cfg.output_dir)
        trl = getattr(self, "trl", None)
        repo = getattr(trl, "hub_model_id", None) or out.name
        self.save_model(str(out))
        self.create_model_card(str(out), model_name=kwargs.get("model_name"))
        try:
            from huggingface_hub import HfApi

            api = HfApi(token=token or getattr(trl, "hub_token", None))
            repo_id = api.create_repo(repo, private=getattr(trl, "hub_private_repo", None), exist_ok=True).repo_id
            info = api.upload_folder(repo_id=repo_id, folder_path=str(out), commit_message=commit_message,
                                     revision=revision, allow_patterns=["adapter_*", "README.md", "tokenizer*",
                                                                        "special_tokens_map.json", "*.jinja",
                                                                        "vocab.json", "merges.txt"])
        except Exception as e:  # noqa: BLE001 - offline, no token, no network: said in one line
            raise HubUnreachable(f"push_to_hub: could not upload to the hub repository {repo!r} "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}); "
                                 f"the adapter is saved in {out}") from None
        return str(getattr(info, "commit_url", info))
