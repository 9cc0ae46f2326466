"""TRL's field names and values as aliases of qerl's (issue 33), in GRPOConfig(...), files and flags."""

import pytest

from qerl.rl import GRPOConfig


def test_trl_names_and_values_reach_qerls_fields_every_way():
    kw = dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_mask",
              vllm_importance_sampling_clip_max=2.5, vllm_importance_sampling_clip_min=0.5, entropy_coeff=0.02,
              scale_rewards=False, optim="adamw_torch_fused")
    want = dict(importance_sampling_correction=True, importance_sampling_mode="token_mask", importance_sampling_cap=2.5,
                importance_sampling_cap_min=0.5, entropy_coef=0.02, scale_rewards="none", optim="adamw_torch")
    for cfg in (GRPOConfig(**kw), GRPOConfig.from_dict(kw),
                GRPOConfig().with_overrides({k: str(v).lower() for k, v in kw.items()})):
        assert {k: getattr(cfg, k) for k in want} == want
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(vllm_importance_sampling_cap=1.5).importance_sampling_cap == 1.5  # TRL's deprecated name
    assert "\nvllm_" not in GRPOConfig().to_yaml(documented=False)  # files are written with qerl's names


def test_aliases_do_not_hide_conflicts_or_bad_values():
    with pytest.raises(ValueError, match="'importance_sampling_cap' is given twice"):
        GRPOConfig.from_dict({"importance_sampling_cap": 2.0, "vllm_importance_sampling_clip_max": 3.0})
    with pytest.raises(ValueError, match="importance_sampling_mode.*one of token_truncate"):
        GRPOConfig(vllm_importance_sampling_mode="sequence")
    with pytest.raises(ValueError, match="token_normalizer"):
        GRPOConfig(token_normalizer="batch")


def test_train_flags_take_trls_names():
    import argparse

    from qerl.cli.config_help import add_config_arguments, config_values

    p = argparse.ArgumentParser()
    add_config_arguments(p)
    ns = p.parse_args(["--vllm_importance_sampling_mode", "token_truncate", "--entropy_coeff", "0.1"])
    assert config_values(ns) == {"importance_sampling_mode": "token_truncate", "entropy_coef": "0.1"}
