"""TRL's reward_funcs entries that are not functions: a reward model by hub id or folder (loaded as TRL
loads it, AutoModelForSequenceClassification with one label) or as a model object, scored as TRL's
_calculate_rewards scores it: prompt + completion text (a conversation through the reward tokenizer's
chat template), right-padded, no special tokens added, the first logit."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RewardModel:
    model: object
    tokenizer: object
    __name__: str = "reward_model"

    def __call__(self, prompts, completions, **_):
        import torch

        if isinstance(prompts[0], list):  # conversational: TRL's apply_chat_template of prompt + completion
            from trl.data_utils import apply_chat_template

            texts = [apply_chat_template({"messages": p + c}, self.tokenizer)["text"]
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = self.tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False)
        dev = next(self.model.parameters()).device
        with torch.inference_mode():
            return self.model(**{k: v.to(dev) for k, v in inputs.items()}).logits[:, 0].float().tolist()


def load_reward_model(name: str, tokenizer=None) -> RewardModel:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=1).eval()
    tok = tokenizer or AutoTokenizer.from_pretrained(name, padding_side="right")
    return wrap(model, tok)


def wrap(model, tokenizer=None) -> RewardModel:
    from transformers import AutoTokenizer

    name = model.config._name_or_path
    tok = tokenizer or AutoTokenizer.from_pretrained(name)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.config.pad_token_id = tok.pad_token_id  # TRL sets it so the model finds each sequence's last token
    return RewardModel(model.eval(), tok, name.split("/")[-1])


def reward_callables(funcs: list, processing_classes=None) -> list:
    """Every reward_funcs entry as a callable of TRL's keyword arguments."""
    import torch

    if processing_classes is not None and not isinstance(processing_classes, (list, tuple)):
        processing_classes = [processing_classes]
    pcs = list(processing_classes or [None] * len(funcs))
    if len(pcs) != len(funcs):
        raise ValueError(f"reward_processing_classes has {len(pcs)} entries for {len(funcs)} reward functions")
    out = []
    for f, pc in zip(funcs, pcs):
        if isinstance(f, str):
            out.append(load_reward_model(f, pc))
        elif isinstance(f, torch.nn.Module):
            out.append(wrap(f, pc))
        elif callable(f):
            if pc is not None:
                raise ValueError("reward_processing_classes: a reward function takes none (only reward models do)")
            out.append(f)
        else:
            raise TypeError(f"reward_funcs: {f!r} is neither a function, a reward model nor a model id")
    return out
