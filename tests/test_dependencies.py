"""The install is complete: every package the project imports is declared, and every
optional part a setting can select imports and works.

A changed upstream release (a dependency that drops an extra, a module split into a
separate project) shows up here as one named failure instead of deep inside a stage.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ["crawl2chat", "flows", "tasks", "stages", "infra"]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """``"lxml_html_clean>=0.4"`` -> ``"lxml-html-clean"`` (PEP 503 normalised)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0)).lower()


def _declared(extras: bool) -> set[str]:
    names = {_name(r) for r in PROJECT["dependencies"]}
    if extras:
        names |= {_name(r) for reqs in PROJECT["optional-dependencies"].values() for r in reqs}
    return names


def _imports_of(folder: str) -> dict[str, set[str]]:
    """Full module name -> the files of ``folder`` importing it (module level or inside functions)."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def _imported_modules() -> dict[str, set[str]]:
    """Top-level module -> the source files importing it (module level or inside functions)."""
    found: dict[str, set[str]] = {}
    for folder in SOURCE_DIRS:
        for name, files in _imports_of(folder).items():
            found.setdefault(name.split(".")[0], set()).update(files)
    return found


# Modules only the named optional extra provides; everything else must be a core dependency.
EXTRA_ONLY = {"deepspeed": "deepspeed", "s3fs": "s3"}


def test_every_imported_package_is_declared():
    dists = md.packages_distributions()
    local = {"crawl2chat"}
    core, everything = _declared(extras=False), _declared(extras=True)
    missing = []
    for module, files in sorted(_imported_modules().items()):
        if module in local or module in sys.stdlib_module_names or module == "__future__":
            continue
        providers = {_name(d) for d in dists.get(module, [])}
        if not providers:
            if module in EXTRA_ONLY:
                continue  # optional extra not installed here; its import is guarded where used
            missing.append(f"{module} (imported by {sorted(files)[0]}) is installed by no distribution")
            continue
        allowed = everything if module in EXTRA_ONLY else core
        if not providers & allowed:
            missing.append(f"{module} (imported by {sorted(files)[0]}) comes from {sorted(providers)}, "
                           "which pyproject.toml does not declare")
    assert not missing, "\n".join(missing)


def test_declared_dependencies_are_installed():
    absent = []
    for requirement in PROJECT["dependencies"]:
        try:
            md.version(_name(requirement))
        except md.PackageNotFoundError:
            absent.append(requirement)
    assert not absent, f"declared but not installed: {absent}"


@pytest.mark.parametrize("extractor", typing.get_args(importlib.import_module("crawl2chat.stages.data.extract").Extractor))
def test_every_selectable_extractor_imports_and_extracts(extractor):
    from crawl2chat.stages.data.extract import html_to_text

    page = ("<html><body><nav><a href='/'>Home</a></nav><main><article><p>"
            + "The harbour master kept a ledger of every ship that entered the bay. " * 5
            + "</p></article></main></body></html>")
    assert "harbour master" in html_to_text(page, extractor)


def test_optional_parts_a_setting_selects_import():
    """Optimizer ``lion``, the DeepSpeed accelerate config (dev extra), the trafilatura cleaner."""
    import lion_pytorch  # noqa: F401 - train.optimizer=lion
    import lxml_html_clean  # noqa: F401 - trafilatura's HTML cleaner, a separate project since lxml 5.2

    if "deepspeed" in _declared(extras=True):
        try:
            md.version("deepspeed")
        except md.PackageNotFoundError:
            pytest.skip("the deepspeed extra is not installed")
        importlib.import_module("deepspeed")


def test_one_fastText_build_provides_the_fasttext_module():
    """Language ID and the quality classifier share the real fastText (training included);
    a second build providing `fasttext` (fasttext-predict, fasttext-wheel...) would overwrite it."""
    assert md.packages_distributions()["fasttext"] == ["fasttext-community"]
    import fasttext

    assert callable(fasttext.train_supervised) and callable(fasttext.load_model)


def test_constraints_pin_every_declared_dependency():
    """CI and the README install with constraints.txt; a dependency missing from it would float."""
    pinned = {_name(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    floating = sorted(_declared(extras=False) - pinned)
    assert not floating, f"refresh constraints.txt; not pinned: {floating}"
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().split()


def test_a_launching_process_imports_no_training_framework():
    """The process that launches a training stage (the CLI, a Prefect worker's flow run)
    starts a separate ``accelerate launch``; importing the training task and the flows
    must not load torch there (seconds per command), and the single-stage flows are
    built when asked for."""
    code = ("import sys, json; import crawl2chat.tasks.train; import crawl2chat.flows.pipeline as p; "
            "before = sorted(k for k, v in vars(p).items() if isinstance(v, p.Flow)); f = p.sft_flow; "
            "print(json.dumps({'torch': 'torch' in sys.modules, 'before': before, 'sft': f.name, "
            "'all': sorted(p.STAGE_FLOWS)}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["torch"] is False
    assert got["before"] == ["pipeline_flow", "train_flow"] and got["sft"] == "sft"
    from crawl2chat.stages.training.registry import STAGES

    assert got["all"] == sorted(STAGES)


def test_imports_flow_one_way():
    """flows -> tasks -> stages: the stages (what a training rank or a Ray worker runs)
    import neither Prefect nor MLflow nor the layers above them; tasks do not import flows."""
    def offenders(folder: str, banned: tuple[str, ...]) -> dict[str, set[str]]:
        return {name: files for name, files in _imports_of(folder).items()
                if any(name == b or name.startswith(b + ".") for b in banned)}

    assert offenders("stages", ("prefect", "mlflow", "crawl2chat.flows", "crawl2chat.tasks", "crawl2chat.infra")) == {}
    assert offenders("tasks", ("crawl2chat.flows",)) == {}
