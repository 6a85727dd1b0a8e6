"""The suite's longest-first file order (tests/conftest.py) names files that exist."""
from conftest import LONGEST_FIRST, ROOT


def test_every_file_in_the_longest_first_list_exists():
    missing = [p for p in LONGEST_FIRST if not (ROOT / p).is_file()]
    assert not missing, f"renamed or removed test files still listed in tests/conftest.py LONGEST_FIRST: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_test_files_have_distinct_basenames():
    """The test folders are not packages, so pytest imports each file under its basename: two
    files of one name in different folders stop the whole collection ("import file mismatch")."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
