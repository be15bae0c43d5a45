"""Training data: sources of token windows (the byte-level corpus, synthetic tokens,
prepared memory-mapped token files and their mixtures), tokenizers, and the
preparation of token files."""
