"""Hook specifications: the contract between leat and its plugins.

A plugin is a module that an installed distribution names under the ``leat`` entry-point group
(the entry-point name is the distribution name)::

    [project.entry-points.leat]
    leat-backend-cpu = "leat_backend_cpu.plugin"

The module holds functions decorated with :data:`leat.hookimpl` whose names match the
specifications below. Each ``register_*`` hook receives a ``register`` callback; the host keeps
the names, detects clashes and decides order. What a plugin registers is a lazy reference, a
``"module:attribute"`` string, so that listing plugins imports nothing heavy (no CUDA, no
tinygrad); the reference is imported only when that backend, architecture or sampler is used.
A hookimpl whose name matches no specification here (``register_sampler``) stops start-up with an
error naming the plugin and the hook.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("leat")
hookimpl = pluggy.HookimplMarker("leat")


@hookspec
def register_backends(register: Callable[..., None]) -> None:
    """Register compute backends.

    Called once, when leat first needs its list of backends (``leat plugins``, loading a model).

    :param register: call ``register(name, ref, priority=0)`` once per backend.
        ``name`` is what users pass to ``--backend`` (e.g. ``"cpu"``). ``ref`` is a
        ``"module:Class"`` string naming a subclass of :class:`leat.backend.Backend`; it is
        imported only when the backend is probed or used. ``priority`` orders automatic choice:
        the usable backend with the highest priority wins unless the user names one.

    The return value is ignored. Registering a name that another plugin registered is an error
    naming both plugins.
    """


@hookspec
def register_architectures(register: Callable[..., None]) -> None:
    """Register model architectures, keyed by GGUF ``general.architecture``.

    Called once, when leat first needs its list of architectures.

    :param register: call ``register(name, ref)`` once per architecture. ``name`` is the
        value of ``general.architecture`` the class serves (e.g. ``"llama"``); one class may be
        registered under several names. ``ref`` is a ``"module:Class"`` string naming a
        subclass of :class:`leat.architecture.Architecture`.

    The return value is ignored. Registering a name twice is an error naming both plugins.
    """


@hookspec
def register_samplers(register: Callable[..., None]) -> None:
    """Register sampler stages (logits transforms) and selectors.

    Called once, when leat first builds a sampling chain.

    :param register: call ``register(name, ref)`` once per stage. ``ref`` is a
        ``"module:attribute"`` string naming a subclass of :class:`leat.sampling.Stage`
        (or :class:`leat.sampling.Selector`: ``"greedy"`` and ``"categorical"``). A stage declares
        the request fields it reads (``Stage.Params``, a ``msgspec.Struct`` with defaults,
        constraints and descriptions: requests, ``SamplingParams`` and the server's request bodies
        and schema take them from there), its place in the chain (``Stage.order``; llama.cpp's
        positions are ``leat.sampling.ORDER``) and what it does that the engine may rely on
        (``changes_argmax``: it runs at temperature 0; ``keeps_top()``: the engine may read back only
        the top K logits).

    The return value is ignored. Registering a name twice, or two stages declaring one field, is an
    error naming both.
    """


@hookspec
def register_proposers(register: Callable[..., None]) -> None:
    """Register speculative-decoding proposers: cheap guesses of a request's next tokens.

    Called once, when an engine is first built with speculation (``--speculate NAME``).

    :param register: call ``register(name, ref)`` once per proposer. ``name`` is what users
        pass to ``--speculate`` (e.g. ``"ngram"``, ``"draft"``). ``ref`` is a ``"module:Class"``
        string naming a subclass of :class:`leat.speculative.Proposer`; the engine builds it as
        ``Class(model, **options)`` (``options`` from the CLI, e.g. ``draft=PATH``) and calls
        its ``propose(key, tokens, k)`` on the scheduler thread. The target model verifies every
        proposed token, so a proposer affects speed only, never the output.

    The return value is ignored. Registering a name twice is an error naming both plugins.
    """


@hookspec
def register_commands(register: Callable[..., None]) -> None:
    """Register subcommands of the ``leat`` command line (e.g. leat-server's ``serve``).

    Called once per ``leat`` invocation, when the command line looks a subcommand up or lists its
    subcommands (``leat --help``, ``leat NAME``). Unlike the other hooks it is asked of every
    installed plugin, whatever ``LEAT_PLUGINS`` / ``--plugins`` select, so that a command is there
    whichever plugins it then loads.

    :param register: call ``register(name, ref)`` once per command. ``name`` is the subcommand
        (``leat NAME``). ``ref`` is a ``"module:attribute"`` string naming a :class:`click.Command`
        (or :class:`click.Group`); it is imported only when that command runs or the help lists
        it, so ``leat`` starts without importing the plugin's dependencies for other commands.

    The return value is ignored. Registering a name that another plugin registered is an error
    naming both plugins; leat's own commands (``run``, ``generate``, ...) cannot be replaced.
    """


@hookspec
def register_chat_formats(register: Callable[..., None]) -> None:
    """Register chat formats: how a model family writes tool calls and reasoning in its output.

    Called once, when a server first chooses how to read a model's output (``leat serve``). An
    architecture plugin registers its family's conventions here, so that core and the server name none.

    :param register: call ``register(name, ref)`` once per format. ``name`` is what users pass to
        ``leat serve --tool-parser`` (e.g. ``"hermes"``). ``ref`` is a ``"module:Class"`` string
        naming a subclass of :class:`leat.chatformat.OutputParser`. Its ``detect(template, special,
        architecture)`` classmethod says how surely a model speaks the format (the highest number
        among the installed formats wins; None: it does not); an instance parses one answer as it
        streams (``feed(text)``, ``finish()``, each returning content, reasoning and tool-call deltas).
        ``always_parsed`` (the output always has the format's structure, tools or not) and
        ``own_reasoning`` (no ``<think>`` splitter in front of it) say how the server uses it.

    The return value is ignored. Registering a name twice is an error naming both plugins.
    """
