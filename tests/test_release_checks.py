"""The checks that `./nox -s release` makes before it tags a package."""

from packaging.version import Version

from tools.release_checks import changelog_has_entry, last_tagged_version, read_version, release_problems

CHANGELOG = "# Changelog\n\n## 0.2.0\n\n- faster\n\n## [0.1.0] - 2026-11-01\n\n- first\n"


def test_last_tagged_version_ignores_other_packages_and_bad_tags():
    tags = ["minddp-v0.1.0", "minddp-v0.10.0", "minddp-v0.9.1", "shardopt-v3.0.0", "minddp-vnext", "v1.0"]
    assert last_tagged_version(tags, "minddp") == Version("0.10.0")
    assert last_tagged_version(tags, "profkit") is None


def test_changelog_entry_must_match_the_whole_version():
    assert changelog_has_entry(CHANGELOG, Version("0.2.0"))
    assert changelog_has_entry(CHANGELOG, Version("0.1.0"))
    assert not changelog_has_entry(CHANGELOG, Version("0.2.1"))
    assert not changelog_has_entry(CHANGELOG, Version("0.2"))


def test_release_refused_without_changelog_entry_or_newer_version():
    assert release_problems(Version("0.2.0"), Version("0.1.0"), CHANGELOG, "minddp") == []
    missing = release_problems(Version("0.3.0"), Version("0.2.0"), CHANGELOG, "minddp")
    assert len(missing) == 1 and "CHANGELOG" in missing[0]
    stale = release_problems(Version("0.2.0"), Version("0.2.0"), CHANGELOG, "minddp")
    assert len(stale) == 1 and "not newer" in stale[0]


def test_read_version(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text('"""doc"""\n\n__version__ = "1.2.3"\n')
    assert read_version(init) == Version("1.2.3")
