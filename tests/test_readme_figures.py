"""The documentation's figures stay true: benchmarks/figures.py runs the quick commands (plans and
estimates) and compares what they print with what README.md and docs/*.md quote; the training examples (slow) are
checked by the same module with --slow. Here: the quick check itself, the registry's patterns against the documents,
and that a difference is caught and rewritten in the file that quotes it."""

import re
from pathlib import Path

import pytest

import benchmarks.figures as FIGURES

REPO = Path(__file__).resolve().parents[1]




def test_every_figure_is_quoted_once_and_printed_by_a_known_command():
    """For the slow figures too: the quoted pattern matches exactly once across README.md and docs/*.md, both sides
    have as many groups; most figures live in the guides."""
    texts = FIGURES.documents()
    assert "README.md" in texts and "docs/preference.md" in texts
    where = []
    for figure in FIGURES.FIGURES:
        assert figure.command in FIGURES.COMMANDS, figure.name
        values, _, document = FIGURES.readme_values(figure, texts)
        assert values is not None, f"{figure.name}: its pattern does not match README.md and docs/*.md exactly once"
        assert re.compile(figure.printed).groups == len(values), figure.name
        where.append(document)
    assert sum(not c.slow for c in FIGURES.COMMANDS.values()) >= 5
    assert len(set(where)) >= 8, set(where)


def test_a_figure_the_command_no_longer_prints_is_caught_and_rewritten():
    figure = FIGURES.Figure("peak", "plan", rf"^  peak +{FIGURES.NUMBER} GiB", rf"^peak {FIGURES.NUMBER} GiB \(8B\)")
    texts = {"README.md": "intro\n", "docs/plan.md": "intro\npeak 47.48 GiB (8B)\nend\n"}
    (found,) = FIGURES.compare([figure], {"plan": "...\n  peak            40.97 GiB\n"}, texts)
    assert not found.same and FIGURES.describe(found) == "DIFFERS peak: docs/plan.md 47.48; printed 40.97"
    assert FIGURES.rewrite(texts, [found]) == {"docs/plan.md": "intro\npeak 40.97 GiB (8B)\nend\n"}
    texts["README.md"] += "peak 47.48 GiB (8B)\n"  # quoted twice: which one to check is unknown
    (twice,) = FIGURES.compare([figure], {"plan": "  peak 40.97 GiB\n"}, texts)
    assert twice.readme is None and FIGURES.describe(twice).startswith("MISSING peak")


@pytest.mark.slow  # twenty DRY_RUN plans (in this process) and two estimates: about 15 s
def test_the_quick_figures_are_what_their_commands_print(capsys):
    code = FIGURES.main(["--check"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("result: README.md and docs/*.md quote what their commands print: ")


def test_the_reap_table_is_checked_at_the_thread_count_the_guide_gives():
    """docs/pruning.md's REAP perplexities depend on the thread count: the guide's commands fix it, the figure
    command runs them with it, and every row of the table (and the eval_ppl command of each model) is checked."""
    command = FIGURES.COMMANDS["reap_example"]
    assert command.slow and command.line.startswith("export OMP_NUM_THREADS=1 && ")
    guide = (REPO / "docs" / "pruning.md").read_text()
    assert "```bash\nexport OMP_NUM_THREADS=1   # the figures below depend on the thread count\n" in guide
    rows = re.findall(r"^\| ((?:unpruned|REAP|frequency)[^|]*?) \| [\d.]+ \|$", guide, flags=re.M)
    checked = {f.name.removeprefix("REAP example: ") for f in FIGURES.FIGURES if f.command == "reap_example"}
    assert len(rows) == 5 and set(rows) <= checked
    loop = re.search(r"^for model in (.*?); do\n  \.venv/bin/python scripts/eval_ppl\.py --hf_assets_path "
                     r"outputs/\$model ", guide.replace("\\\n", ""), flags=re.M | re.S)
    assert loop.group(1).split() == list(FIGURES.REAP_MODELS.values())  # each model's eval_ppl, in the table's order
