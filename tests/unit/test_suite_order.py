"""The suite's longest-first file order (tests/conftest.py) names files that exist."""
from conftest import LONGEST_FIRST, ROOT


def test_every_file_in_the_longest_first_list_exists():
    missing = [p for p in LONGEST_FIRST if not (ROOT / p).is_file()]
    assert not missing, f"renamed or removed test files still listed in tests/conftest.py LONGEST_FIRST: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
