"""Registers the Phi-3 architecture. Imports nothing heavy."""

from leat import hookimpl


@hookimpl
def register_architectures(register):
    register("phi3", "leat_arch_phi3.phi3:Phi3")
