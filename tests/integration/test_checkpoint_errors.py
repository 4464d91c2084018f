"""Bad checkpoints found before launch: one line naming the file, exit 2, no torchrun traceback (the DCP shape
mismatch case is in test_resume.py)."""

import shutil

from tests.integration.harness import REPO, run_train


def assert_one_line(run, expected: str) -> None:
    assert run.returncode == 2, run.output[-3000:]
    assert "Traceback" not in run.output, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], run.output[-3000:]


def test_truncated_hf_safetensors(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    shutil.copy(REPO / "assets" / "tokenizer" / "tokenizer.model", folder / "tokenizer.model")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    run = run_train(["--model.hf_assets_path", str(folder), "--checkpoint.initial_load_in_hf"], tmp_path / "out")
    assert_one_line(run, f"{folder / 'model.safetensors'}: corrupt or truncated safetensors file")
