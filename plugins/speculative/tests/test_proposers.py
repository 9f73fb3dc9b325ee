import leat
import pytest
from leat import plugins
from leat.errors import LeatError, PluginError
from leat.speculative import load_proposer
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_speculative.proposers import DraftModel, PromptLookup


def test_registered_under_the_hook():
    host = plugins.host()
    assert {"ngram", "draft", "mtp", "assistant"} <= set(host.registry["proposers"])
    assert set(host.plugins["leat-speculative"].provides["proposers"]) == {"ngram", "draft", "mtp", "assistant"}
    assert isinstance(load_proposer("ngram", None), PromptLookup)
    with pytest.raises(PluginError, match="not registered"):
        load_proposer("nope", None)


def test_prompt_lookup_proposes_what_followed_the_longest_recent_match():
    lookup = PromptLookup(max_n=3, min_n=2)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 2, 3]
    # (2, 3) occurs twice before; the most recent occurrence ended at position 8
    assert lookup.propose(0, tokens, 3) == [4, 6, 7]
    tokens += [4]  # now (2, 3, 4) matches; the latest one was followed by 6
    assert lookup.propose(0, tokens, 2) == [6, 7]
    assert lookup.propose(1, [1, 2, 3, 4], 4) == []  # no repeated n-gram, no guess
    lookup.forget(0)
    assert 0 not in lookup.indexes


def test_draft_model_needs_the_same_vocabulary(tmp_path):
    target = leat.load(str(write_tiny_gguf(Llama, tmp_path / "a.gguf", params=Llama.tiny(vocab=300))), backend="cpu")
    other = leat.load(str(write_tiny_gguf(Llama, tmp_path / "b.gguf", params=Llama.tiny(vocab=320))), backend="cpu")
    with pytest.raises(LeatError, match="different vocabulary"):
        DraftModel(target, draft=other)
    with pytest.raises(LeatError, match="--draft MODEL"):
        DraftModel(target)
    # the draft's greedy tokens, with its KV reused across calls (a shorter history rewinds it)
    draft = DraftModel(target, draft=str(tmp_path / "a.gguf"))
    history = [5, 6, 7, 8]
    first = draft.propose(0, history, 4)
    ids = list(history)
    for _ in range(4):
        ids.append(int(target.logits(ids)[-1].argmax()))
    assert first == ids[4:]
    assert draft.propose(0, history + first[:2], 2) == first[2:]
    assert draft.propose(0, history[:3] + [9], 1) == [int(target.logits(history[:3] + [9])[-1].argmax())]


def test_prompt_lookup_continues_a_run_or_cycle_past_the_end():
    lookup = PromptLookup()
    assert lookup.propose(0, [9, 7, 7, 7], 4) == [7, 7, 7, 7]
    assert lookup.propose(1, [1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
