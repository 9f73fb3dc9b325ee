"""Phi-3's chat convention needs nothing of the plugin: a Phi-3 GGUF carries its template and its vocabulary marks
the turn markers, and leat's core renders, tokenizes and stops as llama.cpp does. Checked here on a Phi-3-like
SentencePiece vocabulary with Phi-3-mini-instruct's template (as its tokenizer_config.json has it) against llama.cpp's
own phi3 chat format (src/llama-chat.cpp, LLM_CHAT_TEMPLATE_PHI_3: ``<|role|>\\n{content}<|end|>\\n`` per message,
then ``<|assistant|>\\n``)."""

import gguf
from leat.chat import ChatTemplate
from leat.tokenizer import Tokenizer

K = gguf.Keys.Tokenizer
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'system') %}"
    "{{'<|system|>' + '\n' + message['content'] + '<|end|>' + '\n'}}{% elif (message['role'] == 'user') %}"
    "{{'<|user|>' + '\n' + message['content'] + '<|end|>' + '\n' + '<|assistant|>' + '\n'}}"
    "{% elif message['role'] == 'assistant' %}{{message['content'] + '<|end|>' + '\n'}}{% endif %}{% endfor %}"
)
SPECIAL = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>"]


def phi3_like_metadata() -> dict:
    """Phi-3's layout: <unk> <s> </s>, 256 byte tokens, pieces, then its control tokens (eos is <|endoftext|>)."""
    pieces = ["▁", "▁hello", "▁you", "▁are", "▁kind", "h", "i", "e", "l", "o", "y", "u", "a", "r", "k", "n", "d"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *SPECIAL]
    T = gguf.TokenType
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL, *[T.BYTE] * 256, *[T.NORMAL] * len(pieces), *[T.CONTROL] * len(SPECIAL)]
    return {
        K.MODEL: "llama",
        K.LIST: tokens,
        K.SCORES: [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * len(SPECIAL),
        K.TOKEN_TYPE: [int(t) for t in types],
        K.BOS_ID: 1,
        K.EOS_ID: tokens.index("<|endoftext|>"),
        K.CHAT_TEMPLATE: TEMPLATE,
    }


def llamacpp_phi3(messages: list[dict]) -> str:
    return "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages) + "<|assistant|>\n"


def test_phi3_template_renders_llamacpps_phi3_format_and_ends_turns_at_end():
    metadata = phi3_like_metadata()
    messages = [{"role": "system", "content": "you are kind"}, {"role": "user", "content": "hello"}]
    prompt = ChatTemplate.from_metadata(metadata).render(messages)
    assert prompt == "<s>" + llamacpp_phi3(messages)

    tokenizer = Tokenizer.from_metadata(metadata)
    ids = tokenizer.encode(prompt, add_special=False, parse_special=True)
    texts = metadata[K.LIST]
    for marker in ("<s>", "<|system|>", "<|end|>", "<|user|>", "<|assistant|>"):
        assert texts.index(marker) in ids, marker  # each marker one token, not its characters
    assert tokenizer.is_eog(texts.index("<|end|>")) and tokenizer.is_eog(texts.index("<|endoftext|>"))
