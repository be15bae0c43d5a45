"""Training data: sources of token windows (the byte-level corpus, synthetic tokens,
prepared memory-mapped token files and their mixtures), tokenizers, and the
preparation of token files.

- sources.py: the sources, build_source(cfg, model_vocab, split), check_data, rows_per_data_rank, local_batch
- token_file.py: the prepared folder format (tokens.bin, documents.npy, index.json)
- sampling.py: epochs as keyed permutations, weighted mixtures (pure functions of the sample)
- tokenizer.py: bytes, tokenizer.json, tiktoken; training a small BPE
launch/prepare.py writes the folders; docs/data.md describes all of it.
"""
