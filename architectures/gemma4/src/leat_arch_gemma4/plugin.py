"""Registers the Gemma 4 architecture, its assistant drafter's, and the proposer that drafts with it. Imports nothing
heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("gemma4", "leat_arch_gemma4.gemma4:Gemma4")
    register("gemma4-assistant", "leat_arch_gemma4.assistant:Gemma4Assistant")


@hookimpl
def register_proposers(register):
    register("assistant", "leat_arch_gemma4.drafter:Assistant")
