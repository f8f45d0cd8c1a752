"""The public API for users of their own Megatron training loop.

    from megatron_ucp import save_universal, load_universal
    save_universal(save_dir, iteration, model_chunks, optimizer, scheduler, vocab_size=V,
                   consumed_samples=n)
    result = load_universal(save_dir, model_chunks, optimizer, scheduler, vocab_size=V)

Both are collective over the job's default process group, after megatron's model-parallel
state is initialised. `vocab_size` is the true (unpadded) vocabulary.
"""

from megatron_ucp.engine.load import LoadResult, load_universal
from megatron_ucp.engine.save import save_universal

__all__ = ["save_universal", "load_universal", "LoadResult"]
