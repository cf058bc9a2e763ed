"""The built-in task families, registered by name (``task.family``).

Factories import their module lazily: building the ``toy`` family never imports the sandbox.
A new family registers itself with ``gagar_jax.envs.family.register_family(name, factory)``
(e.g. at the bottom of its module, plus one line here so ``task.family`` knows it).
"""

from __future__ import annotations

from gagar_jax.envs.family import FamilySettings, TaskFamily, register_family


def _toy(settings: FamilySettings) -> TaskFamily:
    from gagar_jax.envs.toy_family import ToyFamily

    return ToyFamily(settings)


def _toy_agent(settings: FamilySettings) -> TaskFamily:
    from gagar_jax.envs.toy_family import ToyAgentFamily

    return ToyAgentFamily(settings)


def _python_repo(settings: FamilySettings) -> TaskFamily:
    from gagar_jax.envs.repo import PythonRepoFamily

    return PythonRepoFamily(settings)


register_family("toy", _toy)
register_family("toy_agent", _toy_agent)
register_family("python_repo", _python_repo)


def _frontend(settings: FamilySettings) -> TaskFamily:
    from gagar_jax.envs.frontend import FrontendFamily

    return FrontendFamily(settings)


register_family("frontend", _frontend)
