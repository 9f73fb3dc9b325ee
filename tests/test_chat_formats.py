"""Chat formats across plugins: each architecture plugin brings its family's conventions, chosen from the template and
vocabulary; core and the server name no family (every name an installed plugin registers is looked for)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from leat.chatformat import choose
from leat.plugins import PluginHost

ROOT = Path(__file__).resolve().parents[1]
# llama.cpp's tokenizer pre-types (tokenizer.ggml.pre) and vocabulary types are GGUF values, not model families
NOT_FAMILIES = {ROOT / "core/src/leat/tokenizer.py"}
# the kit's model check, named before its reference model was declared (leat[conformance]); plugins call it by name
OLD_NAMES = {"test_tiny_llama_agrees_with_the_float64_oracle"}
# llama.cpp's own tools and project, and its "llama-bpe" pre-tokenizer, which share a family's name
TOOLS = re.compile(r"llama[.-](cpp|bench|perplexity|server|cli|gguf|vocab|bpe)|llama_\w+|ggml", re.IGNORECASE)


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost(None)


def test_formats_are_chosen_from_the_template_and_vocabulary(host):
    assert choose("{{ '<tool_call>' }}", [], "", host) == "hermes"
    assert choose("<|start_header_id|>ipython", [], "", host) == "llama3"
    assert choose("", ["<|channel|>", "<|message|>"], "", host) == "harmony"
    assert choose("", [], "gpt-oss", host) == "harmony"
    assert choose("[TOOL_CALLS]", [], "", host) == "mistral"
    assert choose("<start_of_turn>", [], "gemma3", host) == "gemma"
    assert choose("start_function_call", [], "gemma3", host) == "functiongemma"
    assert choose("<|im_start|>", [], "", host) == "hermes"


def family_names(host: PluginHost) -> set[str]:
    names = set(host.registry["architectures"]) | set(host.registry["chat_formats"])
    stems = {re.match(r"[a-z]+(-[a-z]+)?", name).group() for name in names}  # qwen3moe -> qwen, gpt-oss -> gpt-oss
    spelled = {name.replace("-", joint) for name in names | stems for joint in ("_", "")}  # gpt_oss, gptoss
    return names | stems | spelled


def code_words(tree: ast.AST) -> list[tuple[int, str]]:
    """The string literals (docstrings left out: documentation may say which family a block serves) and the names
    (variables, attributes, functions, classes, imported modules) in a module: what code can branch or look up on."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.append((node.lineno, node.value))
        elif isinstance(node, ast.Name):
            words.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            words.append((node.lineno, node.attr))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            words.append((node.lineno, node.name))
        elif isinstance(node, ast.ImportFrom | ast.Import):
            words += [(node.lineno, alias.name) for alias in node.names] + [(node.lineno, getattr(node, "module", ""))]
    return words


def test_no_family_name_in_core_or_the_server(host):
    names = family_names(host)
    families = {"llama", "qwen", "gemma", "gpt-oss", "deepseek", "hermes", "harmony", "mistral"}
    assert families | {"gpt_oss", "gptoss"} <= names
    alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    word = re.compile(rf"(?<![a-z])({alternatives})(?![a-z])", re.IGNORECASE)
    found = []
    for package in (ROOT / "core/src/leat", ROOT / "server/src/leat_server"):
        for path in sorted(package.rglob("*.py")):
            if path in NOT_FAMILIES:
                continue
            for number, text in code_words(ast.parse(path.read_text())):
                if text in OLD_NAMES:
                    continue
                for match in word.finditer(TOOLS.sub("", text or "")):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {match.group()} in {text[:80]!r}")
    assert not found, "family names in core or the server (they belong in the family's plugin):\n" + "\n".join(found)
