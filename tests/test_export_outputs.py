"""`headstart export --force` replaces only an earlier export that holds nothing but what the
exporter wrote; --out is never inside the head being exported; the hints fit the flags given."""

import shutil

import pytest
from test_export import _head
from test_export import targets as targets  # noqa: F401 - the module fixture, shared

from headstart.cli import main
from headstart.heads import save_head


@pytest.fixture
def exported(tmp_path, targets):  # noqa: F811
    llama = targets["llama"]
    save_head(_head(llama, "eagle1", None), tmp_path / "head")
    base = ["export", str(tmp_path / "head"), "--model", str(llama.source_dir)]
    return tmp_path, base


@pytest.mark.parametrize("fmt", ["sglang", "native"])
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
    assert main(base + ["--format", "sglang", "--out", str(tmp_path / "head" / "exp")]) == 2
    assert "is inside the head being exported" in capsys.readouterr().err
    assert not (tmp_path / "head" / "exp").exists()


def test_the_hint_fits_the_flags_given(exported, capsys):
    tmp_path, base = exported
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.txt").write_text("x")
    assert main(base + ["--format", "sglang", "--out", str(mine), "--force"]) == 2
    err = capsys.readouterr().err
    assert "pass --force" not in err and "not an earlier export" in err
    assert main(base + ["--format", "sglang", "--out", str(tmp_path / "exp")]) == 0
    assert main(base + ["--format", "sglang", "--out", str(tmp_path / "exp")]) == 2
    assert "it is an earlier export: pass --force" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["mtp", "deepseek_mtp"])
def test_deepseek_mtp_is_refused_for_a_llama_target(tmp_path, targets, capsys, kind):  # noqa: F811
    """No DeepSeek MTP loader reads a Llama-family block: refused with the reason, nothing written;
    import onto such a target is refused too."""
    llama = targets["llama"]
    save_head(_head(llama, kind, None), tmp_path / "head")
    assert main(["export", str(tmp_path / "head"), "--model", str(llama.source_dir), "--format", "deepseek-mtp",
                 "--out", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err
    assert "DeepSeek (MLA + MoE) layer" in err and "'llama'" in err and "--format native" in err
    assert not (tmp_path / "ds").exists()
    src = tmp_path / "fake-ds"  # what a DeepSeek-MTP checkpoint's config says, with this head's tensors
    src.mkdir()
    (src / "config.json").write_text('{"num_nextn_predict_layers": 1}')
    shutil.copy(tmp_path / "head" / "model.safetensors", src / "model.safetensors")
    assert main(["import", str(src), "--format", "deepseek-mtp", "--target", str(llama.source_dir), "--out",
                 str(tmp_path / "back")]) == 2
    assert "not importable onto this target" in capsys.readouterr().err
    assert not (tmp_path / "back").exists()
