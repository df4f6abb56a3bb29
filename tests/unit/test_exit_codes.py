"""The pod's exit codes have one definition, job/contract.py: the scripts a person runs and the lab's
runners import them (job/script.sh mirrors them, checked by test_contract.py)."""

from __future__ import annotations

import ast
import importlib

import pytest

import contract
from podlab import ROOT

CONTRACT_CODES = set(contract.EXIT_CODES.values())


def assigned_codes(path) -> list[str]:
    """Module-level `NAME = <int>` where NAME says exit and the int is one of the contract's codes."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and type(node.value.value) is int:
            for target in node.targets:
                if isinstance(target, ast.Name) and "EXIT" in target.id and node.value.value in CONTRACT_CODES:
                    found.append(f"{target.id} = {node.value.value}")
    return found


def python_files():
    """Every Python file outside job/ (code/ links to job/contract.py itself)."""
    return sorted(p for folder in ("scripts", "lab", "code") for p in (ROOT / folder).rglob("*.py") if not p.is_symlink())


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_retypes_an_exit_code_of_the_contract(path):
    assert assigned_codes(path) == [], f"{path.relative_to(ROOT)}: import it from job/contract.py"


@pytest.mark.parametrize("module", ["submit", "prepare_data", "local_job", "local_pod"])
def test_the_scripts_codes_are_the_contracts_own(module):
    imported = importlib.import_module(module)
    assert imported.EXIT_BAD_INPUT is contract.EXIT_BAD_INPUT == 64


def test_the_checker_sees_a_retyped_code(tmp_path):
    retyped = tmp_path / "x.py"
    retyped.write_text("EXIT_BAD_INPUT = 64  # EX_USAGE\nEXIT_START_ERROR = 128\nTIMEOUT = 64\n")
    assert assigned_codes(retyped) == ["EXIT_BAD_INPUT = 64"]

