"""Importing Megatron-Bridge where two of its GPU-only dependencies are absent.

megatron-bridge 0.6.2 imports transformer-engine unconditionally in peft/lora_layers.py:20
(`import transformer_engine.pytorch as te`: LoRA's fused TE branches, and isinstance checks
against te.Linear / te.LayerNormLinear) and nvidia-resiliency-ext in training/pretrain.py:19
(`from nvidia_resiliency_ext.inprocess import CallWrapper`: in-process restart). The registry's
nvidia-resiliency-ext breaks megatron-core 0.19.2's own dist_checkpointing import
(strategies/nvrx.py:85) and transformer-engine needs CUDA, so where they are not installed those
two Bridge modules, and only they, see a stand-in: its classes match no real module in an
isinstance check and raise ImportError when used. The stand-in never enters sys.modules, so
megatron-core (which probes `import transformer_engine` for its HAVE_TE flags) still sees none.
"""

import builtins
import importlib.abc
import importlib.util
import sys
import types

# The Bridge module that imports, and the absent top-level packages it may see stood in.
STAND_INS = {
    "megatron.bridge.peft.lora_layers": "transformer_engine",
    "megatron.bridge.training.pretrain": "nvidia_resiliency_ext",
}


class _Absent(types.ModuleType):
    """A module of an absent package: attributes are modules or classes that refuse use."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        qualified = f"{self.__name__}.{name}"
        value = _Absent(qualified) if name.islower() else _refusing_class(qualified)
        setattr(self, name, value)
        return value


def _refusing_class(qualified):
    package = qualified.split(".")[0].replace("_", "-")

    def __init__(self, *args, **kwargs):
        raise ImportError(f"{qualified}: {package} is not installed (megatron_ucp.bridge.imports "
                          "stood it in for Megatron-Bridge's import only)")

    return type(qualified.rsplit(".", 1)[-1], (), {"__init__": __init__, "__module__": qualified})


def _importer_with(package):
    """An __import__ that answers `package` (and its submodules) with stand-ins."""
    roots = {}

    def __import__(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and (name == package or name.startswith(package + ".")):
            root = roots.setdefault(package, _Absent(package))
            module = root
            for part in name.split(".")[1:]:
                module = getattr(module, part)
            return module if fromlist else root
        return builtins.__import__(name, globals, locals, fromlist, level)

    return __import__


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, package):
        self.loader, self.package = loader, package

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__dict__["__builtins__"] = dict(vars(builtins), __import__=_importer_with(self.package))
        self.loader.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        package = STAND_INS.get(fullname)
        if package is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                spec.loader = _Loader(spec.loader, package)
                return spec
        return None


def install() -> None:
    """Stand in for the absent packages in STAND_INS's Bridge modules (idempotent); a package
    that is installed is imported as it is."""
    for importer, package in list(STAND_INS.items()):
        if importlib.util.find_spec(package) is not None:
            STAND_INS.pop(importer)
    if STAND_INS and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
