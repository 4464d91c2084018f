"""LoRA over an MXFP4 base through run_train.sh, from a gpt-oss folder whose experts are stored as the release stores
them: FSDP 2 and EP 2 each equal one process on the same global batch over 3 steps (the losses, the aux loss and every
MoE layer's load within 1e-5); the frozen codes bitwise unchanged; the merged export (expert adapters merged into the
dequantized experts, float32) loads in transformers with the run's logits, and the PEFT adapter loaded by peft on
transformers' dequantizing load of the MXFP4 folder gives them too."""

import json

import pytest
import torch

from tests.integration.harness import one_window_dataset, run_train
from tests.integration.test_moe_parity import scalars
from tests.test_mxfp4_base import LORA, folders  # noqa: F401

pytestmark = pytest.mark.slow

SEQ_LEN, GLOBAL_BATCH, STEPS, ATOL = 32, 4, 3, 1e-5


@pytest.fixture(scope="module")
def common(folders, tmp_path_factory) -> list[str]:  # noqa: F811
    _, folder = folders
    data = one_window_dataset(tmp_path_factory.mktemp("data"), GLOBAL_BATCH * (STEPS + 1), SEQ_LEN)
    return [*data, "--model.flavor", "hf", "--model.hf_assets_path", str(folder), "--checkpoint.initial_load_in_hf",
            "--training.steps", str(STEPS), *LORA]


@pytest.fixture(scope="module")
def one_process(common, tmp_path_factory):
    folder = tmp_path_factory.mktemp("one_process")
    run = run_train([*common, "--training.local_batch_size", str(GLOBAL_BATCH), "--checkpoint.enable",
                     "--checkpoint.last_save_in_hf", "--checkpoint.export_dtype", "float32"], folder)
    assert run.returncode == 0, run.output[-3000:]
    assert "lora: MXFP4 base: the experts of 4 MoE layers on this rank kept as" in run.output
    assert "frozen tensors on this rank are bitwise unchanged since loading" in run.output
    assert "dequantized on load" not in run.output
    series = scalars(folder)
    assert sorted(series["loss/global_avg"]) == list(range(1, STEPS + 1)), run.output[-3000:]
    return series, folder


TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
       "--parallelism.pipeline_parallel_microbatch_size", "2"]
# (name, overrides, the layout line, the local batch: the data-parallel ranks split the global batch, TP and PP not)
LAYOUTS = [("fsdp2", [], "dp_shard 2 x cp 1 x tp 1 x pp 1", GLOBAL_BATCH // 2),
           ("ep2", ["--parallelism.expert_parallel_degree", "2"], "(experts: ep 2 x efsdp 1)", GLOBAL_BATCH // 2),
           ("tp2", TP2, "tp 2", GLOBAL_BATCH),
           ("pp2", PP2, "pp 2", GLOBAL_BATCH)]


@pytest.mark.parametrize("name, overrides, layout, local_batch", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_mxfp4_base_layout_equals_one_process(name, overrides, layout, local_batch, common, one_process, tmp_path):
    expected, _ = one_process
    run = run_train([*common, "--training.local_batch_size", str(local_batch), *overrides], tmp_path, ngpu=2)
    assert run.returncode == 0 and layout in run.output, run.output[-3000:]
    got = scalars(tmp_path)
    assert sorted(got) == sorted(expected)
    worst = max(abs(got[s][step] - v) for s, values in expected.items() for step, v in values.items())
    print(f"{name}: largest difference from one process {worst:.3g} over {len(expected)} series; losses "
          f"{[round(v, 6) for v in got['loss/global_avg'].values()]}")
    assert worst <= ATOL


def test_the_merged_export_loads_in_transformers_with_the_runs_logits(one_process):
    from transformers import GptOssForCausalLM

    from tests.hf_oracle import load_titan
    from tests.test_gpt_oss import tokens

    _, folder = one_process
    merged = folder / "checkpoint" / f"step-{STEPS}-hf"
    config = json.loads((merged / "config.json").read_text())
    assert "quantization_config" not in config  # the experts merged with their adapters: unquantized
    ids = tokens(1, 40)
    with torch.no_grad():
        theirs = GptOssForCausalLM.from_pretrained(merged, attn_implementation="eager", dtype=torch.float32).eval()
        torch.testing.assert_close(theirs(ids).logits, load_titan(merged)(ids), rtol=0, atol=1e-5)


def test_the_adapter_loads_in_peft_on_transformers_dequantized_release_with_the_merged_logits(one_process, folders):  # noqa: F811
    """peft on transformers' own (dequantizing) load of the MXFP4 folder gives the merged export's logits."""
    peft = pytest.importorskip("peft")
    from transformers import GptOssForCausalLM

    from tests.test_gpt_oss import tokens

    _, folder = one_process
    _, release = folders
    ids = tokens(1, 40)
    base = GptOssForCausalLM.from_pretrained(release, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        before = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, str(folder / "checkpoint" / f"step-{STEPS}-adapter")).eval()
        got = adapted(ids).logits
        merged = GptOssForCausalLM.from_pretrained(folder / "checkpoint" / f"step-{STEPS}-hf",
                                                   attn_implementation="eager", dtype=torch.float32).eval()
        want = merged(ids).logits
    print(f"peft on the release vs the merged export: {float((got - want).abs().max()):.3g}; the adapters moved the "
          f"logits by {float((got - before).abs().max()):.3g}")
    assert (got - before).abs().max() > 1e-4
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
