"""Every public name of `omnimtp` resolves, lazily, to the object of the module it names."""

import importlib

import omnimtp


def test_every_export_resolves_to_its_module():
    assert len(omnimtp.__all__) >= 70
    for name in omnimtp.__all__:
        module = importlib.import_module(omnimtp._EXPORTS[name])
        assert getattr(omnimtp, name) is getattr(module, name), name
