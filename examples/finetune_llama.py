"""Fine-tune a Hugging Face Llama end to end, offline, on this machine:

1. train a small BPE tokenizer.json on the shipped corpus (no tokenizer ships here);
2. make a tiny random Llama with `transformers` and save it in Hugging Face format,
   standing in for a downloaded checkpoint;
3. prepare the corpus into a token folder with that tokenizer;
4. train it at dp=2,tp=2 from the imported weights, evaluating on a held-out part,
   and export the result to Hugging Face format;
5. load the export with `transformers` and generate a few tokens.

Each step is the command a user would type, printed before it runs.

usage: python examples/finetune_llama.py [--out runs/finetune] [--steps 30]
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "data" / "corpus.txt"


def run(*command: str) -> None:
    print("$", shlex.join(command), flush=True)
    code = subprocess.run(command, cwd=REPO).returncode
    if code:
        sys.exit(f"the step above exited with code {code}; its message is printed above it.")


def make_tiny_llama(folder: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    print(f"tiny Llama ({sum(p.numel() for p in model.parameters()):,} parameters) saved to {folder}", flush=True)


def generate(folder: Path, prompt: str) -> str:
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    model = LlamaForCausalLM.from_pretrained(folder)
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(out[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/finetune", help="where everything is written")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    out = (REPO / args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    python = sys.executable

    tokenizer = out / "tokenizer.json"
    run(python, "launch/prepare.py", "--train-tokenizer", str(CORPUS), "--vocab-size", "512", "--out", str(tokenizer))
    from tokenizers import Tokenizer
    vocab_size = Tokenizer.from_file(str(tokenizer)).get_vocab_size()

    base = out / "base-hf"
    make_tiny_llama(base, vocab_size)
    shutil.copy(tokenizer, base / "tokenizer.json")

    tokens = out / "tokens"
    run(python, "launch/prepare.py", str(CORPUS), "--tokenizer", str(tokenizer), "--out", str(tokens))

    tuned = out / "tuned-hf"
    run(python, "launch/run.py", "--mesh", "dp=2,tp=2",
        "--set", f"checkpoint.hf_import={base}", "--set", f"checkpoint.hf_export={tuned}",
        "--set", "data.source=tokens", "--set", f"data.path={tokens}", "--set", "data.holdout=0.1",
        "--set", "eval.every=10", "--set", "eval.steps=1",
        "--set", f"training.steps={args.steps}", "--set", "training.seq_len=64", "--set", "training.global_batch=8",
        "--set", "optim.lr=1e-3", "--set", "optim.warmup_steps=2", "--set", f"run.dir={out / 'run'}")
    shutil.copy(tokenizer, tuned / "tokenizer.json")

    prompt = "The model"
    print(f"before: {generate(base, prompt)!r}")
    print(f"after:  {generate(tuned, prompt)!r}")


if __name__ == "__main__":
    main()
