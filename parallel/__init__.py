"""Mesh building and parallelize plans. Importing this package registers the built-in plans."""

from parallel import llama_plan  # noqa: F401  (registers the "llama" plan)
from parallel import llama_moe_plan  # noqa: F401  (registers the "llama_moe" plan)
