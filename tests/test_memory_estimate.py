"""The memory estimate: its arithmetic, and its activation bytes against what a real CPU forward keeps for backward."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from titan_lite.config.schema import JobConfig
from titan_lite.job.estimate import layer_policies
from titan_lite.models.args import LlamaArgs
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.parallel import memory_estimate as me
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.parallelize import parallelize_llama

# ------------------------------------------------------------------------- measuring saved activations


def plain_tensors(t: torch.Tensor):
    """The plain tensors holding a tensor's memory: itself, or a DTensor's (or other wrapper's) inner tensors."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):  # some wrappers also list non-tensor attributes
                yield from plain_tensors(inner)
    else:
        yield t


class LiveStorages(TorchDispatchMode):
    """Remembers every storage an op produced; the ones still alive are what autograd and AC caches keep."""

    def __init__(self):
        super().__init__()
        self.sizes = WeakIdKeyDictionary()  # storage -> None: a weak set

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for inner in plain_tensors(t):
                    self.sizes[inner.untyped_storage()] = None
        return out


def measured_saved_bytes(model: torch.nn.Module, batch: int, seq: int, vocab: int, **forward_inputs) -> int:
    """Bytes of tensors alive between the end of forward (loss computed, logits dropped) and backward."""
    tokens = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch * seq,))
    owned = _parameter_storages(model)
    tracker = LiveStorages()
    with tracker:
        logits = model(tokens, **forward_inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets, reduction="sum")
        del logits
        # Sizes now, not at creation: FSDP frees gathered parameters by resizing their storage to zero. Parameters
        # are read again because FSDP's root keeps its gathered (non-DTensor) parameters registered until backward.
        owned |= _parameter_storages(model)
        live = sum(storage.nbytes() for storage in tracker.sizes if storage.data_ptr() not in owned)
    loss.backward()  # the graph must still be usable: nothing was freed early
    return live - sum(inner.untyped_storage().nbytes() for inner in plain_tensors(loss))


def _parameter_storages(model: torch.nn.Module) -> set[int]:
    return {inner.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]
            for inner in plain_tensors(t)}


def checkpointed_model(args: LlamaArgs, mode: str, option: str) -> Llama:
    """The trainer's own AC code (parallelize_llama on a single-rank layout) on a real fp32 CPU model."""
    torch.manual_seed(0)
    cfg = JobConfig()
    cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option = mode, option
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    return parallelize_llama(Llama(args), dims, cfg)


SMALL_GQA = LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=192, max_seq_len=128,
                      rope_theta=10000.0)


def _debugmodel(seq: int, flavor: str = "debugmodel") -> LlamaArgs:
    args = flavor_args(flavor)
    args.max_seq_len = seq
    return args


# tiny_moe: Qwen3-MoE's q/k norms, 3 MoE layers of 8 experts (top 2) and a dense one
MODELS = [(SMALL_GQA, 2, 128), (_debugmodel(64), 2, 64), (_debugmodel(64, "tiny_moe"), 2, 64)]
MODEL_IDS = ["gqa", "debugmodel", "tiny_moe"]


@pytest.mark.parametrize("mode,option", [("none", "op"), ("full", "op"), ("selective", "op"), ("selective", "2")])
@pytest.mark.parametrize("args,batch,seq", MODELS, ids=MODEL_IDS)
def test_activation_estimate_matches_cpu_forward(args, batch, seq, mode, option):
    model = checkpointed_model(args, mode, option)
    measured = measured_saved_bytes(model, batch, seq, args.vocab_size)
    shape = me.ActivationShape(tokens=batch * seq, compute_bytes=4)  # the model's CPU RMSNorm saves (x, rstd)
    estimate = me.saved_activation_bytes(args, layer_policies(model, mode, option), True, shape)
    assert abs(estimate - measured) <= 0.2 * measured, (estimate, measured)
    # Checkpointing must actually save memory in the measured run, in the estimated order none > op > full.
    if mode != "none":
        assert measured < measured_saved_bytes(checkpointed_model(args, "none", "op"), batch, seq, args.vocab_size)


@pytest.fixture
def fake_world_of_2():
    """Rank 0 of a fake 2-rank world: collectives do nothing but return real, correctly shaped tensors."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this test process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
@pytest.mark.parametrize("tp,cp", [(2, 1), (1, 2)], ids=["tp2", "cp2"])
@pytest.mark.parametrize("args", [SMALL_GQA, _debugmodel(128, "tiny_moe")], ids=["gqa", "tiny_moe"])
def test_activation_estimate_matches_cpu_forward_under_tp_or_cp(fake_world_of_2, tp, cp, mode, args):
    """The trainer's TP plan (sequence and loss parallel; MoE experts replicated) or CP attention (with FSDP over the
    cp ranks) on a real CPU model in a fake 2-rank world; CP feeds each rank its half of the sequence."""
    from torch.distributed.tensor.parallel import loss_parallel

    batch, seq = 2, 128
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=cp, tp=tp, pp=1, world_size=2)
    dims.build_mesh("cpu")
    cfg = JobConfig()
    cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option = mode, "op"
    with torch.device("meta"):
        model = Llama(args)
    model = parallelize_llama(model, dims, cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=0, buffer_device=torch.device("cpu"))
    with loss_parallel() if tp > 1 else contextlib.nullcontext():
        measured = measured_saved_bytes(model, batch, seq // cp, args.vocab_size)
    shape = me.ActivationShape(tokens=batch * seq // cp, compute_bytes=4, tp=tp, cp=cp, loss_parallel=tp > 1,
                               seq_len=seq, fused_rms_norm=tp == 1)  # sequence-parallel norms: torch's composite
    policies = layer_policies(model, mode, "op")
    estimate = me.saved_activation_bytes(args, policies, True, shape)
    assert abs(estimate - measured) <= 0.2 * measured, (estimate, measured)
    # splitting over 2 ranks roughly halves what one rank keeps, compared with the single-rank estimate
    single = me.ActivationShape(tokens=batch * seq, compute_bytes=4, fused_rms_norm=tp == 1)
    assert 0.4 < estimate / me.saved_activation_bytes(args, policies, True, single) < 0.75


class PeakLiveActivations(TorchDispatchMode):
    """The largest total of live op outputs at any op boundary of forward + backward, leaving out parameters
    and, as soon as they are accumulated, parameter gradients."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.storages = WeakIdKeyDictionary()  # storage -> None: a weak set
        self.excluded = _parameter_storages(model)
        self.peak = 0
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: self.excluded.add(p.grad.untyped_storage().data_ptr()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.storages[t.untyped_storage()] = None
        live = sum(st.nbytes() for st in self.storages if st.data_ptr() not in self.excluded)
        self.peak = max(self.peak, live)
        return out


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
@pytest.mark.parametrize("args,batch,seq", MODELS, ids=MODEL_IDS)
def test_peak_activation_estimate_matches_cpu_forward_backward(args, batch, seq, mode):
    """The 'activations' row of the dry run (saved + backward working set) against the measured peak."""
    model = checkpointed_model(args, mode, "op")
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    targets = torch.randint(0, args.vocab_size, (batch * seq,))
    tracker = PeakLiveActivations(model)
    with tracker:
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets, reduction="sum")
        del logits
        loss.backward()
    shape = me.ActivationShape(tokens=batch * seq, compute_bytes=4)
    estimate = me.peak_activation_bytes(args, [(layer_policies(model, mode, "op"), True)], shape)
    assert abs(estimate - tracker.peak) <= 0.2 * tracker.peak, (estimate, tracker.peak)


@pytest.mark.parametrize("mode", ["none", "full"])
def test_document_mask_estimate_matches_cpu_forward(mode):
    """Packed documents (block_causal): what a forward keeps on top of the causal one, under two AC policies."""
    from titan_lite.data.datasets import document_positions

    args, batch, seq = SMALL_GQA, 2, 128
    model = checkpointed_model(args, mode, "op")
    documents = torch.arange(seq).repeat(batch, 1) // 20  # documents of 20 tokens
    causal = measured_saved_bytes(model, batch, seq, args.vocab_size)
    packed = measured_saved_bytes(model, batch, seq, args.vocab_size, documents=documents,
                                  positions=document_positions(documents))
    policies = layer_policies(model, mode, "op")
    # eager on a CPU: attention per document, each layer's document outputs kept beside the joined one (without AC)
    spans = me.ActivationShape(tokens=batch * seq, compute_bytes=4, seq_len=seq, document_mask="spans")
    estimate = me.document_mask_bytes(args, spans, policies)
    assert abs(estimate - (packed - causal)) <= 0.1 * (packed - causal), (estimate, packed - causal)
    # the dense additive mask (CUDA, compiled blocks): batch x seq x seq in the compute dtype, and the RoPE rows
    dense = me.ActivationShape(tokens=batch * seq, compute_bytes=2, seq_len=seq, document_mask="sdpa")
    assert me.document_mask_bytes(args, dense) == batch * seq * seq * 2 + batch * seq * args.head_dim * 4


def test_selective_every_second_layer_wraps_layers_2_and_4():
    model = checkpointed_model(SMALL_GQA, "selective", "2")
    assert layer_policies(model, "selective", "2") == {0: "none", 1: "full", 2: "none", 3: "full"}


# ------------------------------------------------------------------------- arithmetic


def test_full_ac_keeps_only_the_sequence_sharded_block_input():
    args = flavor_args("70B")
    shape = me.ActivationShape(tokens=8192, compute_bytes=2, tp=8)
    assert me.layer_activation_bytes(args, 0, shape, me.FULL_AC) == 8192 // 8 * 8192 * 2


def test_op_ac_layer_of_8b_saves_input_wq_wv_sdpa_w1_w2():
    args = flavor_args("8B")  # dim 4096, 32 heads of 128, 8 kv heads, ffn 14336
    t, c = 8192, 2
    expected = t * c * (4096 + 4096 + 1024 + 4096 + 14336 + 4096) + t * 32 * 4
    assert me.layer_activation_bytes(args, 0, me.ActivationShape(tokens=t, compute_bytes=c), me.OP_AC) == expected


def test_no_ac_layer_bytes_by_hand():
    args = LlamaArgs(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=16, ffn_dim=12)
    shape = me.ActivationShape(tokens=10, compute_bytes=2, fused_rms_norm=True)
    norms = 2 * (10 * 8 * 2 + 10 * 4)  # input + fp32 rstd, twice
    gathered = 2 * 10 * 8 * 2  # norm outputs fed to the projections
    attention = 2 * 10 * 8 * 2 + 2 * 10 * 4 * 2 + 10 * 2 * 4  # q, output; k, v of 1 kv head; fp32 log-sum-exp per head
    mlp = 4 * 10 * 12 * 2
    assert me.layer_activation_bytes(args, 0, shape, me.NO_AC) == norms + gathered + attention + mlp


@pytest.mark.parametrize("schedule,expected", [("1F1B", [4, 3, 2, 1]), ("GPipe", [8, 8, 8, 8])])
def test_in_flight_microbatches_per_pipeline_rank(schedule, expected):
    assert [me.in_flight_microbatches(schedule, 4, r, 8) for r in range(4)] == expected


def test_in_flight_without_pipeline_is_one():
    assert me.in_flight_microbatches(None, 1, 0, 1) == 1.0


def test_fsdp_buffers_count_held_groups_and_neighbouring_gathers_and_reduce_scatters():
    units = [me.FsdpUnit("tok_embeddings", 250, True), me.FsdpUnit("layers.0", 100, True),
             me.FsdpUnit("layers.1", 120, True), me.FsdpUnit("output", 300, False)]
    # held: output 300 x 2 bytes; all-gathers: embeddings + layer 0 in bf16; reduce-scatters: layer 1 + output in fp32
    assert me.fsdp_buffer_bytes(units, 2, 4) == 600 + 350 * 2 + 420 * 4


def test_state_bytes_adamw_and_offload():
    assert me.state_bytes(1000, 4, offloaded=False) == (4000, 4000, 8000)
    assert me.state_bytes(1000, 4, offloaded=True) == (0, 0, 0)


def test_verdict_reports_head_room_and_overflow():
    est = me.MemoryEstimate(parameters=10 * me.GIB, gradients=0, optimizer=0, activations=6 * me.GIB, buffers=0)
    assert me.verdict(est, 24.0) == (True, "fits: peak 16.00 GiB of 24.00 GiB, head-room 8.00 GiB")
    fits, line = me.verdict(est, 12.0)
    assert not fits and line == "does NOT fit: peak 16.00 GiB exceeds 12.00 GiB by 4.00 GiB"
