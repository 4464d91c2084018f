"""ParallelDims: owns the parallel degrees, checks they fit the world size, and builds the device mesh (with the
expert-parallel view of it for MoE models)."""

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_lite.errors import ConfigError

# Outer to inner: pipeline stages are furthest apart, tensor parallel ranks are neighbours (same node).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    # Expert parallel (MoE): the experts of each MoE layer split over ep ranks carved from dp_shard x cp x tp, as
    # torchtitan does with expert_tensor_parallel_degree 1: dp_shard * cp * tp = efsdp * ep, ep a multiple of cp * tp.
    ep: int = 1
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _flat: dict = field(default_factory=dict, repr=False)
    _sparse: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._resolve_and_check()

    def _resolve_and_check(self) -> None:
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"parallel degrees do not divide the world size: world {self.world_size} is not divisible by "
                    f"dp_replicate {self.dp_replicate} x cp {self.cp} x tp {self.tp} x pp {self.pp} = {others}")
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees do not multiply to the world size: dp_replicate {self.dp_replicate} x dp_shard "
                f"{self.dp_shard} x cp {self.cp} x tp {self.tp} x pp {self.pp} = {product}, but the world size is "
                f"{self.world_size} (NGPU x NNODES)")
        self._check_ep()

    def _check_ep(self) -> None:
        """EP ranks are carved from the ranks that split the data of one model replica: dp_shard x cp x tp."""
        carved, inner = self.dp_shard * self.cp * self.tp, self.cp * self.tp
        if self.ep != 1 and (self.ep < 1 or carved % self.ep or self.ep % inner):
            raise ConfigError(
                f"'parallelism.expert_parallel_degree' = {self.ep} must divide the ranks it is carved from, dp_shard "
                f"{self.dp_shard} x cp {self.cp} x tp {self.tp} = {carved}, and be a multiple of cp x tp = {inner}")

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> "ParallelDims":
        return cls(dp_replicate=parallelism.data_parallel_replicate_degree,
                   dp_shard=parallelism.data_parallel_shard_degree,
                   cp=parallelism.context_parallel_degree, tp=parallelism.tensor_parallel_degree,
                   pp=parallelism.pipeline_parallel_degree, world_size=world_size,
                   ep=parallelism.expert_parallel_degree)

    # ---------------------------------------------------------------- the mesh

    def build_mesh(self, device_type: str) -> None:
        """The world mesh over MESH_DIMS plus flattened views: batch (data loading), loss, fsdp, and stage (every rank
        of one pipeline stage: those holding the same parameters, sharded or not)."""
        shape = tuple(getattr(self, name) for name in MESH_DIMS)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        # Keep the flattened meshes: slicing them back out of the root mesh is deprecated.
        self._flat = {"batch": mesh["dp_replicate", "dp_shard"]._flatten("batch"),
                      "loss": mesh["dp_replicate", "dp_shard", "cp"]._flatten("loss"),
                      "fsdp": mesh["dp_shard", "cp"]._flatten("fsdp"),
                      "stage": mesh["dp_replicate", "dp_shard", "cp", "tp"]._flatten("stage")}
        self._mesh = mesh
        if self.ep_enabled:
            self._build_expert_mesh(mesh)

    def _build_expert_mesh(self, mesh: DeviceMesh) -> None:
        """The same ranks seen by the experts: dp_shard split into efsdp (outer) x dp_shard_in_ep (inner), whose
        inner part with cp and tp is ep (each EP group holds every expert once); efsdp, with dp_replicate, shards
        the experts' parameters as FSDP/HSDP."""
        in_ep = self.ep // (self.cp * self.tp)
        sparse = mesh._unflatten("dp_shard", (self.dp_shard // in_ep, in_ep), ("efsdp", "dp_shard_in_ep"))
        self._flat["ep"] = sparse["dp_shard_in_ep", "cp", "tp"]._flatten("ep")
        self._flat["efsdp"] = sparse["efsdp"]
        self._sparse = sparse

    @property
    def expert_data_parallel_mesh(self) -> DeviceMesh:
        """The mesh that shards (efsdp) and replicates (dp_replicate) the experts' parameters: 1-D, or 2-D for HSDP."""
        assert self._sparse is not None, "build_mesh() with ep > 1 first"
        return self._sparse["dp_replicate", "efsdp"] if self.dp_replicate_enabled else self._sparse["efsdp"]

    @property
    def mesh(self) -> DeviceMesh:
        assert self._mesh is not None, "build_mesh() first"
        return self._mesh

    def submesh(self, name: str) -> DeviceMesh:
        """A named sub-mesh: pp, dp_replicate, dp_shard, cp, tp, batch, loss, fsdp or stage; ep and efsdp with EP."""
        return self._flat[name] if name in self._flat else self.mesh[name]

    # ---------------------------------------------------------------- derived degrees

    @property
    def dp_degree(self) -> int:
        """Ranks that read different data (replicate x shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """Ranks of one replica that hold the same experts (and shard their parameters): dp_shard x cp x tp / ep."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def gradient_average_degree(self) -> int:
        """Ranks over which data-parallel gradient reduction averages (1 when no data parallelism is applied).

        The loss is scaled up by this so that the averaged gradient is the gradient of (sum of token losses /
        global tokens), exactly as on one process; this avoids FSDP's custom divide factor (PREMUL_SUM),
        which gloo lacks.
        """
        return self.dp_replicate * self.dp_shard * self.cp if (self.fsdp_enabled or self.dp_replicate_enabled) else 1

    def describe(self) -> str:
        experts = f" (experts: ep {self.ep} x efsdp {self.efsdp})" if self.ep_enabled else ""
        return (f"world {self.world_size} = dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x "
                f"cp {self.cp} x tp {self.tp} x pp {self.pp}{experts}")
