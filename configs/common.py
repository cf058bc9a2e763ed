"""What every experiment config shares: the argument parser and the defaults.

An experiment file (``configs/<name>.py``) has a ``get_config(arg)`` that starts from
:func:`base` and writes only its own choices, each with a comment::

    def get_config(arg=None):
        arg = common.parse_arg(arg, words={"mode": TRAINING_MODES}, mode="gagar", smoke=False)
        c = common.base()
        c.mode = arg.mode
        c.model.update(hidden_size=128)  # why this value
        return c

The defaults have one source, :class:`gagar_jax.rl.config.RunConfig` (its ``model`` is the
library's ``TransformerConfig``, its ``learner`` the ``UpdateConfig``): :func:`base` is that
config as a ``ConfigDict``, so every field is a command-line override
(``--config.learner.learning_rate=1e-4``) even when the experiment file does not mention it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

from gagar_jax.feedback.run import FeedbackRunConfig
from gagar_jax.rl.config import RunConfig

# Fields the run config derives (from the mode, the rollout's temperature and response budget,
# and the step count) unless a config sets them; base() keeps them unset so they stay derived.
DERIVED_FIELDS = (
    ("learner", "temperature"),
    ("learner", "decay_steps"),
    ("learner", "token_credit"),
    ("learner", "score_window"),
    ("learner", "shared_prefix"),
    ("learner", "rollout_is"),
    ("learner", "decoupled"),
    ("learner", "mismatch_metrics"),
    ("learner", "advantages", "mode"),
)

# The smoke runs' policy (seconds on a CPU core): one layer of width 32.
SMOKE_MODEL = dict(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)


def parse_arg(
    arg: str | None, *, words: Mapping[str, Iterable[str]] | None = None, **spec: Any
) -> ml_collections.ConfigDict:
    """Parses a config argument, ``configs/x.py:<arg>``, into a ``ConfigDict``.

    ``arg`` is a comma-separated list. Each item is one of:

    * ``key=value``: a key of ``spec``, the value cast to the type of its default
      (``true``/``false`` for a bool);
    * ``key``: a bool key of ``spec``, set to True (``smoke``);
    * a word of ``words[key]``, which sets that key (``words={"mode": MODES}`` lets ``binary``
      mean ``mode=binary``).

    Args:
      arg: the argument after the colon, or None/"" for all defaults.
      words: key -> the values a bare word may give it.
      **spec: every key the config understands, with its default.

    Returns:
      A ``ConfigDict`` with every key of ``spec``.

    Raises:
      ValueError: naming an item that is none of the above, and what is understood.
    """
    words = {k: tuple(v) for k, v in (words or {}).items()}
    for key in words:
        if key not in spec:
            raise ValueError(f"parse_arg: words key {key!r} needs a default in spec")
    out = dict(spec)
    for item in (w.strip() for w in (arg or "").split(",")):
        if not item:
            continue
        if "=" in item:
            key, value = (s.strip() for s in item.split("=", 1))
            if key not in spec:
                raise ValueError(
                    f"config argument {item!r}: unknown key {key!r}; expected one of {sorted(spec)}"
                )
            out[key] = _cast(key, value, spec[key])
            continue
        owners = [k for k, vals in words.items() if item in vals]
        if owners:
            out[owners[0]] = item
        elif isinstance(spec.get(item), bool):
            out[item] = True
        else:
            understood = [w for vals in words.values() for w in vals]
            understood += [k for k, v in spec.items() if isinstance(v, bool)]
            raise ValueError(
                f"config argument {item!r} not understood; expected one of "
                f"{tuple(understood)} or key=value with a key of {sorted(spec)}"
            )
    return ml_collections.ConfigDict(out)


def _cast(key: str, value: str, default: Any) -> Any:
    if isinstance(default, bool):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"config argument {key}={value!r}: expected true or false")
        return value.lower() in ("true", "1")
    if default is None:
        return value
    try:
        return type(default)(value)
    except ValueError as e:
        raise ValueError(
            f"config argument {key}={value!r}: expected a {type(default).__name__}"
        ) from e


def base() -> ml_collections.ConfigDict:
    """``RunConfig()`` as a ``ConfigDict``: every field with its default, derived fields
    (:data:`DERIVED_FIELDS`) and optional fields as typed placeholders (unset, so a derived
    field stays derived unless a config or the command line sets it:
    ``--config.learner.score_window=0``, ``--config.learner.dual_clip=3.0``)."""
    d = RunConfig().to_dict()
    for path in DERIVED_FIELDS:
        section = d
        for key in path[:-1]:
            section = section[key]
        section[path[-1]] = config_dict.placeholder(type(section[path[-1]]))
    _placeholders(d, RunConfig())
    return ml_collections.ConfigDict(d)


def feedback_base() -> ml_collections.ConfigDict:
    """``FeedbackRunConfig()`` as a ``ConfigDict``, for the feedback experiments: every field
    with its default, ``learner.decay_steps`` left out (it follows ``loop.steps``)."""
    d = FeedbackRunConfig().to_dict()
    d["learner"].pop("decay_steps")
    _placeholders(d, FeedbackRunConfig())
    return ml_collections.ConfigDict(d)


def _placeholders(d: dict, obj: Any) -> None:
    """Replaces ``None`` values of ``d`` by placeholders of the dataclass field's type."""
    if not dataclasses.is_dataclass(obj):
        return
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name not in d:  # hf_checkpoint: to_dict moves it into the model section
            continue
        if isinstance(d[f.name], dict):
            _placeholders(d[f.name], getattr(obj, f.name))
        elif d[f.name] is None:
            d[f.name] = config_dict.placeholder(_optional_type(hints[f.name], f.name))


def _optional_type(hint: Any, name: str) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return typing.get_origin(args[0]) or args[0]  # tuple[float, ...] -> tuple
    raise TypeError(f"field {name!r} defaults to None but its type {hint!r} is not X | None")
