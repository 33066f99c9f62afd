"""The hybrid policy: which parameters get 8-bit optimizer states (lazyzero/optimizer/state_policy.py)."""

import torch

from lazyzero.optimizer.config import OptimizerConfig
from lazyzero.optimizer.state_policy import choose_state_precision, split_param_groups


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(100, 64)   # 6400: fp32 by name
        self.big = torch.nn.Linear(128, 64)               # 8192 weight + 64 bias
        self.medium = torch.nn.Linear(64, 80)             # 5120 weight + 80 bias
        self.final_norm = torch.nn.LayerNorm(64)          # 64 + 64: fp32 by name and size


def named(model):
    return list(model.named_parameters())


def test_default_policy_keeps_embeddings_norms_and_small_tensors_fp32():
    plan = choose_state_precision(named(Tiny()), OptimizerConfig(enabled=True))
    assert sorted(plan.eight_bit) == ["big.weight", "medium.weight"]
    assert "embed_tokens.weight" in plan.fp32 and "final_norm.weight" in plan.fp32 and "big.bias" in plan.fp32
    assert plan.eight_bit_elements == 8192 + 5120


def test_fraction_takes_the_largest_tensors_first():
    plan = choose_state_precision(named(Tiny()), OptimizerConfig(enabled=True, fraction_8bit=0.5))
    assert plan.eight_bit == ["big.weight"]
    plan = choose_state_precision(named(Tiny()), OptimizerConfig(enabled=True, fraction_8bit=0.0))
    assert plan.eight_bit == []


def test_patterns_and_minimum_size_are_configurable():
    config = OptimizerConfig(enabled=True, fp32_patterns=["big.*"], min_8bit_size=0)
    plan = choose_state_precision(named(Tiny()), config)
    assert "big.weight" in plan.fp32 and "embed_tokens.weight" in plan.eight_bit and "medium.bias" in plan.eight_bit


def test_groups_are_split_by_precision_and_keep_user_options():
    model = Tiny()
    plan = choose_state_precision(named(model), OptimizerConfig(enabled=True))
    user_groups = [{"params": [model.big.weight, model.big.bias], "weight_decay": 0.0},
                   {"params": [model.medium.weight, model.embed_tokens.weight]}]
    groups = split_param_groups(model, user_groups, plan)
    assert [(len(g["params"]), g["state_bits"], g.get("weight_decay")) for g in groups] == [
        (1, 8, 0.0), (1, 32, 0.0), (1, 8, None), (1, 32, None)]
    assert groups[0]["params"][0] is model.big.weight


def test_all_trainable_parameters_when_none_given():
    model = Tiny()
    model.final_norm.weight.requires_grad_(False)
    plan = choose_state_precision(named(model), OptimizerConfig(enabled=True))
    groups = split_param_groups(model, None, plan)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters())) - 1
