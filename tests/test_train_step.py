"""One training step in-process: gradient accumulation equals one large batch; the loss is a token mean."""

import math

import pytest
import torch
import torch.distributed as dist

from tests.helpers import tied_tiny_assets
from titan_lite.config import parse_args
from titan_lite.models.decoder import Llama
from titan_lite.train import Trainer


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def first_step(tmp_path, local_batch: int, global_batch: int) -> tuple[float, dict[str, torch.Tensor], Trainer]:
    cfg = parse_args(["--job.config_file", "tests/integration/base.toml", "--job.dump_folder", str(tmp_path),
                      "--training.local_batch_size", str(local_batch),
                      "--training.global_batch_size", str(global_batch),
                      "--training.seq_len", "32", "--training.max_norm", "0", "--metrics.enable_tensorboard=false"])
    trainer = Trainer(cfg)
    grads = {}

    def capture(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.model_parts[0].named_parameters()})

    trainer.optimizer.step = capture
    loss, _ = trainer.train_step(trainer.next_microbatches(iter(trainer.dataloader)), step=1)
    return loss, grads, trainer


def test_accumulation_equals_one_large_batch(tmp_path):
    loss_1x8, grads_1x8, t1 = first_step(tmp_path / "a", 8, 8)
    loss_4x2, grads_4x2, t2 = first_step(tmp_path / "b", 2, 8)
    assert (t1.plan.grad_accum, t2.plan.grad_accum) == (1, 4)
    assert abs(loss_1x8 - loss_4x2) < 1e-6
    for name, g in grads_1x8.items():
        assert torch.allclose(g, grads_4x2[name], atol=1e-6, rtol=0), name


def test_loss_is_mean_token_cross_entropy(tmp_path):
    loss, _, trainer = first_step(tmp_path, 4, 4)
    # An independent recomputation with the initial weights: mean CE over the same 4 x 32 tokens.
    fresh, _, _ = first_step(tmp_path / "again", 4, 4)
    assert fresh == loss
    model = trainer.model_parts[0]
    batch = next(iter(trainer.build_train_loader()))
    inputs, labels = batch.inputs, batch.labels
    model.init_weights(seed=0)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()
    assert abs(loss - expected) < 1e-5
    assert abs(loss - math.log(2048)) < 1.0  # near-uniform predictions at init


def test_global_batch_must_divide(tmp_path):
    from titan_lite.errors import ConfigError

    with pytest.raises(ConfigError, match="'training.global_batch_size' 10 is not a multiple of local_batch_size 4"):
        first_step(tmp_path, 4, 10)


def test_tied_model_trains_one_shared_parameter_and_exports_what_it_trained(tmp_path):
    """Materialising (to_empty) gives each module a tensor of its own: the embedding and head must be tied again,
    else one process trains two matrices and the HF export (which writes the embedding only) drops the head's."""
    from titan_lite.checkpoint.hf import load_hf_weights, write_hf_folder

    assets = tied_tiny_assets(tmp_path / "assets")
    cfg = parse_args(["--job.config_file", "tests/integration/base.toml", "--job.dump_folder", str(tmp_path / "run"),
                      "--model.flavor", "hf", "--model.hf_assets_path", assets, "--training.seq_len", "32",
                      "--metrics.enable_tensorboard=false"])
    trainer = Trainer(cfg)
    model, args = trainer.model_parts[0], trainer.plan.model_args
    assert args.tie_word_embeddings and model.output.weight is model.tok_embeddings.weight
    assert model.num_params() == trainer.plan.full_param_count()
    optimized = [id(p) for group in trainer.optimizer.param_groups for p in group["params"]]
    assert sorted(optimized) == sorted(id(p) for p in model.parameters())  # one entry for the shared matrix
    before = model.output.weight.detach().clone()
    trainer.train_step(trainer.next_microbatches(iter(trainer.dataloader)), step=1)
    assert not torch.equal(before, model.output.weight) and model.output.weight is model.tok_embeddings.weight
    write_hf_folder({k: v.detach() for k, v in model.state_dict().items()}, args, str(tmp_path / "hf"),
                    torch.float32, assets)
    with torch.device("meta"):
        reloaded = Llama(args)
    reloaded.to_empty(device="cpu")
    reloaded.tie_embeddings()
    reloaded.init_weights(seed=1)
    load_hf_weights([reloaded], str(tmp_path / "hf"), args)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(tokens), reloaded(tokens), atol=1e-6)
