"""The fortunes corpus (userdp/shards/fortunes.py): quotations partitioned by author, built from
fortune data files, and ``userdp shard --fortunes`` writing either split as shards."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from userdp.clients.shard_store import ShardStore

from userdp.cli import main
from userdp.shards.fortunes import FORTUNES_DIR, FortunesError, fortunes_corpus

WISDOM = """\
(1) Avoid fried meats which angry up the blood.
(2) Avoid running at all times.
\t\t-- S. Paige, c. 1951
%
A clash of doctrine is not a disaster -- it is an opportunity.
%
Never put off till tomorrow what you can do the day after tomorrow.
\t\t-- Mark Twain
%

%
Only two things are infinite.
\t\t-- Albert Einstein (attributed)
%
"""
PEOPLE = """\
Get your facts first, and then you can distort them as much as you please.
\t\t-- Mark Twain, "Following the Equator"
%
-- a quotation that is only a dash line
%
"""


@pytest.fixture
def fortunes_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "fortunes"
    directory.mkdir()
    (directory / "wisdom").write_text(WISDOM)
    (directory / "people").write_text(PEOPLE)
    (directory / "people.dat").write_bytes(b"\x00\x00\x00\x02strfile index")  # ignored
    (directory / "people.u8").symlink_to("people")  # the same text again: ignored
    return directory


def test_private_split_is_the_attributed_quotations_by_author(fortunes_dir: Path) -> None:
    table = fortunes_corpus(fortunes_dir, "private")
    rows = list(zip(table["user_id"].to_pylist(), table["text"].to_pylist(), strict=True))
    assert rows == [  # files by name, quotations in order; the attribution line is not text
        (
            "Mark Twain",
            "Get your facts first, and then you can distort them as much as you please.",
        ),
        (
            "S. Paige",
            "(1) Avoid fried meats which angry up the blood.\n(2) Avoid running at all times.",
        ),
        ("Mark Twain", "Never put off till tomorrow what you can do the day after tomorrow."),
        ("Albert Einstein", "Only two things are infinite."),
    ]


def test_public_split_is_the_rest_one_user_each(fortunes_dir: Path) -> None:
    table = fortunes_corpus(fortunes_dir, "public")
    assert table["text"].to_pylist() == [
        "-- a quotation that is only a dash line",
        "A clash of doctrine is not a disaster -- it is an opportunity.",
    ]
    users = table["user_id"].to_pylist()
    assert len(set(users)) == len(users)
    private = set(fortunes_corpus(fortunes_dir, "private")["text"].to_pylist())
    assert not private & set(table["text"].to_pylist())


def test_missing_data_names_the_package_and_the_flag(tmp_path: Path, capsys) -> None:
    with pytest.raises(FortunesError, match="apt-get install fortunes"):
        fortunes_corpus(tmp_path / "absent")
    out = tmp_path / "shards"
    code = main(["shard", "--fortunes", str(out), "--fortunes-dir", str(tmp_path / "absent")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--fortunes-dir" in err[0]
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["shard", "--fortunes", "x", "--out", "y"], "--fortunes OUT"),
        (["shard", "--fortunes", "x", "--demo", "y"], "pass one of them"),
        (["shard", "--demo", "x", "--fortunes-split", "public"], "go with --fortunes OUT"),
    ],
)
def test_fortunes_argument_errors_exit_2(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_shard_fortunes_writes_each_split(fortunes_dir: Path, tmp_path: Path) -> None:
    for split, users in (("private", 3), ("public", 2)):
        out = tmp_path / split
        argv = ["shard", "--fortunes", str(out), "--fortunes-dir", str(fortunes_dir), "--quiet"]
        assert main([*argv, "--fortunes-split", split]) == 0
        with ShardStore(out) as store:
            report = store.verify()
            assert report.users == users
            assert store.manifest.dataset_name == f"fortunes-{split}"


@pytest.mark.skipif(not FORTUNES_DIR.is_dir(), reason="Debian's fortunes package is not installed")
def test_the_installed_corpus_has_over_a_thousand_uneven_users() -> None:
    counts = Counter(fortunes_corpus()["user_id"].to_pylist())
    assert len(counts) >= 1000
    per_user = sorted(counts.values())
    assert per_user[len(per_user) // 2] == 1 and per_user[-1] >= 50  # a heavy tail
    assert fortunes_corpus(split="public").num_rows >= 1000
