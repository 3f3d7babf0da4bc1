"""The lifecycle's fail-safes shown failing when broken (tests/breaks.py, group lifecycle): each break applied in a
copy of the tree makes tests/test_lifecycle.py fail, which passes there unbroken. The live alert scenarios' breaks
take minutes each: scripts/show_breaks.py runs them (benchmarks/RESULTS.md records the run)."""

from __future__ import annotations

import pytest
from breaks import BREAKS, LIFECYCLE_TESTS, Tree


@pytest.fixture(scope="module")
def tree():
    copy = Tree()
    try:
        assert copy.imports_its_own_package(), "the copy's tests would import the editable install, not the copy"
        healthy = copy.run(LIFECYCLE_TESTS)
        assert healthy.exit_code == 0, f"the lifecycle tests fail unbroken:\n{healthy.last_lines}"
        yield copy
    finally:
        copy.close()


@pytest.mark.slow
@pytest.mark.parametrize("brk", [b for b in BREAKS if b.group == "lifecycle"], ids=lambda b: b.name)
def test_each_lifecycle_break_fails_the_lifecycle_tests(tree, brk):
    outcome = tree.run(brk.tests, brk)
    assert outcome.caught, f"{brk.name}: the tests did not fail (exit {outcome.exit_code}):\n{outcome.last_lines}"


def test_every_break_still_matches_the_source_once():
    """A break whose text the code no longer holds would prove nothing: each edit's old text is in its file once."""
    from breaks import ROOT

    for brk in BREAKS:
        text = (ROOT / brk.path).read_text()
        for old, _ in brk.edits:
            assert text.count(old) == 1, (brk.name, old)
