"""README.md and docs/*.md hold together: every relative link reaches a file, every #anchor a heading
(GitHub's ids), every s3:// bucket they name is a valid bucket name, and no doc under docs/ is left
unlinked from the README."""

from __future__ import annotations

import re

import pytest

from markdown_docs import DOCS, ROOT, anchors, links, prose_with_code, rel

LINKS = [(path, line, target) for path in DOCS for line, target in links(path)
         if not re.match(r"[a-z]+:", target)]  # http(s), mailto: not checked here


@pytest.mark.parametrize("path,line,target", LINKS, ids=[f"{rel(p)}:{n}:{t}" for p, n, t in LINKS])
def test_every_relative_link_and_anchor_resolves(path, line, target):
    file_part, _, anchor = target.partition("#")
    goal = (path.parent / file_part).resolve() if file_part else path
    assert goal.exists(), f"{rel(path)} line {line}: the link {target} names {file_part}, which does not exist"
    if anchor:
        assert goal.suffix == ".md", f"{rel(path)} line {line}: {target} has an anchor into a file that is not markdown"
        known = anchors(goal)
        assert anchor in known, (f"{rel(path)} line {line}: {target}: {rel(goal)} has no heading with the anchor "
                                 f"#{anchor} (it has: {', '.join(sorted(known))})")


def test_links_are_found_at_all():
    """The parser must see the README's links; an empty list would pass everything above."""
    assert sum(1 for path, _, _ in LINKS if path.name == "README.md") >= 10


def test_every_doc_is_linked_from_the_readme():
    linked = {target.partition("#")[0] for _, target in links(ROOT / "README.md")}
    unlinked = [rel(p) for p in DOCS if p.parent == ROOT / "docs" and rel(p) not in linked]
    assert not unlinked, f"README.md links to none of: {', '.join(unlinked)}"


def bucket_problem(name: str) -> str | None:
    """S3's bucket naming rules (general purpose buckets), or None when NAME follows them."""
    if not 3 <= len(name) <= 63:
        return "must be 3 to 63 characters long"
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*[a-z0-9]", name):
        return "may hold only lowercase letters, digits, dots and hyphens, and must begin and end with a letter or digit"
    if ".." in name:
        return "must not hold two adjacent dots"
    if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", name):
        return "must not look like an IP address"
    if name.startswith(("xn--", "sthree-", "amzn-s3-demo-")) or name.endswith(("-s3alias", "--ol-s3", ".mrap", "--x-s3")):
        return "uses a prefix or suffix S3 reserves"
    return None


@pytest.mark.parametrize("name,problem", [
    ("my-bucket", None), ("b", "3 to 63"), ("My-Bucket", "lowercase"), ("my_bucket", "lowercase"),
    ("-bucket", "begin and end"), ("a..b", "adjacent dots"), ("192.168.1.1", "IP address"),
    ("xn--bucket", "reserves"), ("a" * 64, "3 to 63"),
])
def test_bucket_rules(name, problem):
    found = bucket_problem(name)
    assert (found is None) if problem is None else (problem in found)


BUCKETS = sorted({(rel(path), name) for path in DOCS
                  for name in re.findall(r"s3://([^/\s`'\")|;,]+)", prose_with_code(path) + path.read_text())
                  if name.strip(".")})  # "s3://.../" is an elided URI in a quoted error line


@pytest.mark.parametrize("doc,name", BUCKETS, ids=[f"{d}:{n}" for d, n in BUCKETS])
def test_every_example_bucket_name_is_valid(doc, name):
    problem = bucket_problem(name)
    assert problem is None, f"{doc} names the bucket {name!r}, which S3 would refuse: a bucket name {problem}"


def test_the_readme_names_a_bucket():
    assert any(doc == "README.md" for doc, _ in BUCKETS)
