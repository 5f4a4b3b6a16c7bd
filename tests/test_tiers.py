"""The slow tiers of tests/conftest.py name files and tests that exist: a renamed file would
otherwise fall into `make test-fast` without a word."""
from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import TIERS

TESTS = Path(__file__).parent


def test_every_tier_entry_names_an_existing_test_file_or_test():
    for tier, entries in TIERS.items():
        for entry in entries:
            file, _, name = entry.partition("::")
            path = TESTS / file
            assert path.is_file(), f"{tier}: no tests/{file}"
            if name:
                assert re.search(rf"^(async )?def {re.escape(name)}\(", path.read_text(), re.M), \
                    f"{tier}: no {name} in tests/{file}"


def test_the_tiers_are_the_registered_markers():
    text = (TESTS.parent / "pyproject.toml").read_text()
    registered = re.findall(r'^\s*"(\w+): ', text[text.index("markers = ["):], re.M)
    assert sorted(TIERS) == sorted(registered) == ["browser", "distributed", "kernel_build", "model", "server"]
    makefile = (TESTS.parent / "Makefile").read_text()
    assert "SLOW_TIERS := " + " or ".join(TIERS) + "\n" in makefile
