"""Registers the gpt-oss architecture. Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("gpt-oss", "leat_arch_gpt_oss.gpt_oss:GptOss")
