"""Megatron-DeepSpeed's query_key_value row order, and the permutation to megatron-core's.

Megatron-DeepSpeed's commit 676a482c (2024-12, "Adding the new feature of FPDT") added the
`ds_sequence_parallel_fpdt*` arguments and, in ParallelAttention.forward, split each TP rank's
query_key_value output in thirds [Q; K; V] (`each_hidden_size = mixed_x_layer.shape[-1] // 3`;
the DeepSpeed sequence-parallel branch likewise, asserting MHA): grouped-query attention does not
compute there. Before it the rows run per key-value group [its query heads; key; value]
(`split_tensor` over `num_key_value_groups + 2` heads; per head [q; k; v] before GQA existed),
megatron-core's order. ds_to_universal concatenates the TP ranks' rows (column-parallel, cat_dim
0), so a 'thirds' checkpoint holds [Q_0; K_0; V_0; Q_1; K_1; V_1; ...] per saving TP rank.
"""

from typing import Optional

from megatron_ucp.convert.deepspeed_map import Model
from megatron_ucp.errors import ConfigError

FPDT_KEYS = ("ds_sequence_parallel_fpdt", "ds_sequence_parallel_fpdt_chunk_size",
             "ds_sequence_parallel_fpdt_offloading")
# Every Megatron-DeepSpeed since 2021 parses its arguments through deepspeed.add_config_arguments:
# args holding this are a whole argument namespace, in which FPDT_KEYS' absence means an older one.
WHOLE_NAMESPACE_KEY = "deepspeed_config"
QKV_LAYOUTS = ("grouped", "thirds")


def qkv_layout(args: dict, m: Model, choice: Optional[str], where: str) -> str:
    """How the checkpoint's query_key_value rows are ordered: 'thirds' ([Q; K; V] on each saving
    TP rank) or 'grouped' (per key-value group [q; k; v]); `choice` (--qkv-layout) where given.
    ConfigError where the args do not tell, or tell a layout that cannot compute the model."""
    gqa = m.num_query_groups != m.num_attention_heads
    marks = [k for k in FPDT_KEYS if k in args]
    what = f"{m.num_attention_heads} attention heads in {m.num_query_groups} key-value groups"
    if choice is not None:
        if choice not in QKV_LAYOUTS:
            raise ConfigError(f"--qkv-layout {choice!r}: expected one of {', '.join(QKV_LAYOUTS)}")
        if choice == "thirds" and gqa:
            raise ConfigError(f"--qkv-layout thirds: {what}; Megatron-DeepSpeed's thirds split computes only "
                              "multi-head attention (one key-value group per head)")
        return choice
    if marks:
        if gqa:
            raise ConfigError(f"{where}: args.{marks[0]} marks a Megatron-DeepSpeed since 676a482c, whose "
                              f"query_key_value split in thirds [Q; K; V] cannot compute {what}: pass "
                              "--qkv-layout grouped if the weights are per group [q; k; v] (an older one's)")
        return "thirds"
    if gqa:
        return "grouped"  # the thirds split computes no grouped-query attention
    if WHOLE_NAMESPACE_KEY in args:
        return "grouped"  # a whole namespace of a Megatron-DeepSpeed before 676a482c
    raise ConfigError(f"{where}: cannot tell the order of query_key_value's rows: Megatron-DeepSpeed since "
                      f"676a482c (args with {FPDT_KEYS[0]}) splits them in thirds [Q; K; V], older ones per "
                      f"head [q; k; v], and these args have neither mark: pass --qkv-layout thirds or "
                      "--qkv-layout grouped")


def qkv_rows(layout: str, m: Model, tp: int, where: str = "the checkpoint"):
    """For each row of megatron-core's linear_qkv (per group: its query heads, key, value), the
    row of the checkpoint's query_key_value holding it; None where the orders agree. 'thirds'
    is per saving TP rank: ds_to_universal concatenates the ranks' [Q_r; K_r; V_r]."""
    if layout == "grouped":
        return None
    heads, kv = m.num_attention_heads, m.kv_channels
    if heads % tp:
        raise ConfigError(f"{where}: {heads} attention heads do not split over the saving run's {tp} TP ranks "
                          "(checkpoint_parallel_dimensions.tp_degree), which the thirds layout is cut by")
    per = heads // tp
    rows = []
    for h in range(heads):
        rank, j = divmod(h, per)
        for part in range(3):  # its query, key and value head
            first = (3 * rank + part) * per * kv + j * kv
            rows.extend(range(first, first + kv))
    return rows
