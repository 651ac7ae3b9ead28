"""Pure checks behind ``nox -s release``: kept free of nox so the tests can import them."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.version import InvalidVersion, Version

VERSION_LINE = re.compile(r'^__version__\s*=\s*["\']([^"\']+)["\']', re.MULTILINE)


def read_version(init_file: Path) -> Version:
    """The single-sourced ``__version__`` of a package's ``__init__.py``."""
    match = VERSION_LINE.search(init_file.read_text())
    if match is None:
        raise ValueError(f"{init_file}: no __version__ = '...' line")
    return Version(match.group(1))


def last_tagged_version(tags: list[str], dist_name: str) -> Version | None:
    """Highest version among tags named ``<dist_name>-vX.Y.Z``; None if there is none."""
    prefix = f"{dist_name}-v"
    versions = []
    for tag in tags:
        if tag.startswith(prefix):
            try:
                versions.append(Version(tag[len(prefix):]))
            except InvalidVersion:
                continue
    return max(versions, default=None)


def changelog_has_entry(changelog: str, version: Version) -> bool:
    """True if the CHANGELOG has a ``## X.Y.Z`` (or ``## [X.Y.Z]``) heading for ``version``."""
    heading = re.compile(rf"^##\s+\[?v?{re.escape(str(version))}\]?(\s|$)", re.MULTILINE)
    return heading.search(changelog) is not None


def release_problems(version: Version, last: Version | None, changelog: str, dist_name: str) -> list[str]:
    """Every reason a release of ``dist_name`` at ``version`` must be refused (empty: go ahead)."""
    problems = []
    if last is not None and version <= last:
        problems.append(
            f"{dist_name} {version} is not newer than its last tag {dist_name}-v{last}: bump __version__"
        )
    if not changelog_has_entry(changelog, version):
        problems.append(f"{dist_name}'s CHANGELOG.md has no '## {version}' entry: describe the release there")
    return problems
