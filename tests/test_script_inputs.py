"""The scripts as a newcomer meets them: bad inputs are one line with exit 2, Ctrl-C one line with exit 130, outputs
written whole, never over an input, readable by others (the user's umask), options in one spelling with the dashed
one as an alias, and every option documented with its default."""

import argparse
import importlib.util
import json
import os
import stat
from pathlib import Path

import pytest
import torch

from titan_lite.checkpoint.files import save_safetensors
from titan_lite.checkpoint.hf import expected_shapes, write_hf_folder
from titan_lite.config import parse_args
from titan_lite.data.tokenizer import build_tokenizer
from titan_lite.job.cli import ScriptParser
from titan_lite.models.flavors import flavor_args

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (REPO / "scripts").glob("*.py"))
ARGS = flavor_args("tiny")
PLAY = REPO / "titan_lite" / "data" / "corpus" / "shakespeare" / "validation" / "midsummer_nights_dream.txt"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny Llama as a Hugging Face folder (random weights, the bundled tokenizer), written under umask 022."""
    folder = tmp_path_factory.mktemp("models") / "base"
    gen = torch.Generator().manual_seed(0)
    sd = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in expected_shapes(ARGS).items()}
    old = os.umask(0o022)
    try:
        write_hf_folder(sd, ARGS, str(folder), torch.float32, str(REPO / "assets" / "tokenizer"))
    finally:
        os.umask(old)
    return folder


def write_adapter(folder: Path, in_features: int = ARGS.dim, base_model: str | None = None) -> Path:
    """A PEFT LoRA adapter on every layer's q_proj (rank 2), trained on `base_model` (unnamed by default)."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for layer in range(ARGS.n_layers):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(2, in_features, generator=gen)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(ARGS.dim, 2, generator=gen)
    save_safetensors(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "lora_dropout": 0.0,
         "base_model_name_or_path": base_model}))
    return folder


def run(name: str, argv: list[str], capsys) -> tuple[int, str, list[str]]:
    """(exit code, stdout, stderr lines) of a script's main, as its command line runs it."""
    code = load_script(name).main(argv)
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def assert_one_line(code: int, out: str, err: list[str], expected: str, exit_code: int = 2) -> None:
    assert code == exit_code, (out, err)
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert "Traceback" not in out + "".join(err)


# ------------------------------------------------------------------------------------------------ merge_lora


def test_merge_records_the_adapter_and_refuses_it_twice(base, tmp_path, capsys):
    adapter = write_adapter(tmp_path / "adapter")
    merged = tmp_path / "merged"
    code, out, err = run("merge_lora", ["--base", str(base), "--adapter", str(adapter), "--output-dir", str(merged)],
                         capsys)  # the dashed spelling is an alias
    assert code == 0, err
    assert out.strip().splitlines()[-1].startswith("merged 4 adapters from")
    record = json.loads((merged / "config.json").read_text())["titan_lite_merged_adapters"]
    assert [entry["adapter"] for entry in record] == [str(adapter)]
    assert not list(tmp_path.glob(".*"))  # no partial folder left behind

    again = run("merge_lora", ["--base", str(merged), "--adapter", str(adapter), "--output_dir",
                               str(tmp_path / "twice")], capsys)
    assert_one_line(*again, f"--base '{merged}' already has --adapter '{adapter}' merged into it")
    assert not (tmp_path / "twice").exists()


def test_merge_bad_inputs_are_one_line(base, tmp_path, capsys):
    wrong = write_adapter(tmp_path / "wrong", in_features=ARGS.dim + 8)
    adapter = write_adapter(tmp_path / "adapter")
    cases = [
        (["--adapter", str(wrong), "--output_dir", str(tmp_path / "o")], "which does not fit the base's"),
        (["--adapter", str(adapter), "--output_dir", str(base)],
         f"--output_dir '{base}' is --base '{base}': write the output to another folder"),
        (["--adapter", str(adapter), "--output_dir", str(base / "sub")], "is inside --base"),
        (["--adapter", str(tmp_path / "none"), "--output_dir", str(tmp_path / "o")],
         f"--adapter '{tmp_path / 'none'}' is not a folder"),
    ]
    for argv, expected in cases:
        assert_one_line(*run("merge_lora", ["--base", str(base), *argv], capsys), expected)
    assert not (tmp_path / "o").exists()


def test_keep_sparsity_on_onto_a_base_without_zeros_is_refused(base, tmp_path, capsys):
    """--keep_sparsity on would keep nothing on a dense base (the run said "the base's zeros kept")."""
    adapter = write_adapter(tmp_path / "adapter")
    refused = run("merge_lora", ["--base", str(base), "--adapter", str(adapter), "--output_dir", str(tmp_path / "o"),
                                 "--keep_sparsity", "on"], capsys)
    assert_one_line(*refused, f"--keep_sparsity on, but the 4 adapted weights of --base '{base}' hold no zeros")
    assert not (tmp_path / "o").exists()


def test_merge_onto_another_base_than_the_adapters_warns_naming_both(base, tmp_path, capsys):
    other = write_adapter(tmp_path / "other", base_model="meta-llama/Llama-3.1-8B")
    code, out, err = run("merge_lora", ["--base", str(base), "--adapter", str(other), "--output_dir",
                                        str(tmp_path / "m1")], capsys)
    assert code == 0 and len(err) == 1, err
    assert err[0] == (f"warning: the adapter '{other}' was trained on 'meta-llama/Llama-3.1-8B' (its "
                      f"adapter_config.json's base_model_name_or_path), not on '{base}': on another base of the same "
                      "shapes it gives another model than the one trained")
    for named in (str(base), f"some-org/{base.name}"):  # the folder itself, or a hub id of the same name
        same = write_adapter(tmp_path / f"same{len(named)}", base_model=named)
        code, _, err = run("merge_lora", ["--base", str(base), "--adapter", str(same), "--output_dir",
                                          str(tmp_path / f"m{len(named)}")], capsys)
        assert code == 0 and err == [], err


def test_ctrl_c_is_one_line_exit_130_and_leaves_no_output(base, tmp_path, capsys, monkeypatch):
    module = load_script("merge_lora")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "merge_adapters", interrupted)
    code = module.main(["--base", str(base), "--adapter", str(write_adapter(tmp_path / "a")), "--output_dir",
                        str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert_one_line(code, out, err.strip().splitlines(), "interrupted (Ctrl-C); no output was written", 130)
    assert not (tmp_path / "out").exists()


# -------------------------------------------------------------------------------------------- permissions


def test_written_files_follow_the_umask(base, tmp_path, capsys):
    """safetensors writes through a private temporary file (0600); every file titan_lite writes is 0644 under 022."""
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in base.iterdir()}
    assert modes["model.safetensors"] == 0o644 and modes["config.json"] == 0o644, modes
    old = os.umask(0o022)
    try:
        adapter = write_adapter(tmp_path / "adapter")
        assert run("merge_lora", ["--base", str(base), "--adapter", str(adapter), "--output_dir",
                                  str(tmp_path / "m")], capsys)[0] == 0
        assert run("convert_checkpoint", ["hf-to-dcp", str(base), str(tmp_path / "dcp")], capsys)[0] == 0
    finally:
        os.umask(old)
    for path in [adapter / "adapter_model.safetensors", *(tmp_path / "m").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_copied_files_follow_the_umask_too(tmp_path):
    """The tokenizer files an HF export copies, and a re-masked folder's copies, get the umask's permissions (a
    plain shutil.copy keeps the source's 0644 under umask 077)."""
    from titan_lite.transforms.pruning.remask import remask_hf_folder

    sd = {name: torch.ones(shape) for name, shape in expected_shapes(ARGS).items()}
    old = os.umask(0o077)
    try:
        write_hf_folder(sd, ARGS, str(tmp_path / "hf"), torch.float32, str(REPO / "assets" / "tokenizer"))
        remask_hf_folder(tmp_path / "hf", tmp_path / "hf", tmp_path / "remasked")
    finally:
        os.umask(old)
    files = [p for folder in ("hf", "remasked") for p in (tmp_path / folder).iterdir()]
    assert {p.name for p in files} >= {"tokenizer.model", "config.json", "model.safetensors"}
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}, {p: oct(p.stat().st_mode) for p in files}


# -------------------------------------------------------------------------------------- convert_checkpoint


def test_convert_keeps_the_checkpoint_dtype_unless_told(base, tmp_path, capsys):
    assert run("convert_checkpoint", ["hf-to-dcp", str(base), str(tmp_path / "dcp")], capsys)[0] == 0
    code, out, _ = run("convert_checkpoint", ["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf"),
                                              "--assets", str(base)], capsys)
    assert code == 0 and out.strip().endswith("(float32)"), out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "float32"
    code, out, _ = run("convert_checkpoint", ["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf16"),
                                              "--assets", str(base), "--dtype", "bfloat16"], capsys)
    assert code == 0 and out.strip().endswith("(bfloat16)"), out
    refused = run("convert_checkpoint", ["hf-to-dcp", str(base), str(base)], capsys)
    assert_one_line(*refused, f"output '{base}' is input '{base}'")


# ---------------------------------------------------------------------------------------------- prune, eval


def test_prune_and_eval_refuse_before_loading(base, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n{"text": "  "}\n')
    out = str(tmp_path / "out")
    cases = [
        ("prune", ["--hf_assets_path", str(base), "--output_dir", out, "--method", "taylor_structured"],
         "--method taylor_structured needs --head_ratio or --ffn_ratio above 0"),
        ("prune", ["--hf_assets_path", str(base), "--output_dir", str(base)],
         f"--output_dir '{base}' is --hf_assets_path"),
        ("prune", ["--hf_assets_path", str(base), "--output_dir", out, "--calib_path", str(empty)],
         f"'--calib_path' = '{empty}' holds no text"),
        ("eval_ppl", ["--hf_assets_path", str(base), "--data", str(blank), "--seq_len", "8"],
         f"'--data' = '{blank}' holds no text"),
        ("eval_ppl", ["--hf_assets_path", "no/such/model", "--data", str(PLAY), "--seq_len", "8"],
         f"'no/such/model' (relative to the current directory {os.getcwd()})"),
    ]
    for script, argv, expected in cases:
        assert_one_line(*run(script, argv, capsys), expected)
    assert not Path(out).exists()


# ---------------------------------------------------------------------------------------------- output folders

NOT_OURS = ("is not empty (other) and was not written by titan_lite (no titan_lite_output.json): name a new or "
            "empty folder; nothing there was changed")


def someone_elses_folder(tmp_path: Path) -> Path:
    """`--output_dir outputs` by mistake: a folder of other runs."""
    folder = tmp_path / "outputs"
    (folder / "other").mkdir(parents=True)
    (folder / "other" / "w.bin").write_text("precious")
    return folder


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_bytes().decode("latin-1")
            for p in sorted(folder.rglob("*")) if p.is_file()}


FOLDER_WRITERS = {
    "prune depth": lambda base, tmp, out: ("prune", ["--hf_assets_path", str(base), "--output_dir", out, "--method",
                                                     "depth", "--remove_layers", "1"]),
    "prune wanda": lambda base, tmp, out: ("prune", ["--hf_assets_path", str(base), "--output_dir", out]),
    "prune remask": lambda base, tmp, out: ("prune", ["--hf_assets_path", str(base), "--remask_from", str(base),
                                                      "--output_dir", out]),
    "merge_lora": lambda base, tmp, out: ("merge_lora", ["--base", str(base), "--adapter",
                                                         str(write_adapter(tmp / "adapter")), "--output_dir", out]),
    "convert hf-to-dcp": lambda base, tmp, out: ("convert_checkpoint", ["hf-to-dcp", str(base), out]),
    "materialize_pruned": lambda base, tmp, out: ("materialize_pruned", [
        "--checkpoint", str(tmp / "step-4"), "--config", str(REPO / "train_configs" / "sheared_debugmodel_cpu.toml"),
        "--output_dir", out]),
    "make_synthetic_chat": lambda base, tmp, out: ("make_synthetic_chat", [
        "--output", str(tmp / "c.jsonl"), "--num_conversations", "2", "--tokenizer_output", out]),
}


@pytest.mark.parametrize("writer", sorted(FOLDER_WRITERS))
def test_a_folder_titan_lite_did_not_write_is_refused_and_left_intact(writer, base, tmp_path, capsys):
    folder = someone_elses_folder(tmp_path)
    before = tree(folder)
    script, argv = FOLDER_WRITERS[writer](base, tmp_path, str(folder))
    flag = "--tokenizer_output" if script == "make_synthetic_chat" else "output" if script == "convert_checkpoint" \
        else "--output_dir"
    assert_one_line(*run(script, argv, capsys), f"{flag} '{folder}' {NOT_OURS}")
    assert tree(folder) == before


def test_a_folder_titan_lite_wrote_is_replaced(base, tmp_path, capsys):
    """The marker every script leaves lists the files it wrote: the next run replaces those (and only those)."""
    adapter = write_adapter(tmp_path / "adapter")
    merged = tmp_path / "merged"
    for _ in range(2):
        code, out, err = run("merge_lora", ["--base", str(base), "--adapter", str(adapter), "--output_dir",
                                            str(merged)], capsys)
        assert code == 0, err
        marker = json.loads((merged / "titan_lite_output.json").read_text())
        assert marker["written_by"].startswith("titan_lite")
        assert marker["files"] == sorted(p.name for p in merged.iterdir() if p.name != "titan_lite_output.json")


def test_a_file_the_user_added_to_an_output_folder_is_never_lost(base, tmp_path, capsys):
    """prune.py --output_dir on a folder it wrote earlier, to which the user added a file: refused, naming the file,
    which stays as it was; moved away, the rerun replaces the folder."""
    out = tmp_path / "pruned"
    argv = ["--hf_assets_path", str(base), "--output_dir", str(out), "--method", "depth", "--remove_layers", "1",
            "--nsamples", "2", "--seq_len", "16"]
    assert run("prune", argv, capsys)[0] == 0
    (out / "my_eval_results.txt").write_text("ppl 12.3")
    before = tree(out)
    assert_one_line(*run("prune", argv, capsys), f"--output_dir '{out}' holds my_eval_results.txt, which titan_lite "
                    "did not write (it replaces only the files its titan_lite_output.json lists): move it out of the "
                    "folder or name another folder; nothing there was changed")
    assert tree(out) == before
    older = tmp_path / "older"  # a marker without a list of files: what wrote it is known, what the user added not
    older.mkdir()
    (older / "titan_lite_output.json").write_text('{"written_by": "titan_lite prune.py"}')
    (older / "notes.txt").write_text("mine")
    assert_one_line(*run("prune", [*argv[:2], "--output_dir", str(older), *argv[4:]], capsys),
                    "was written by an older titan_lite, whose titan_lite_output.json does not list the files it "
                    "wrote, so a file you added there cannot be told apart")
    assert (older / "notes.txt").read_text() == "mine"


def test_a_download_goes_only_into_a_new_folder_or_one_of_the_same_repo(tmp_path, capsys):
    folder = someone_elses_folder(tmp_path)
    assert run("download_hf_assets", ["org/model", "--local_dir", str(folder)], capsys)[2] == [
        f"error: --local_dir '{folder}' {NOT_OURS}"]
    other = tmp_path / "other_repo"
    other.mkdir()
    (other / "titan_lite_output.json").write_text(json.dumps({"repo_id": "org/other"}))
    assert run("download_hf_assets", ["org/model", "--local_dir", str(other)], capsys)[2] == [
        f"error: --local_dir '{other}' holds a download of org/other, not org/model: name another folder"]
    assert tree(folder) == {"other/w.bin": "precious"}


@pytest.mark.parametrize("script, argv", [
    ("show_data", ["--config", str(REPO / "train_configs" / "debug_model.toml"), "--jsonl", "{folder}"]),
    ("generate", ["--hf", "{folder}", "--prompt", "x", "--output", "{folder}"]),
    ("eval_answers", ["--hf", "{folder}", "--data", "x.jsonl", "--output", "{folder}"]),
    ("make_synthetic_gsm8k", ["--output", "{folder}/d.jsonl"]),
])
def test_an_output_file_that_is_a_folder_is_one_line(script, argv, tmp_path, capsys):
    folder = someone_elses_folder(tmp_path)
    if script == "make_synthetic_gsm8k":
        (folder / "d.jsonl").mkdir()
    argv = [a.replace("{folder}", str(folder)) for a in argv]
    flag = "--jsonl" if script == "show_data" else "--output"
    named = folder / "d.jsonl" if script == "make_synthetic_gsm8k" else folder
    assert_one_line(*run(script, argv, capsys), f"{flag} '{named}' is a folder; name a file to write")


def test_the_data_generators_never_overwrite_a_users_file(tmp_path, capsys):
    """--output = --chat is refused; an existing --output holding something else is refused without --overwrite;
    one holding exactly what the command writes is left as it is (the documented commands can be run again)."""
    chat = tmp_path / "chat.jsonl"
    assert run("make_synthetic_chat", ["--output", str(chat), "--num_conversations", "4"], capsys)[0] == 0
    conversations = chat.read_text()
    assert_one_line(*run("make_synthetic_preferences", ["--chat", str(chat), "--output", str(chat)], capsys),
                    f"--output '{chat}' is also --chat: writing it would overwrite the input; name another file")
    assert chat.read_text() == conversations
    mine = tmp_path / "mine.jsonl"
    mine.write_text("my own data\n")
    for script, argv in (("make_synthetic_preferences", ["--chat", str(chat)]), ("make_synthetic_gsm8k", []),
                         ("make_synthetic_chat", ["--num_conversations", "4"])):
        assert_one_line(*run(script, [*argv, "--output", str(mine)], capsys),
                        f"--output '{mine}' exists and holds something else than this command writes: pass "
                        "--overwrite to replace it, or name another file; it was left as it is")
        assert mine.read_text() == "my own data\n"
    code, out, err = run("make_synthetic_chat", ["--output", str(chat), "--num_conversations", "4"], capsys)
    assert code == 0 and out.strip().endswith(f"{chat} already holds 4 conversations (24 turns; counts 0..9; seed "
                                              "0): left as it is"), out
    code, out, _ = run("make_synthetic_gsm8k", ["--output", str(mine), "--num_problems", "3", "--overwrite"], capsys)
    assert code == 0 and len(mine.read_text().splitlines()) == 3


def test_a_pruning_estimate_warns_about_no_setting_the_user_never_made(capsys):
    """prune.py --estimate_only (Wanda's config, and depth's and REAP's) prints its plan without a word on
    checkpoint keys."""
    tokenizer = str(REPO / "assets" / "tokenizer")
    for argv in (["--flavor", "tiny"], ["--flavor", "tiny_moe", "--method", "reap", "--expert_ratio", "0.5"]):
        code, out, err = run("prune", [*argv, "--hf_assets_path", tokenizer, "--estimate_only", "--nsamples", "2",
                                       "--seq_len", "16", "--device_memory_gib", "24"], capsys)
        assert code == 0 and out.strip().splitlines()[-1].startswith("estimate: peak "), out + "\n".join(err)
        assert "WARNING" not in out + "\n".join(err), err


# ------------------------------------------------------------------------------------------------- help


def test_dashed_and_underscored_spellings_are_one_option():
    parser = ScriptParser("A script.\n\nMore.")
    parser.add_argument("--max_shard_gb", type=float, default=5.0, help="largest file")
    parser.add_argument("--hf-config", help="a config")
    opts = parser.parse_args(["--max-shard-gb", "2", "--hf_config=x.json"])
    assert opts.max_shard_gb == 2.0 and opts.hf_config == "x.json"
    assert "largest file (default: 5.0)" in parser.format_help()


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_option_has_help_and_a_complete_description(name, capsys):
    module = load_script(name)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"]) if name == "train_bpe_tokenizer" else module.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]
    assert description.rstrip().endswith((".", ")")), f"{name}: description stops mid-sentence: {description!r}"
    parser_lines = [line for line in text.splitlines() if line.strip().startswith("--") and "--help" not in line]
    for line in parser_lines:
        option = line.split()[0].rstrip(",")
        assert "-" not in option[2:], f"{name}: {option} is not spelled with underscores"
    undocumented = [line.strip() for i, line in enumerate(text.splitlines())
                    if line.startswith("  --") and len(line.split()) <= 2 and "--help" not in line
                    and not text.splitlines()[i + 1].startswith(" " * 20)]
    assert not undocumented, f"{name}: options without help: {undocumented}"


def test_generate_applies_the_run_template_given_its_config():
    generate = load_script("generate")
    config = str(REPO / "train_configs" / "lora_synthetic_gsm8k_cpu.toml")
    cfg = parse_args(["--job.config_file", config])
    tokenizer = build_tokenizer(str(REPO / "assets" / "tokenizer"))
    templated = generate.PromptRenderer(cfg, argparse.Namespace(config=config, raw_prompts=False, chat=False),
                                        tokenizer)
    text = "Question: What is 3 + 4?\nAnswer: "
    assert templated("What is 3 + 4?") == (text, tokenizer.encode(text, bos=True))
    raw = generate.PromptRenderer(cfg, argparse.Namespace(config=config, raw_prompts=True, chat=False), tokenizer)
    assert raw("What is 3 + 4?")[0] == "What is 3 + 4?"


# ------------------------------------------------------------------------------------------ check_sparsity


def test_check_sparsity_ends_with_whether_the_check_passed(base, capsys):
    """The last line is the verdict (the run exits 1 on a failed check, and says so)."""
    code, out, _ = run("check_sparsity", ["--hf", str(base), "--pattern", "2:4"], capsys)
    summary, verdict = out.strip().splitlines()[-2:]
    assert code == 1 and summary.startswith("result: 28 linears, 0.00% zeros; 2:4 holds in 0/28")
    assert verdict == "check FAILED: 2:4 holds in 0/28 linears (--pattern 2:4)"
    code, out, _ = run("check_sparsity", ["--hf", str(base), "--same_zeros_as", str(base)], capsys)
    assert code == 0 and out.strip().splitlines()[-1] == (
        f"check passed: zeros identical to {base} in every linear (28/28)")
    code, out, _ = run("check_sparsity", ["--hf", str(base)], capsys)
    assert code == 0 and out.strip().splitlines()[-1] == (
        "check: none requested (--pattern, --same_zeros_as), the report above only")
