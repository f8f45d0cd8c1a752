"""Object-store paths (`s3://`, `msc://`) in `--save` / `--load` of Megatron-LM's trainer.

The universal save and load reach a store through format/stores.py, whatever `--enable-msc`
says. Megatron-LM's own code reaches one only through its `maybe_msc` (megatron-core 0.19.2:
`msc://` paths under `--enable-msc`, in its checkpoint code) and otherwise takes the path for a
folder: `os.makedirs("s3://b/p")` makes a local folder `s3:/b/p` and writes there, a silent
loss of the checkpoint at the job's end. The uses of --save that would do so are refused in
`validate_args`, before anything trains, in one line each:
- a checkpoint in megatron's own formats (`--ckpt-format` other than universal, or
  `--non-persistent-ckpt-type global` without its own folder) to a path megatron cannot reach;
- `--log-progress` (its progress.txt: plain `open`, even under --enable-msc);
- wandb without `--wandb-save-dir` (its files default to `<save>/wandb`).
"""

import functools
import importlib

from megatron_ucp.errors import ConfigError
from megatron_ucp.format import storage


def _megatron_reaches(args, path) -> bool:
    return storage.scheme_of(path) == "msc" and bool(getattr(args, "enable_msc", False))


def problem(args):
    """The one-line reason this run's --save cannot be an object-store path, or None."""
    save = getattr(args, "save", None)
    if not storage.is_remote(save):
        return None
    needs = "--save " + save
    if getattr(args, "ckpt_format", None) != "universal" and not _megatron_reaches(args, save):
        how = "--enable-msc and an msc:// path" if storage.scheme_of(save) == "msc" else "an msc:// path and --enable-msc"
        return (f"{needs}: --ckpt-format {args.ckpt_format} is written by Megatron-LM's own code, which reaches an "
                f"object store only through {how}; use --ckpt-format universal")
    if (getattr(args, "non_persistent_ckpt_type", None) == "global" and not getattr(args, "non_persistent_global_ckpt_dir", None)
            and not _megatron_reaches(args, save)):
        return (f"{needs}: --non-persistent-ckpt-type global writes megatron's checkpoints under --save; "
                "give --non-persistent-global-ckpt-dir a folder (or use the local tier, --local-ckpt-dir)")
    if getattr(args, "log_progress", False):
        return (f"{needs}: --log-progress appends to <save>/progress.txt with local file calls "
                "(a local folder named after the URL); drop --log-progress with an object-store --save")
    if getattr(args, "wandb_project", None) and not getattr(args, "wandb_save_dir", None):
        return f"{needs}: wandb writes to <save>/wandb unless --wandb-save-dir names a local folder"
    return None


def checking_store_paths(original):
    """`original` (arguments.validate_args), then the object-store checks of `problem`."""

    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        result = original(args, *rest, **kwargs)
        reason = problem(args)
        if reason is not None:
            raise ConfigError(reason)
        return result

    return validate_args


def install() -> None:
    from megatron_ucp.megatron_lm.patching import replace_everywhere

    arguments = importlib.import_module("megatron.training.arguments")
    replace_everywhere(arguments.validate_args, checking_store_paths(arguments.validate_args))
