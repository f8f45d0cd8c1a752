"""The project's own checkpoint flags, one declaration for both parsers: the project's loop
(mcore/flags.py) and Megatron-LM's trainer through the plug-in (megatron_lm/flags.py)."""


def add_universal_flags(group) -> None:
    """What a universal save or load takes beyond Megatron-LM's checkpoint flags."""
    group.add_argument("--keep-last", type=int, default=None,
                       help="universal: keep only the newest N checkpoints (never the one the tracker names)")
    group.add_argument("--no-verify-checkpoint", action="store_true",
                       help="universal: skip the block-checksum verification of a checkpoint on load")
    group.add_argument("--no-resume-proof", action="store_true",
                       help="universal: load even when the restored state fails the checkpoint's resume "
                            "proof (what its model computed at save, recomputed on the new layout); "
                            "without it such a load stops, and a local-tier copy is set aside")
    group.add_argument("--no-strict-load", action="store_true",
                       help="universal: ignore checkpoint tensors that have no place in the model")
    group.add_argument("--ckpt-read-policy", choices=["auto", "once", "per-rank"], default="auto",
                       help="universal: 'once' reads what data-parallel replicas share once per replica "
                            "group, each member a share, exchanged over the group; 'per-rank': every "
                            "rank reads all it holds (faster where the replicas share a node, whose "
                            "page cache serves them one read); 'auto' (default): once where a replica "
                            "group spans nodes, else per rank")
    group.add_argument("--exit-on-save-failure", action="store_true",
                       help="with a local checkpoint tier, a failed persistent save stops training "
                            "(default: a warning, and the next interval saves again)")
