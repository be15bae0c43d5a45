"""A model plugin that breaks the contract: no init_distribution, and a module whose own parameter
has no reset_parameters() to initialise it. For tests/test_model_contract.py."""

import torch
from torch import nn

from models import register_model
from models.gpt2 import FLAVORS, GPT2


class Gate(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.scale


class NoInitGPT2(GPT2):
    init_distribution = None

    def __init__(self, args):
        super().__init__(args)
        self.gate = Gate(args.dim)


register_model("no_init", NoInitGPT2, {"debug": FLAVORS["debug"]})
