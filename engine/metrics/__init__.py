"""What a run reports: the step line, metrics.jsonl and TensorBoard (log.py), memory
(memory.py), and FLOPs and device peaks (throughput.py)."""
