"""Model architectures by the name in config.json's ``architectures``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

MODELS: dict[str, type[nn.Module]] = {}


def register_model(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        MODELS[name] = cls
        return cls

    return wrap


def model_class(architecture: str) -> type[nn.Module]:
    import nano_models.models  # noqa: F401  (the architectures register on import)

    try:
        return MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {sorted(MODELS)}"
        ) from None
