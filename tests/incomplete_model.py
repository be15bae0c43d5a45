"""A model plugin that lacks a required member (init_value), for tests/test_model_contract.py."""

from models import register_model
from models.gpt2 import FLAVORS, GPT2


class NoInitGPT2(GPT2):
    init_value = None


register_model("no_init", NoInitGPT2, {"debug": FLAVORS["debug"]})
