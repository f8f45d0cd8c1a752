"""Universal checkpoints in Megatron-Bridge (PyPI megatron-bridge; README "Megatron-Bridge"):

    import megatron_ucp.bridge          # before megatron.bridge: registers the manager below
    from megatron.bridge.training.pretrain import pretrain
    config.checkpoint.custom_manager_class = "megatron_ucp.bridge.UniversalCheckpointManager"
    pretrain(config, forward_step)

Importing this package calls `install()`: Bridge's allowlist for `custom_manager_class`
(utils/instantiate_utils.py:146) gains `megatron_ucp.bridge`, the stand-ins for what Bridge
imports of transformer-engine and nvidia-resiliency-ext are put in place where those are not
installed (imports.py), and megatron-core's trainer bugs that Bridge meets too are mended
(megatron_lm/trainer_fixes.py). `install(cpu=True)` adds the CPU/gloo mode (cpu.py).
"""

_INSTALLED = {}

PREFIX = "megatron_ucp.bridge"


def install(cpu: bool = False) -> None:
    """Make Bridge accept and run UniversalCheckpointManager in this process (idempotent);
    `cpu`: also the CPU/gloo mode. Call before Bridge's pretrain()."""
    import importlib
    import importlib.util

    from megatron_ucp.bridge import imports
    from megatron_ucp.errors import ConfigError

    if not _INSTALLED:
        imports.install()
        try:
            instantiate = importlib.import_module("megatron.bridge.utils.instantiate_utils")
        except ImportError as e:
            raise ConfigError(f"megatron_ucp.bridge needs Megatron-Bridge (megatron-bridge 0.6.2 with "
                              f"megatron-core 0.19; README 'Megatron-Bridge': `bash run.sh setup-bridge`): {e}")
        instantiate.register_allowed_target_prefix(PREFIX)
        _bridge_fixes()
        _INSTALLED["cpu"] = False
    if cpu and not _INSTALLED["cpu"]:
        from megatron_ucp.bridge import cpu as cpu_mode

        cpu_mode.enable()
        _INSTALLED["cpu"] = True


def _bridge_fixes() -> None:
    """megatron-core's release fixes (mcore/compat.py) and trainer bugs (megatron_lm/trainer_fixes.py)
    where Bridge meets them: its
    initialize.py:28 holds compile_helpers by name (and 147 runs `make` in a wheel that ships the
    helpers compiled and no Makefile)."""
    import importlib

    from megatron_ucp.mcore import compat
    from megatron_ucp.megatron_lm import trainer_fixes

    compat.apply()  # megatron-core's release fixes, as Megatron-LM's plug-in applies them (experts' biases, ...)
    trainer_fixes.apply()
    utils = importlib.import_module("megatron.core.datasets.utils")
    importlib.import_module("megatron.bridge.training.initialize").compile_helpers = utils.compile_helpers


def __getattr__(name):
    if name == "UniversalCheckpointManager":
        from megatron_ucp.bridge.manager import UniversalCheckpointManager

        return UniversalCheckpointManager
    raise AttributeError(name)


install()
