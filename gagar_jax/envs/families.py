"""The built-in task families, registered by name (``task.family``).

A new family registers itself with ``gagar_jax.envs.family.register_family(name, factory)``
(e.g. at the bottom of its module, plus one line here so ``task.family`` knows it); a family
class whose constructor takes the ``FamilySettings`` is its own factory.
"""

from __future__ import annotations

from gagar_jax.envs.family import register_family
from gagar_jax.envs.frontend import FrontendFamily
from gagar_jax.envs.repo import PythonRepoFamily
from gagar_jax.envs.toy_family import ToyAgentFamily, ToyFamily

register_family("toy", ToyFamily)
register_family("toy_agent", ToyAgentFamily)
register_family("python_repo", PythonRepoFamily)
register_family("frontend", FrontendFamily)
