"""`headstart export --force` replaces only an earlier export that holds nothing but what the
exporter wrote; --out is never inside the head being exported; the hints fit the flags given."""

import pytest
from test_export import _head
from test_export import targets as targets  # noqa: F401 - the module fixture, shared

from headstart.cli import main
from headstart.heads import save_head


@pytest.fixture
def exported(tmp_path, targets):  # noqa: F811
    llama = targets["llama"]
    save_head(_head(llama, "mtp", None), tmp_path / "head")
    base = ["export", str(tmp_path / "head"), "--model", str(llama.source_dir)]
    return tmp_path, base


@pytest.mark.parametrize("fmt", ["deepseek-mtp", "native"])
def test_force_never_deletes_a_users_file_inside_an_earlier_export(exported, capsys, fmt):
    tmp_path, base = exported
    out = tmp_path / "exp"
    assert main(base + ["--format", fmt, "--out", str(out)]) == 0
    (out / "NOTES.md").write_text("mine")
    assert main(base + ["--format", fmt, "--out", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert "also holds NOTES.md, which the exporter did not write" in err and "Traceback" not in err
    assert (out / "NOTES.md").read_text() == "mine"
    (out / "NOTES.md").unlink()
    assert main(base + ["--format", fmt, "--out", str(out), "--force"]) == 0


def test_out_inside_the_source_head_is_refused(exported, capsys):
    tmp_path, base = exported
    assert main(base + ["--format", "deepseek-mtp", "--out", str(tmp_path / "head" / "exp")]) == 2
    assert "is inside the head being exported" in capsys.readouterr().err
    assert not (tmp_path / "head" / "exp").exists()


def test_the_hint_fits_the_flags_given(exported, capsys):
    tmp_path, base = exported
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.txt").write_text("x")
    assert main(base + ["--format", "deepseek-mtp", "--out", str(mine), "--force"]) == 2
    err = capsys.readouterr().err
    assert "pass --force" not in err and "not an earlier export" in err
    assert main(base + ["--format", "deepseek-mtp", "--out", str(tmp_path / "exp")]) == 0
    assert main(base + ["--format", "deepseek-mtp", "--out", str(tmp_path / "exp")]) == 2
    assert "it is an earlier export: pass --force" in capsys.readouterr().err
