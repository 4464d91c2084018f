"""Every relative link of README.md and docs/*.md leads somewhere: the file exists, and an anchor names a heading of
that file as GitHub spells it (lowercase, punctuation dropped, spaces to hyphens, a repeated heading -1, -2, ...)."""

import re
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[(?:[^\]\n]|\n)*?\]\(([^)\s]+)\)")


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (a link there is not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: inline markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text.replace("`", "")).replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for line in prose(path.read_text()).splitlines():
        match = re.match(r"^#{1,6} +(.*?) *#*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path.read_text())) if not re.match(r"^[a-z]+:", t)]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in relative_links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and (not dest.is_file() or anchor not in anchors(dest)):
            broken.append(f"{target} (no heading '#{anchor}' in {dest.relative_to(REPO)})")
    return broken


def test_slugs_are_githubs():
    assert slug("Weights & Biases") == "weights--biases"
    assert slug("run_train.sh") == "run_trainsh"
    assert slug("Long context: YaRN and the other rope types") == "long-context-yarn-and-the-other-rope-types"
    assert slug("Mixture of experts (Qwen3-MoE, Mixtral)") == "mixture-of-experts-qwen3-moe-mixtral"
    assert slug("Quick start (two commands)") == "quick-start-two-commands"


def test_every_relative_link_and_anchor_resolves():
    docs = documents()
    assert len(docs) >= 15, "README.md and its guides in docs/"
    broken = {str(p.relative_to(REPO)): b for p in docs if (b := broken_links(p))}
    assert not broken, f"links that lead nowhere: {broken}"
    assert sum(len(relative_links(p)) for p in docs) >= 60


def test_a_broken_link_or_anchor_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "a.md").write_text("# A title\n\n## Weights & Biases\n\n[ok](#weights--biases) [ok](b.md#a-title-1)\n"
                                   "[bad](#nope) [bad](c.md) `[code](#x)`\n```\n[code](#y)\n```\n")
    (tmp_path / "b.md").write_text("# A title\n\n# A title\n")
    assert broken_links(tmp_path / "a.md") == ["#nope (no heading '#nope' in a.md)", "c.md (no such file)"]


def test_the_readme_is_a_front_door_to_every_guide():
    """README.md stays short (what titan_lite is, the two commands, the feature table, one example per workflow) and
    links every guide in docs/, which hold the rest."""
    readme = REPO / "README.md"
    assert len(readme.read_text().splitlines()) <= 300
    linked = {(REPO / target.partition("#")[0]).resolve() for target in relative_links(readme)}
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"guides the README does not link: {missing}"
