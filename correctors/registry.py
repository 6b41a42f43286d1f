"""Corrector registry: ``get_corrector("tis", clip=2.0)`` and ``register_corrector(name, cls)``.

Names are case-insensitive. Built-ins: ``none``, ``is``, ``tis``, ``mis``, ``ais``. A ``Corrector``
instance (or any callable with the corrector signature) passes through ``get_corrector`` untouched.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from .ais import AISCorrector
from .base import Correction, Corrector
from .is_family import ISCorrector, MISCorrector, NoCorrector, TISCorrector

__all__ = ["register_corrector", "get_corrector", "available_correctors"]

_REGISTRY: dict[str, type[Corrector]] = {}
_C = TypeVar("_C", bound=type[Corrector])


def _normalise(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a corrector name must be a non-empty string; got {name!r}")
    return name.strip().lower()


def register_corrector(name: str, cls: _C | None = None, *, overwrite: bool = False) -> Any:
    """Register ``cls`` (a :class:`Corrector` subclass) under ``name``.

    Usable as a call, ``register_corrector("mine", MyCorrector)``, or as a decorator,
    ``@register_corrector("mine")``. Re-registering a taken name needs ``overwrite=True``.
    """
    key = _normalise(name)

    def _register(klass: _C) -> _C:
        if not (inspect.isclass(klass) and issubclass(klass, Corrector)):
            raise ValueError(f"register_corrector needs a Corrector subclass; got {klass!r}")
        if key in _REGISTRY and not overwrite and _REGISTRY[key] is not klass:
            raise ValueError(
                f"corrector name {key!r} is taken by {_REGISTRY[key].__name__}; "
                "pass overwrite=True to replace it or pick another name"
            )
        _REGISTRY[key] = klass
        return klass

    return _register if cls is None else _register(cls)


def available_correctors() -> tuple[str, ...]:
    """Registered names, sorted."""
    return tuple(sorted(_REGISTRY))


def _check_params(key: str, cls: type[Corrector], params: dict[str, Any]) -> None:
    signature = inspect.signature(cls)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return
    allowed = [n for n, p in signature.parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {unknown} for corrector {key!r}; allowed: {allowed or 'none'}"
        )


def get_corrector(
    name_or_instance: str | Corrector | Callable[..., Correction] | None, **params: Any
) -> Corrector | Callable[..., Correction]:
    """Resolve a corrector: a registered name (+ its parameters), or an instance passed through.

    ``None`` means ``"none"``. Any callable instance with the corrector signature that returns a
    :class:`Correction` passes through too. Unknown names and parameters raise ``ValueError``
    listing what exists.
    """
    if name_or_instance is None:
        name_or_instance = "none"
    if not isinstance(name_or_instance, str):
        if not callable(name_or_instance):
            raise ValueError(
                f"corrector must be a name in {list(available_correctors())} or a Corrector instance; "
                f"got {name_or_instance!r}"
            )
        if inspect.isclass(name_or_instance):
            raise ValueError(
                f"got the class {name_or_instance.__name__}; pass an instance or register it with "
                "register_corrector(name, cls) and pass its name"
            )
        if params:
            raise ValueError(f"parameters {sorted(params)} are only accepted with a corrector name, not an instance")
        return name_or_instance
    key = _normalise(name_or_instance)
    if key not in _REGISTRY:
        raise ValueError(f"unknown corrector {name_or_instance!r}; registered: {list(available_correctors())}")
    cls = _REGISTRY[key]
    _check_params(key, cls, params)
    return cls(**params)


for _cls in (NoCorrector, ISCorrector, TISCorrector, MISCorrector, AISCorrector):
    register_corrector(_cls.name, _cls)
