"""Fill-in-the-middle prompts, as llama-server writes them (``format_prompt_infill`` in llama.cpp's
``tools/server/server-common.cpp``): the code before and after the cursor between the model's FIM tokens, for
llama-server's ``/infill``, the ``suffix`` of OpenAI's completions and of Ollama's ``/api/generate``.

    [FIM_REP]myproject\\n [FIM_SEP]file\\n chunk ... [FIM_SEP]filename\\n   (other files, where the model has the tokens)
    [BOS] [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

The prefix keeps its last 3/4 of a 2,048-token batch, the suffix its first quarter less the prompt and two tokens,
and the other files what the context has beyond a batch and twice ``n_predict``: llama-server's cuts at its default
batch size. Texts are tokenized with no special tokens and none parsed (the prompt's are parsed).
"""

from __future__ import annotations

from typing import Any

from leat_server.errors import bad_request
from leat_server.service import Service

BATCH = 2048  # llama-server's default batch, which sets its cuts
SNIPPET = "\n\n--- snippet ---\n\n"  # between other files' chunks where the model has no file separator


def supported(service: Service) -> bool:
    t = service.tokenizer
    return None not in (t.fim_pre_id, t.fim_suf_id, t.fim_mid_id)


def prompt(
    service: Service,
    prefix: str,
    suffix: str,
    extra: list[dict[str, Any]] | None = None,
    middle: str = "",
    n_predict: int = -1,
    param: str = "suffix",
) -> list[int]:
    """The token ids of a fill-in-the-middle prompt; a 400 where the model has no FIM tokens."""
    t = service.tokenizer
    if not supported(service):
        raise bad_request(f"{param}: this model has no fill-in-the-middle tokens (FIM prefix, suffix, middle)", param)

    def encode(text: str, parse: bool = False) -> list[int]:
        return t.encode(text, add_special=False, parse_special=parse)

    files: list[int] = []
    if t.fim_rep_id is not None:
        files += [t.fim_rep_id, *encode("myproject\n")]
    for i, chunk in enumerate(extra or []):
        text, name = chunk.get("text"), chunk.get("filename", "tmp")
        if not isinstance(text, str) or not isinstance(name, str):
            raise bad_request(f'input_extra[{i}] must be {{"text": string, "filename": string}}', "input_extra")
        files += [t.fim_sep_id, *encode(name + "\n")] if t.fim_sep_id is not None else encode(SNIPPET)
        files += encode(text)
    if t.fim_sep_id is not None:
        files += [t.fim_sep_id, *encode("filename\n")]
    before, after, inserted = encode(prefix), encode(suffix), encode(middle, parse=True)
    before = before[len(before) - min(len(before), 3 * (BATCH // 4)) :]
    after = after[: min(len(after), max(0, BATCH // 4 - (2 + len(inserted))))]
    keep = min(max(0, service.max_context - BATCH - 2 * n_predict), len(files))
    head = [t.bos_id] if t.add_bos and t.bos_id is not None else []
    return files[len(files) - keep :] + head + [t.fim_pre_id, *before, *inserted, t.fim_suf_id, *after, t.fim_mid_id]
