"""megatron-ucp: universal checkpoints for megatron-core GPT training.

`save_universal` / `load_universal` (see megatron_ucp.api) are imported lazily so that
`import megatron_ucp` stays cheap and imports nothing of megatron-core by itself.
"""

__version__ = "0.1.0"
__all__ = ["save_universal", "load_universal"]


def __getattr__(name):
    if name in __all__:
        from megatron_ucp import api

        return getattr(api, name)
    raise AttributeError(f"module 'megatron_ucp' has no attribute {name!r}")
