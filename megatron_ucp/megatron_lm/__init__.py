"""Universal checkpoints inside Megatron-LM's own trainer (`megatron.training`: shipped in
megatron-core >= 0.17, or a Megatron-LM clone's beside an earlier wheel).

    torchrun ... -m megatron_ucp.megatron_lm [--cpu] pretrain_gpt.py ARGS --ckpt-format universal
    # or, from inside a script, before it calls megatron.training.pretrain:
    import megatron_ucp.megatron_lm; megatron_ucp.megatron_lm.install()

`install()` changes the trainer in these places, and nowhere else (docs/megatron_lm.md):
- its parser (flags.py): `--ckpt-format` gains `universal`, and the project's flags join it
  (checkpoint flags, `--load-universal`, `--elastic`, `--loss-log`, `--cpu`);
- `validate_args` (elastic.py): with `--elastic`, the layout is chosen for the world size first;
- `validate_args` (fsdp_flags.py): a universal FSDP run passes the checks that name megatron's
  FSDP checkpoint formats; (store_paths.py): an object-store `--save` that megatron's own code
  would write as a local folder is refused;
- `train_step` (loss_log.py): with `--loss-log`, one JSON line per iteration;
- `pretrain` (owner.py): at a clean end, the --save folder's or prefix's owner record of the
  universal saves is given up, as the own loop does;
- its checkpoint functions (checkpoint.py): `save_checkpoint` writes universal checkpoints when
  `--ckpt-format universal`, `load_checkpoint` loads any universal checkpoint on any layout
  whatever `--ckpt-format` says, `load_args_from_checkpoint` reads a manifest's arguments, and
  the padded vocabulary is taken from the checkpoint before the model is built; every other
  case is Megatron-LM's own code;
- `--cpu` only (cpu.py): the trainer's CUDA assumptions answered for CPU processes over gloo.
Megatron bugs that GPU users hit too are mended whatever the flags (trainer_fixes.py).
The training loop itself is untouched: every Megatron-LM flag works as Megatron-LM defines it.
"""

import importlib.util

_INSTALLED = {}


def install(cpu: bool = False) -> None:
    """Install universal checkpointing into Megatron-LM's trainer (idempotent); `cpu` also the
    CPU/gloo mode. Call before the trainer parses its arguments."""
    from megatron_ucp.errors import ConfigError
    from megatron_ucp.mcore import compat

    if importlib.util.find_spec("megatron.training") is None:  # what is there, not a version
        raise ConfigError(f"megatron-core {'.'.join(map(str, compat.core_version()))} without "
                          "megatron.training (the wheel ships it from 0.17; on 0.16 put a Megatron-LM "
                          "clone's megatron/training beside it, README 'Megatron-LM's trainer on "
                          "0.16'), or use pretrain_gpt_ucp.py, the project's own loop")
    if _INSTALLED.get("cpu") is not None:
        if cpu and not _INSTALLED["cpu"]:
            raise ConfigError("megatron_ucp.megatron_lm.install(cpu=True) after install() without it")
        return
    from megatron_ucp.megatron_lm import (checkpoint, elastic, flags, fsdp_flags, local_tier, loss_log, owner,
                                         store_paths, trainer_fixes)

    compat.apply()
    trainer_fixes.apply()
    if cpu:
        from megatron_ucp.megatron_lm import cpu as cpu_mode

        cpu_mode.enable()
    flags.install(cpu)
    elastic.install()
    local_tier.install()  # after elastic: its validate_args runs first
    fsdp_flags.install()
    store_paths.install()
    checkpoint.install()
    loss_log.install()
    owner.install()
    _INSTALLED["cpu"] = cpu
