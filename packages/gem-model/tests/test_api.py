"""``gem_model.api``, the plugins' one door into the core: every name it lists resolves, and importing it
(as every plugin's ``plugin.py`` does) pulls in neither torchrec nor the trainer."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gem_model import api


def test_every_listed_name_resolves_to_the_module_the_table_names():
    assert sorted(api.__all__) == sorted([*api._WHERE, "hookimpl"])
    for name, module in api._WHERE.items():
        value = getattr(api, name)
        assert value is getattr(sys.modules[module], name), name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        api.NoSuchName


def test_importing_the_api_for_hookimpl_stays_light():
    code = "import sys; from gem_model.api import hookimpl; print(sorted(m for m in ('torchrec', 'gem_model.train.run', 'gem_model.model.gem') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
