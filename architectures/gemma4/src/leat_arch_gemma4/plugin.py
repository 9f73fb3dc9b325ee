"""Registers the Gemma 4 architecture and its assistant drafter's (leat-speculative's ``assistant`` proposer drafts
with it). Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("gemma4", "leat_arch_gemma4.gemma4:Gemma4")
    register("gemma4-assistant", "leat_arch_gemma4.assistant:Gemma4Assistant")
