"""Elastic layouts: the parallel layout a job uses when it (re)starts on a world size of its own.

The policy, a pure function of the world size, the model's dimensions, the requested layout and
the batch sizes (see docs/elastic.md):

1. The requested layout (TP, PP, CP, EP, expert TP, VPP) is kept when it fits; data
   parallelism DP = world / (TP x PP x CP) absorbs the change of world size.
2. Otherwise pipeline parallelism shrinks first, then tensor parallelism, then context
   parallelism: candidates are tried in the order (CP descending, TP descending, PP descending)
   with each <= its requested size, and the first that fits wins. Nothing ever grows beyond what
   was requested. CP goes last because a long-context run's sequence is the one size the job
   cannot change: CP is what fits its attention's activations (megatron: CP needs the sequence
   length to be a multiple of 2 x CP).
3. Within a candidate, EP (then expert TP) is the largest value <= requested that fits, and the
   virtual pipeline (layers per virtual stage) is kept when it still divides the layers of a
   stage, else dropped (it changes the schedule, not the model). An uneven pipeline split
   (--decoder-first/last-pipeline-num-layers) is kept as given: only PPs it fits are candidates.
4. The micro-batch size and the global batch size are kept; gradient accumulation
   (micro-batches per step) = global / (micro x DP). A candidate for which that is not a whole
   number does not fit.

No fitting layout is a ConfigError naming the world size and what each candidate lacked.
The checks mirror `megatron_ucp.mcore.flag_validation.validate`, which the property tests hold them to.
"""

from collections.abc import Iterator
from dataclasses import dataclass, replace

from megatron_ucp.errors import ConfigError


@dataclass(frozen=True)
class ModelDims:
    """The model facts that limit a layout (from the command line; the architecture is fixed)."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    seq_length: int
    num_experts: int | None = None
    sequence_parallel: bool = False  # requested; megatron drops it when TP is 1
    bias_linear: bool = True  # megatron-core's MoE experts take biases only with expert TP 1
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers


@dataclass(frozen=True)
class Layout:
    """A parallel layout short of DP (which the world size decides)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1  # context parallelism (Megatron-LM's trainer; the own loop has none)
    etp: int | None = None  # expert tensor parallelism; None: follows tp
    vpp_layers: int | None = None  # --num-layers-per-virtual-pipeline-stage

    def describe(self, dp: int | None = None) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if dp is not None:
            parts.append(f"DP{dp}")
        if self.ep > 1 or self.etp is not None:
            parts.append(f"EP{self.ep}")
        if self.etp is not None:
            parts.append(f"ETP{self.etp}")
        if self.vpp_layers is not None:
            parts.append(f"VPP{self.vpp_layers}L")
        return " ".join(parts)


@dataclass(frozen=True)
class Batch:
    micro_batch_size: int
    global_batch_size: int


@dataclass(frozen=True)
class Choice:
    """The layout chosen for `world_size`: DP and the gradient accumulation follow from it."""

    world_size: int
    layout: Layout
    dp: int
    num_microbatches: int
    requested: Layout

    @property
    def kept(self) -> bool:
        return self.layout == self.requested


def pipeline_split_problem(num_layers: int, pp: int, first: int | None, last: int | None) -> str | None:
    """Why the layers cannot be split over `pp` stages (None when they can), megatron-core's rule:
    the first and last stages may hold `first` and `last` layers, the stages between them an equal
    share of the rest."""
    if first is None and last is None:
        if num_layers % pp:
            return f"--pipeline-model-parallel-size ({pp}) must divide --num-layers ({num_layers})"
        return None
    given = [(flag, n) for flag, n in (("--decoder-first-pipeline-num-layers", first),
                                       ("--decoder-last-pipeline-num-layers", last)) if n is not None]
    for flag, n in given:
        if n < 1:
            return f"{flag} must be >= 1, got {n}"
    names = " and ".join(flag for flag, _ in given)
    if pp < 2:
        return f"{names} need --pipeline-model-parallel-size > 1 (got {pp})"
    if pp < len(given):
        return f"{names} need --pipeline-model-parallel-size >= {len(given)} (got {pp})"
    rest = num_layers - sum(n for _, n in given)
    middle = pp - len(given)
    if rest < 0 or bool(rest) != bool(middle) or (middle and rest % middle):
        return (f"--num-layers ({num_layers}) minus {names} leaves {rest} layers, which do not "
                f"divide evenly over the {middle} other stages of --pipeline-model-parallel-size {pp}"
                + (" (each stage needs at least one layer)" if middle and 0 <= rest < middle else ""))
    return None


def _shrink_reason(world_size: int, dims: ModelDims, lay: Layout, batch: Batch) -> str | None:
    """Why `lay` does not fit (None when it does): the checks of args.validate that a layout can fail."""
    tp, pp, ep, cp = lay.tp, lay.pp, lay.ep, lay.cp
    if tp < 1 or pp < 1 or ep < 1 or cp < 1:
        return "sizes must be >= 1"
    if world_size % (tp * pp * cp):
        return (f"TP x PP x CP = {tp * pp * cp}" if cp > 1 else f"TP x PP = {tp * pp}") + \
            " does not divide the world size"
    if cp > 1 and dims.seq_length % (2 * cp):
        return f"CP {cp} needs the sequence length ({dims.seq_length}) to be a multiple of 2 x CP"
    for name, value in (("attention heads", dims.num_attention_heads),
                        ("query groups", dims.num_query_groups), ("FFN size", dims.ffn_hidden_size)):
        if value % tp:
            return f"TP {tp} does not divide the {name} ({value})"
    if dims.sequence_parallel and tp > 1 and dims.seq_length % tp:
        return f"sequence parallel needs TP {tp} to divide the sequence length ({dims.seq_length})"
    split_problem = pipeline_split_problem(dims.num_layers, pp, dims.first_stage_layers,
                                           dims.last_stage_layers)
    if split_problem is not None:
        return split_problem
    dp = world_size // (tp * pp * cp)
    if batch.global_batch_size % (batch.micro_batch_size * dp):
        return (f"global batch {batch.global_batch_size} is not a multiple of micro-batch "
                f"{batch.micro_batch_size} x DP {dp}")
    micro = batch.global_batch_size // (batch.micro_batch_size * dp)
    if lay.vpp_layers is not None:
        if pp == 1:
            return "a virtual pipeline needs PP > 1"
        if (dims.num_layers // pp) % lay.vpp_layers:
            return f"{lay.vpp_layers} layers per virtual stage do not divide {dims.num_layers // pp} per stage"
        # One virtual stage per stage is no interleaving (validate drops it): no batch rule.
        if (dims.num_layers // pp) // lay.vpp_layers > 1 and micro % pp:
            return f"interleaving needs the {micro} micro-batches to be a multiple of PP {pp}"
    if dims.num_experts is None:
        return None if ep == 1 else "EP needs experts"
    etp = lay.etp if lay.etp is not None else tp
    if dims.num_experts % ep:
        return f"EP {ep} does not divide the experts ({dims.num_experts})"
    if (world_size // pp) % (ep * etp):
        return f"EP {ep} x expert TP {etp} does not divide world / PP ({world_size // pp})"
    if tp > 1 and not dims.sequence_parallel:
        return f"megatron-core trains MoE with TP {tp} only with sequence parallelism"
    if etp > 1 and dims.bias_linear:
        return f"expert TP {etp} needs experts without biases"
    return None


def fits(world_size: int, dims: ModelDims, layout: Layout, batch: Batch) -> bool:
    return _shrink_reason(world_size, dims, layout, batch) is None


def _candidates(requested: Layout) -> Iterator[Layout]:
    """Every layout the policy may take, best first (see the module's docstring)."""
    etps = [None] if requested.etp is None else range(requested.etp, 0, -1)
    vpps = [requested.vpp_layers] + ([None] if requested.vpp_layers is not None else [])
    for cp in range(requested.cp, 0, -1):
        for tp in range(requested.tp, 0, -1):
            for pp in range(requested.pp, 0, -1):
                for ep in range(requested.ep, 0, -1):
                    for etp in etps:
                        for vpp in vpps:
                            yield replace(requested, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vpp_layers=vpp)


def choose_layout(world_size: int, dims: ModelDims, requested: Layout, batch: Batch) -> Choice:
    """The layout for `world_size` by the policy above; ConfigError when none fits."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if dims.num_experts is None and requested.ep > 1:
        raise ConfigError("--expert-model-parallel-size > 1 needs --num-experts")
    for lay in _candidates(requested):
        if fits(world_size, dims, lay, batch):
            dp = world_size // (lay.tp * lay.pp * lay.cp)
            return Choice(world_size, lay, dp,
                          batch.global_batch_size // (batch.micro_batch_size * dp), requested)
    why = _shrink_reason(world_size, dims, replace(requested, tp=1, pp=1, cp=1, ep=1,
                                                  etp=None if requested.etp is None else 1,
                                                  vpp_layers=None), batch)
    raise ConfigError(
        f"--elastic: no layout with TP <= {requested.tp}, PP <= {requested.pp}"
        + (f" and CP <= {requested.cp}" if requested.cp > 1 else "") + f" fits world size "
        f"{world_size} (even TP1 PP1: {why}); world sizes that fit are TP x PP"
        + (" x CP" if requested.cp > 1 else "") + " x DP with DP "
        f"dividing global batch / micro-batch ({batch.global_batch_size} / {batch.micro_batch_size})")


def dims_from_args(args) -> ModelDims:
    """ModelDims of parsed (not yet validated) arguments, of either trainer."""
    groups = args.num_query_groups if args.group_query_attention and args.num_query_groups else \
        args.num_attention_heads
    return ModelDims(
        num_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
        num_query_groups=groups, ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        seq_length=args.seq_length, num_experts=args.num_experts,
        sequence_parallel=bool(args.sequence_parallel), bias_linear=_bias_linear(args),
        first_stage_layers=getattr(args, "decoder_first_pipeline_num_layers", None),
        last_stage_layers=getattr(args, "decoder_last_pipeline_num_layers", None))


def _bias_linear(args) -> bool:
    """The own loop's `--disable-bias-linear` is Megatron-LM's `add_bias_linear=False`."""
    if hasattr(args, "disable_bias_linear"):
        return not args.disable_bias_linear
    return bool(getattr(args, "add_bias_linear", True))


def layout_from_args(args) -> Layout:
    return Layout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                  cp=getattr(args, "context_parallel_size", None) or 1, ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                  vpp_layers=args.num_layers_per_virtual_pipeline_stage)


def apply_to_args(args, choice: Choice) -> None:
    """Write the chosen layout into the arguments (args.validate then derives DP and the rest)."""
    lay = choice.layout
    args.tensor_model_parallel_size = lay.tp
    args.pipeline_model_parallel_size = lay.pp
    args.expert_model_parallel_size = lay.ep
    args.expert_tensor_parallel_size = lay.etp
    args.num_layers_per_virtual_pipeline_stage = lay.vpp_layers
    if hasattr(args, "context_parallel_size"):  # Megatron-LM's trainer
        args.context_parallel_size = lay.cp


def saved_description(saved_layout: dict | None) -> str:
    """'TP2 PP1 DP2 on 4 ranks' from a manifest's layout record."""
    if not saved_layout:
        return "an unknown layout"
    g = saved_layout.get
    text = (f"TP{g('tensor_model_parallel_size', '?')} PP{g('pipeline_model_parallel_size', '?')} "
            f"DP{g('data_parallel_size', '?')}")
    if (g("context_parallel_size") or 1) > 1:
        text += f" CP{g('context_parallel_size')}"
    if (g("expert_model_parallel_size") or 1) > 1:
        text += f" EP{g('expert_model_parallel_size')}"
    return f"{text} on {g('world_size', '?')} ranks"


def shared_store_warning(environ) -> str | None:
    """The line to print when torchrun shares its rendezvous store with the workers, which breaks
    restarts after a node loss (pytorch/pytorch#135712: restarted workers read the last round's
    keys and dial dead peers; gloo: "connectFullMesh failed")."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return ("elastic: warning: torchrun shares its rendezvous store with the workers; restarts "
            "after a node loss need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's "
            "environment (docs/elastic.md)")


def summary(choice: Choice, checkpoint: str | None = None) -> str:
    """The one line printed at start-up."""
    how = ("requested layout kept, DP absorbs the world size" if choice.kept else
           f"requested {choice.requested.describe()} does not fit, shrunk")
    line = (f"elastic: world size {choice.world_size}: training on {choice.layout.describe(choice.dp)}, "
            f"{choice.num_microbatches} micro-batches per step ({how})")
    if checkpoint:
        line += f"; resuming {checkpoint}"
    return line
