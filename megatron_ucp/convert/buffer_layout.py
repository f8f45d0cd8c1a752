"""Where megatron-core's distributed optimizer keeps each parameter in its flat buffers.

megatron records no such layout, yet both converters need it to find a parameter's optimizer
state in what was saved: the flat buffers of a legacy `distrib_optim.pt` (convert/legacy.py) and
the `dp_reshardable` bucket tensors of a torch_dist checkpoint (convert/torch_dist.py). It is
derived here by pure functions; each converter checks the result against what its checkpoint
records (buffer and bucket sizes, chunk boundaries, the weights found there).
"""

import math

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"  # with tied embeddings, the last stage's copy of EMBEDDING


def shared_embedding(name, chunk, n_chunks, pp_rank, pp, tied) -> bool:
    """megatron's `shared_embedding` mark (a bucket of its own): tied embeddings split over stages."""
    if not tied or pp == 1:
        return False
    pre = pp_rank == 0 and chunk == 0
    post = pp_rank == pp - 1 and chunk == n_chunks - 1
    return (name == EMBEDDING and pre and not post) or (name == OUTPUT and post and not pre)


def bucket_layout(params, dp: int, bucket_size: int | None, pad_for_high_busbw: bool = False):
    """Where each parameter lies in the distributed optimizer's buckets of one buffer.

    params: [(name, numel, shared_embedding)] in the model's parameter order. Mirrors
    megatron-core 0.16's `_ParamAndGradBuffer` (distributed optimizer; the same rules moved to
    `DistributedOptimizer._compute_per_buffer_param_layout` and `optimizer/param_layout.py` in
    0.19): parameters in reverse
    order, each start padded to 64 elements, bucket ends padded to lcm(dp, 128) (and 2^16 with
    `pad_buckets_for_high_nccl_busbw`), the shared embedding in a bucket of its own. Returns
    ({name: (bucket, offset in the bucket, numel)}, [each bucket's numel without its end padding]).
    """
    divisor = math.lcm(dp, 128, 2**16) if pad_for_high_busbw else math.lcm(dp, 128)

    def pad(n, d):
        return -(-n // d) * d

    index, buckets = {}, []
    bucket_start, start, in_bucket = 0, 0, 0
    end = 0

    def close(end_index):
        nonlocal bucket_start, in_bucket
        buckets.append(end_index - bucket_start)
        bucket_start, in_bucket = pad(end_index, divisor), 0
        return bucket_start

    for name, numel, shared in reversed(list(params)):
        start = pad(start, 64)
        if shared and in_bucket:
            start = close(start)
        end = start + numel
        index[name] = (len(buckets), start - bucket_start, numel)
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            start = close(end)
        else:
            start = end
    if in_bucket:
        close(end)
    return index, buckets


def buffer_offsets(params, dp: int, bucket_size: int | None, pad_for_high_busbw: bool = False):
    """Offsets of each parameter in the distributed optimizer's saved flat state of one buffer
    (megatron's `get_parameter_state_dp_zero`: the buckets concatenated without their end
    padding). Returns ({name: (offset, numel)}, numel_unpadded)."""
    index, buckets = bucket_layout(params, dp, bucket_size, pad_for_high_busbw)
    starts = [sum(buckets[:b]) for b in range(len(buckets))]
    return {name: (starts[b] + offset, numel) for name, (b, offset, numel) in index.items()}, sum(buckets)
