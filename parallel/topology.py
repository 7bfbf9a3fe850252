"""Process topology: tensor-parallel groups of consecutive ranks, context- and data-parallel across them.

With world size W, tensor-parallel size T and context-parallel size C (W % (T*C) == 0), rank
r = data_rank * C*T + cp_rank * T + tp_rank (Megatron's order: tp fastest, then cp, then dp):

    TP group g (g = 0..W/T-1):  ranks [g*T, ..., g*T + T-1]
    DP group t (t = 0..T-1):    ranks [t, T + t, 2T + t, ...]   (every rank with tp_rank t)
    CP group:                   the C ranks with the same data_rank and tp_rank, T apart

Consecutive ranks share a node on a cluster, so the chatty TP collectives stay on NVLink; the
CP ranks (a K/V all-gather per layer) come next.

"DP" here is DeepSpeed's data-parallel group: the ranks that hold the same parameters (the same
TP shard) and average their gradients: data x context parallel (Megatron's "data-parallel with
context-parallel" group), so ZeRO partitions and gradient reduction run over dp_size = W / T
ranks. Samples are split only over `data_size` = W / (T*C) (`data_rank`): the C ranks of a CP
group read the same window, each computing two of its 2C chunks (loomtrain.parallel.context).
At cp 1 data_* and dp_* are the same.

`torch.distributed.new_group` must be called by every rank, for every group, in
the same order, even for groups the rank is not in; `Topology` does exactly that.
Without an initialised process group (a lone process) the groups are None and
only tp == 1 is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# torch.distributed is imported where it is used, so that config validation can
# call check_tp without importing torch.


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp (each rank holds vocab_padded / tp rows)."""
    return -(-vocab_size // tp) * tp


def tp_problem(model_cfg, tp: int) -> str | None:
    """Why this model cannot be split `tp` ways (heads, KV heads, FFN width), or None."""
    n_heads, n_kv = model_cfg.n_heads, model_cfg.kv_heads
    if n_heads % tp:
        return f"model.n_heads={n_heads} is not divisible by tp"
    if n_kv % tp and (n_kv > tp or tp % n_kv):
        return f"model.n_kv_heads={n_kv} must be divisible by tp, or divide tp (fewer KV heads than tp are replicated)"
    if model_cfg.ffn_dim % tp:
        return f"FFN hidden size {model_cfg.ffn_dim} (model.ffn_hidden) is not divisible by tp"
    # The vocabulary needs no check: the plan pads it to a multiple of tp (151,936 at tp 3
    # holds 50,646 rows a rank, the last 2 zeros that no token id reaches).
    return None


def check_tp(model_cfg, tp: int, world_size: int | None = None) -> None:
    """Raise a one-line ValueError naming `parallel.tp` if this model cannot be split tp ways;
    the line lists the tp sizes that do split it (14 query / 2 KV heads: 1, 2).

    Run it before any worker builds a model (the launcher's config validation may
    call it directly); `Topology(..., model_cfg=...)` and `parallelize` call it too.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"parallel.tp: must be a positive integer, got {tp!r}")
    if world_size is not None and world_size % tp:
        raise ValueError(f"parallel.tp={tp}: world size {world_size} is not divisible by tp")
    if model_cfg is None or tp == 1:
        return
    problem = tp_problem(model_cfg, tp)
    if problem is not None:
        # every tp this model splits into: a divisor of n_heads that the KV heads and FFN allow
        sizes = ", ".join(str(t) for t in range(1, model_cfg.n_heads + 1) if tp_problem(model_cfg, t) is None)
        raise ValueError(f"parallel.tp={tp}: {problem}; the tp sizes that split this model: {sizes}")


def check_cp(cp: int, world_size: int | None = None, tp: int = 1, seq_len: int | None = None) -> None:
    """Raise a one-line ValueError naming `parallel.cp` when the world does not split into
    tp x cp x dp, or a sequence does not split into 2 x cp equal chunks."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"parallel.cp: must be a positive integer, got {cp!r}")
    if world_size is not None and world_size % (tp * cp):
        raise ValueError(f"parallel.cp={cp}: world size {world_size} is not divisible by tp x cp = {tp} x {cp}")
    if seq_len is not None and cp > 1 and seq_len % (2 * cp):
        raise ValueError(
            f"parallel.cp={cp}: train.seq_len={seq_len} must be divisible by 2 x cp = {2 * cp} (chunks i and 2cp-1-i)"
        )


def ranks_by_host(hosts) -> dict[str, list[int]]:
    """host -> its global ranks, hosts in the order of their first rank."""
    out: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        out.setdefault(host, []).append(rank)
    return out


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(r) if r == start else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def describe_hosts(hosts) -> str:
    """e.g. '2 hosts: node/10.0.0.1 ranks 0-3, node/10.0.0.2 ranks 4-7'."""
    by_host = ranks_by_host(hosts)
    n = len(by_host)
    return f"{n} host{'s' if n != 1 else ''}: " + ", ".join(f"{h} {_spans(rs)}" for h, rs in by_host.items())


def _tp_groups_split(hosts, tp: int) -> list[list[int]]:
    tp_groups, _ = Topology.layout(len(hosts), tp)
    return [g for g in tp_groups if len({hosts[r] for r in g}) > 1]


def check_tp_placement(tp: int, hosts, allow_cross_host: bool = False) -> None:
    """Raise a one-line ValueError naming `parallel.tp` when a TP group (consecutive ranks)
    would span hosts: its all-reduces, several per layer and step, would then cross the
    network between them instead of staying on one host's links. `hosts` is every rank's
    host, by global rank; world size % tp is checked before (check_tp)."""
    if allow_cross_host or tp == 1 or len(set(hosts)) < 2:
        return
    split = _tp_groups_split(hosts, tp)
    if not split:
        return
    world = len(hosts)
    fits = max(t for t in range(1, tp) if world % t == 0 and not _tp_groups_split(hosts, t))
    counts = sorted({len(rs) for rs in ranks_by_host(hosts).values()})
    per_host = "/".join(map(str, counts)) + (" rank" if counts == [1] else " ranks") + " per host"
    raise ValueError(
        f"parallel.tp={tp}: the tensor-parallel group of {_spans(split[0])} would span hosts "
        f"({describe_hosts(hosts)}; {per_host}); use parallel.tp={fits}, or start a multiple of {tp} "
        f"ranks on each host (torchrun --nproc_per_node {tp}), or set parallel.allow_cross_host_tp=true "
        f"to run it anyway"
    )


@dataclass
class Topology:
    world_size: int
    rank: int
    tp: int = 1
    model_cfg: object = field(default=None, repr=False)
    cp: int = 1
    tp_group: object = field(default=None, init=False, repr=False)
    dp_group: object = field(default=None, init=False, repr=False)
    cp_group: object = field(default=None, init=False, repr=False)
    tp_ranks: list = field(default_factory=list, init=False)
    dp_ranks: list = field(default_factory=list, init=False)
    _subgroups: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        import torch.distributed as dist

        check_tp(self.model_cfg, self.tp, self.world_size)
        check_cp(self.cp, self.world_size, self.tp)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        tp_groups, dp_groups = self.layout(self.world_size, self.tp)
        self.tp_ranks = tp_groups[self.dp_rank]
        self.dp_ranks = dp_groups[self.tp_rank]
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise ValueError(
                    f"Topology(world_size={self.world_size}) but torch.distributed "
                    f"has world size {dist.get_world_size()}"
                )
            # Every rank creates every group, in the same order.
            self.tp_group = self._new_groups(tp_groups)
            self.dp_group = self._new_groups(dp_groups)
            if self.cp > 1:  # after the TP and DP groups, so that cp 1 creates the groups it always did
                self.cp_group = self._new_groups(self.cp_layout(self.world_size, self.tp, self.cp))
        elif self.world_size > 1:
            raise ValueError(f"Topology(world_size={self.world_size}) needs torch.distributed initialised first")

    def _new_groups(self, groups: list[list[int]]):
        """Create every group of `groups` (a collective: every rank, in the same order); this rank's."""
        import torch.distributed as dist

        mine = None
        for ranks in groups:
            g = dist.new_group(ranks)
            if self.rank in ranks:
                mine = g
        return mine

    @staticmethod
    def layout(world_size: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
        """(TP groups, DP groups) as lists of global ranks, in creation order."""
        tp_groups = [list(range(g * tp, (g + 1) * tp)) for g in range(world_size // tp)]
        dp_groups = [list(range(i, world_size, tp)) for i in range(tp)]
        return tp_groups, dp_groups

    @staticmethod
    def cp_layout(world_size: int, tp: int, cp: int) -> list[list[int]]:
        """CP groups as lists of global ranks, in creation order."""
        data = world_size // (tp * cp)
        return [[d * cp * tp + c * tp + t for c in range(cp)] for d in range(data) for t in range(tp)]

    # Ranks and sizes --------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.tp

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def cp_size(self) -> int:
        return self.cp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def data_size(self) -> int:
        """How many ways the samples are split (dp_size / cp)."""
        return self.world_size // (self.tp * self.cp)

    @property
    def data_rank(self) -> int:
        return self.rank // (self.tp * self.cp)

    def tp_subgroup(self, size: int):
        """This rank's group among blocks of `size` consecutive ranks inside each TP group
        (e.g. the ranks sharing one replicated KV head). Collective: every rank must call
        it with the same sizes in the same order (the plan does); cached per size."""
        if self.tp % size:
            raise ValueError(f"parallel.tp={self.tp}: sub-group size {size} does not divide tp")
        if size not in self._subgroups:
            import torch.distributed as dist

            blocks = [list(range(start, start + size)) for start in range(0, self.world_size, size)]
            initialised = dist.is_available() and dist.is_initialized()
            self._subgroups[size] = self._new_groups(blocks) if initialised else None
        return self._subgroups[size]

    @property
    def mpu(self):
        """The model-parallel-unit object `deepspeed.initialize(mpu=...)` expects."""
        from loomtrain.parallel.mpu import MPU

        return MPU(self)
