"""ParallelDims: owns the parallel degrees, checks they fit the world size, and builds the device mesh."""

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
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _flat: dict = field(default_factory=dict, repr=False)

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

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> "ParallelDims":
        return cls(dp_replicate=parallelism.data_parallel_replicate_degree,
                   dp_shard=parallelism.data_parallel_shard_degree,
                   cp=parallelism.context_parallel_degree, tp=parallelism.tensor_parallel_degree,
                   pp=parallelism.pipeline_parallel_degree, world_size=world_size)

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

    @property
    def mesh(self) -> DeviceMesh:
        assert self._mesh is not None, "build_mesh() first"
        return self._mesh

    def submesh(self, name: str) -> DeviceMesh:
        """A named sub-mesh: pp, dp_replicate, dp_shard, cp, tp, batch, loss, fsdp or stage."""
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
        return (f"world {self.world_size} = dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x "
                f"cp {self.cp} x tp {self.tp} x pp {self.pp}")
