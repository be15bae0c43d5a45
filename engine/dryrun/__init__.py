"""The dry run: one CPU process plays one rank of an N-rank job (docs/planning.md)."""
