"""Environments by name: registered names, dotted import paths, and `gem:<env_id>` for GEM's environments.

A name in config resolves, in this order: `gem:<env_id>` to `gem.make(env_id, **kwargs)` behind the
adapter; a name registered with `@register_env` (the built-ins of `roll.envs.builtin` among them);
a dotted path `package.module.Name` to a class or factory imported with `roll.utils.imports`.
Constructor kwargs come from config as a dict.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from roll.envs.protocol import Env
from roll.utils.imports import import_object

EnvFactory = Callable[..., Env]
F = TypeVar("F", bound=Callable[..., Any])

GEM_PREFIX = "gem:"
_registry: dict[str, EnvFactory] = {}


def register_env(name: str) -> Callable[[F], F]:
    """Decorator registering an environment class (or a function returning an environment) under `name`."""
    if not name or "." in name or name.startswith(GEM_PREFIX):
        raise ValueError(f"environment name {name!r} must be non-empty, without '.' and not start with {GEM_PREFIX!r}")

    def register(factory: F) -> F:
        existing = _registry.get(name)
        if existing is not None and _qualified(existing) != _qualified(factory):
            raise ValueError(f"environment {name!r} is already registered to {_qualified(existing)}")
        _registry[name] = factory
        return factory

    return register


def registered_envs() -> list[str]:
    """The registered names, built-ins included, sorted."""
    _load_builtins()
    return sorted(_registry)


def env_factory(name: str, field: str = "env") -> EnvFactory:
    """What `name` builds environments with; ValueError naming `field` when it names nothing.

    Cheap enough for config checks before Ray: it imports the environment's module, builds nothing.
    """
    if name.startswith(GEM_PREFIX):
        from roll.envs.gem_adapter import GemEnv, check_gem_id

        check_gem_id(name.removeprefix(GEM_PREFIX), field)
        return functools.partial(GemEnv, name.removeprefix(GEM_PREFIX))
    _load_builtins()
    if name in _registry:
        return _registry[name]
    if "." in name:
        factory = import_object(name, field)
        if not callable(factory):
            raise ValueError(f"{field} {name!r} is a {type(factory).__name__}, not an environment class or factory")
        return factory
    raise ValueError(
        f"{field} {name!r} is not a registered environment (registered: {', '.join(registered_envs())}), "
        f"a dotted path 'package.module.Name' or '{GEM_PREFIX}<env_id>'"
    )


def make_env(name: str, kwargs: Mapping[str, Any] | None = None, field: str = "env") -> Env:
    """The environment `name` builds with `kwargs`; ValueError naming `field` for a bad name or kwargs."""
    factory = env_factory(name, field)
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{field} {name!r} does not take the kwargs {sorted(kwargs)}: {exc}") from exc
    except ValueError:
        pass  # no signature to check (a builtin): the call below tells
    env = factory(**kwargs)
    if not isinstance(env, Env):
        raise ValueError(f"{field} {name!r} built a {type(env).__name__}, which has no reset(seed) and step(action)")
    return env


def _qualified(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _load_builtins() -> None:
    # Imported on first use, not at the top: the built-in modules import this one to register.
    import roll.envs.builtin  # noqa: F401
