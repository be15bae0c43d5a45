"""A model plugin whose forward raises: a bug inside a rank, for tests/test_exits.py."""

import torch

from models import register_model
from models.llama import FLAVORS, Llama


class CrashingLlama(Llama):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("planted crash in forward")


register_model("crashing", CrashingLlama, {"debug": FLAVORS["debug"]})
