"""Checkpoints and interop: DCP save and resume (dcp.py), their on-disk rules
(store.py), single-file exports (export.py), Hugging Face Llama folders (hf.py)."""
