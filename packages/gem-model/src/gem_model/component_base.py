"""What every registered component is: a named class with a nested pydantic ``Config`` (see
:mod:`gem_model.components` for the interfaces built on it)."""

from __future__ import annotations

import re
from abc import ABC
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")


class ComponentConfig(BaseModel):
    """Base of every component's options. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Component(ABC):
    """A named, configurable piece of a run."""

    name: ClassVar[str]
    Config: ClassVar[type[ComponentConfig]] = ComponentConfig
    shapes_run: ClassVar[bool | frozenset[str]] = True
    """Whether choosing this component makes a run another run (:mod:`gem_model.train.identity`):
    ``True``, its name and every option; a set of option names, its name and those options;
    ``False``, nothing of it (a checkpoint of the run continues under another choice). A component
    that changes what is computed, even by rounding, keeps ``True``."""

    def __init__(self, config: ComponentConfig | None = None):
        self.config = config if config is not None else self.Config()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, config={self.config!r})"
