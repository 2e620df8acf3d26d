"""Precompute: shards + manifest written with the serving forward, verify/inspect, fp8, resume after
SIGKILL with identical bytes, refusal of mismatched runs, damaged shards, 2-process (gloo) runs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import random_conversations, write_jsonl

from headstart.cli import main
from headstart.errors import DataError
from headstart.precompute import iter_shards, read_manifest, run_precompute, summary, verify
from headstart.precompute.run import plan_batches, plan_shards
from headstart.recipe_io import load_recipe

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def model_dir(chat_model_dir):
    return chat_model_dir


def _conversations(n, seed=0):
    return random_conversations(n, seed)


def _recipe(tmp_path, model_dir, name="r", n=40, **pc):
    data = write_jsonl(tmp_path / f"{name}.jsonl", _conversations(n))
    pc_lines = "".join(f"  {k}: {v}\n" for k, v in {"shard_tokens": 600, "batch_tokens": 256, **pc}.items())
    text = (f"output_dir: {tmp_path / name}\ntarget:\n  model: {model_dir}\n  dtype: fp32\n"
            f"data:\n  source: {data}\n  max_length: 128\n  heldout_fraction: 0.1\nprecompute:\n{pc_lines}")
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    return p


def test_plans_are_deterministic():
    assert plan_shards([5, 5, 5, 5, 5], 10) == [(0, 2), (2, 4), (4, 5)]
    assert plan_shards([20, 1], 10) == [(0, 1), (1, 2)]
    assert plan_batches([3, 3, 3, 9, 1], 6) == [(0, 2), (2, 3), (3, 4), (4, 5)]


def test_precompute_writes_verified_shards_with_serving_hidden_states(tmp_path, model_dir):
    recipe = load_recipe(_recipe(tmp_path, model_dir))
    manifest = run_precompute(recipe, progress=False)
    out = tmp_path / "r" / "precompute"
    assert (out / "manifest.json").exists() and len(manifest["shards"]) > 2
    verify(out)
    info = summary(manifest)
    d = manifest["target"]["hidden_size"]
    # bf16 last hidden: 2·d bytes, + 4 (int32 id) + 1 (mask) per token, + offsets and headers.
    assert 2 * d + 5 <= info["bytes_per_token"] < 2 * d + 5 + 8
    assert manifest["captured"] == {"last_hidden": True, "aux_layers": []}
    # The stored states are the model's own pre-norm last hidden states.
    from headstart.models.llama import load_llama
    from headstart.nn.attention import PackedCausalAttention, packed_metadata

    model = load_llama(model_dir, "fp32")
    shard = next(iter_shards(out))
    with torch.no_grad():
        h, _ = model(shard.input_ids, packed_metadata(shard.seq_lens), [None] * 2, PackedCausalAttention())
    torch.testing.assert_close(shard.hidden.float(), h.bfloat16().float(), rtol=0.02, atol=0.02)
    # Only the training split, in order, is stored; loss masks come through.
    assert manifest["dataset"]["split"] == "train" and shard.loss_mask.sum() > 0


def test_fp8_halves_the_disk_and_reports_its_error(tmp_path, model_dir):
    recipe = load_recipe(_recipe(tmp_path, model_dir, storage="fp8"))
    manifest = run_precompute(recipe, progress=False)
    d = manifest["target"]["hidden_size"]
    assert d + 9 <= manifest["bytes_per_token"] < d + 9 + 8  # e4m3 values + fp32 scale + id + mask
    assert 0 < manifest["fp8_rel_error"] < 0.06
    verify(tmp_path / "r" / "precompute")


def test_eagle3_recipe_captures_aux_layers(tmp_path, model_dir):
    recipe = load_recipe(_recipe(tmp_path, model_dir), ["head.type=eagle3", "head.aux_layer_ids=[0, 1, 2]"])
    manifest = run_precompute(recipe, progress=False)
    assert manifest["captured"]["aux_layers"] == [0, 1, 2]
    shard = next(iter_shards(tmp_path / "r" / "precompute"))
    assert shard.aux_hidden.shape == (shard.input_ids.numel(), 3, manifest["target"]["hidden_size"])


def test_refuses_mismatched_or_foreign_output_dirs(tmp_path, model_dir):
    path = _recipe(tmp_path, model_dir)
    run_precompute(load_recipe(path), progress=False)
    with pytest.raises(DataError, match="already holds shards of this run; pass --resume"):
        run_precompute(load_recipe(path), progress=False)
    with pytest.raises(DataError, match="different config fingerprint"):
        run_precompute(load_recipe(path, ["precompute.storage=fp8"]), resume=True, progress=False)
    with pytest.raises(DataError, match="different dataset, config fingerprint"):
        run_precompute(load_recipe(path, ["data.max_length=100"]), resume=True, progress=False)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "shard-00000.safetensors").write_bytes(b"x")
    with pytest.raises(DataError, match="holds shards of another run"):
        run_precompute(load_recipe(path, [f"precompute.output_dir={foreign}"]), progress=False)


def test_damaged_shards_are_named(tmp_path, model_dir):
    run_precompute(load_recipe(_recipe(tmp_path, model_dir)), progress=False)
    out = tmp_path / "r" / "precompute"
    victim = out / "shard-00001.safetensors"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="shard-00001.safetensors: .* bytes on disk, the manifest says"):
        verify(out)
    with pytest.raises(DataError, match="shard-00001"):
        list(iter_shards(out))  # training refuses it too
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(DataError, match="sha256 differs"):
        verify(out)
    victim.write_bytes(data)
    verify(out)
    (out / "shard-00099.safetensors").write_bytes(b"stray")
    with pytest.raises(DataError, match=r"disagrees with the files .*shard-00099"):
        verify(out)


def test_cli_verify_inspect_json(tmp_path, model_dir, capsys):
    path = _recipe(tmp_path, model_dir)
    assert main(["precompute", str(path), "--json"]) == 0
    capsys.readouterr()
    out = tmp_path / "r" / "precompute"
    assert main(["precompute", "verify", str(out)]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["precompute", "inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"sequences", "tokens", "bytes_per_token", "dtype", "shards"} <= set(info)
    assert main(["precompute", "inspect", str(tmp_path / "nothing")]) == 2


def _cli(args, env_extra=None, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "headstart.cli", *args], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)


def _shard_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("shard-*.safetensors"))}


def test_sigkill_then_resume_gives_identical_bytes(tmp_path, model_dir):
    ref_path = _recipe(tmp_path, model_dir, name="ref", n=120, shard_tokens=300, batch_tokens=64)
    assert _cli(["precompute", str(ref_path)]).wait() == 0
    ref = _shard_bytes(tmp_path / "ref" / "precompute")
    assert len(ref) >= 6
    path = _recipe(tmp_path, model_dir, name="killed", n=120, shard_tokens=300, batch_tokens=64)
    out = tmp_path / "killed" / "precompute"
    proc = _cli(["precompute", str(path)])
    deadline = time.time() + 120
    while len(list(out.glob("shard-*.safetensors"))) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = len(list(out.glob("shard-*.safetensors")))
    assert 0 < written < len(ref), "the run was not interrupted mid-way"
    assert not (out / "manifest.json").exists()
    with pytest.raises(DataError, match="unfinished"):
        read_manifest(out)
    assert _cli(["precompute", str(path)]).wait() != 0  # without --resume: refused
    assert _cli(["precompute", str(path), "--resume"]).wait() == 0
    assert _shard_bytes(out) == ref
    a, b = read_manifest(out), read_manifest(tmp_path / "ref" / "precompute")
    assert a["shards"] == b["shards"]
    for key in ("target", "template", "config"):  # the dataset files differ only by name here
        assert a["fingerprints"][key] == b["fingerprints"][key]


def test_two_gloo_processes_equal_one(tmp_path, model_dir):
    one = _recipe(tmp_path, model_dir, name="one", n=60)
    assert _cli(["precompute", str(one)]).wait() == 0
    two = _recipe(tmp_path, model_dir, name="two", n=60)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "headstart.cli", "precompute", str(two)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert _shard_bytes(tmp_path / "two" / "precompute") == _shard_bytes(tmp_path / "one" / "precompute")
    assert read_manifest(tmp_path / "two" / "precompute")["shards"] == \
        read_manifest(tmp_path / "one" / "precompute")["shards"]


def test_touching_or_rewriting_the_data_with_the_same_bytes_keeps_resume_working(tmp_path, model_dir):
    path = _recipe(tmp_path, model_dir, name="t", n=30)
    assert main(["precompute", str(path)]) == 0
    data = tmp_path / "t.jsonl"
    os.utime(data, (time.time() + 100, time.time() + 100))  # `touch`
    assert main(["precompute", str(path), "--resume"]) == 0
    data.write_bytes(data.read_bytes())  # rewritten, same content (as a re-salvaged cache is)
    assert main(["precompute", str(path), "--resume"]) == 0
    with open(data, "a") as f:  # a real change is still refused
        f.write(json.dumps({"id": "new", "conversations": [{"from": "human", "value": "x y"},
                                                          {"from": "gpt", "value": "z w"}]}) + "\n")
    assert main(["precompute", str(path), "--resume"]) == 2


def test_damaged_records_and_faults_are_one_line(tmp_path, model_dir, capsys, monkeypatch):
    from headstart.fileio import exclusive_lock

    path = _recipe(tmp_path, model_dir, name="f", n=20)
    out = tmp_path / "f" / "precompute"
    with exclusive_lock(out / ".lock-rank0", what="test"):  # another writer holds the directory
        assert main(["precompute", str(path)]) == 2
        assert "already running (pid" in capsys.readouterr().err
    assert main(["precompute", str(path)]) == 0
    for name in ("manifest.json", "run.json"):
        good = (out / name).read_text()
        for bad, match in (("[1, 2]", "should be a JSON object"), ("{oops", "not valid JSON")):
            (out / name).write_text(bad)
            args = ["precompute", "verify", str(out)] if name == "manifest.json" else \
                ["precompute", str(path), "--resume"]
            assert main(args) == 2
            err = capsys.readouterr().err.strip().splitlines()[-1]
            assert match in err and name in err, err
        (out / name).write_text(good)
    umask = os.umask(0o022)
    os.umask(umask)
    mode = 0o666 & ~umask  # shards get the user's umask like the JSON beside them, not safetensors' 0600
    assert all((p.stat().st_mode & 0o777) == mode for p in out.glob("shard-*.safetensors"))
    assert main(["precompute", str(path), "--set", f"precompute.output_dir={tmp_path / 'f.yaml'}"]) == 2
    assert "is a file" in capsys.readouterr().err
    assert main(["precompute", str(path), "--set", "precompute.output_dir=/proc/headstart-test"]) == 2
    assert "cannot" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_shard_that_cannot_be_written_is_named_and_nothing_is_kept(tmp_path):
    """A real write failure (the file-size limit, as a full disk would be): the error names the shard
    and the OS's reason, and no temporary is left."""
    import subprocess
    import sys

    code = ("import resource, signal, sys, torch; from pathlib import Path; "
            "from headstart.errors import DataError; from headstart.precompute import shards; "
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "def limit():\n    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
            f"path = Path({str(tmp_path)!r}) / 'shard-00000.safetensors'\n"
            "w = shards.ShardWriter(path, 0, torch.ones(64), torch.ones(64), [64], 256, 0, 'bf16')\n"
            "limit()  # the layout is written: the rows at their offsets are not\n"
            "try:\n    w.add(torch.ones(64, 256), None)\n    w.close()\nexcept DataError as e:\n    print(e)\n"
            "try:\n    shards.write_shard(path, 0, torch.ones(64), torch.ones(64), [64], torch.ones(64, 256), "
            "None, 'bf16')\nexcept DataError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    said = out.stdout.splitlines()
    assert len(said) == 2 and all(line.endswith("shard-00000.safetensors: could not write the shard (File too "
                                                 "large); nothing was kept") for line in said), out.stdout
    assert list(tmp_path.iterdir()) == []


def test_many_short_rows_fit_the_page_pool_and_leak_nothing(tmp_path, model_dir):
    from headstart.models.llama import load_llama
    from headstart.precompute.run import EngineForward

    model = load_llama(model_dir, "fp32")
    fwd = EngineForward(model, torch.device("cpu"), max_tokens=200)
    seqs = [[5, 6]] * 100  # 100 pages of 16 for 200 tokens: more than the pool holds
    h, _ = fwd(seqs, [])
    one, _ = fwd([[5, 6]], [])
    assert h.shape[0] == 200
    torch.testing.assert_close(h[-2:], one, rtol=1e-4, atol=1e-4)
    assert fwd.allocator.num_free == fwd.allocator.num_pages
    from headstart.inference.kv_cache import OutOfPages

    with pytest.raises(OutOfPages):
        fwd._forward([[5] * 16] * (fwd.allocator.num_pages + 1), [])  # a reservation fails half-way
    assert fwd.allocator.num_free == fwd.allocator.num_pages  # ... and returns what it took


def test_stale_shard_temporaries_are_removed_on_resume(tmp_path, model_dir):
    path = _recipe(tmp_path, model_dir, name="s", n=20)
    assert main(["precompute", str(path)]) == 0
    out = tmp_path / "s" / "precompute"
    dead = out / ".shard-00000.safetensors.tmp-999999999"
    live = out / f".shard-00001.safetensors.tmp-{os.getpid()}"
    dead.write_bytes(b"half")
    live.write_bytes(b"writing")
    assert main(["precompute", str(path), "--resume"]) == 0
    assert not dead.exists() and live.exists()


def test_a_shard_truncated_during_training_is_named_not_a_bus_error(tmp_path, model_dir):
    from headstart.train.data import ShardSequences

    run_precompute(load_recipe(_recipe(tmp_path, model_dir)), progress=False)
    out = tmp_path / "r" / "precompute"
    seqs = ShardSequences(out)
    last = [i for i, r in enumerate(seqs.refs) if r.shard == 1][-1]
    seqs.load([last])  # the shard is open (memory-mapped) now
    victim = out / "shard-00001.safetensors"
    with open(victim, "r+b") as f:  # truncated in place, as a full disk or a user would
        f.truncate(victim.stat().st_size // 2)
    with pytest.raises(DataError, match=r"shard-00001.safetensors: shard 1 has .* bytes, the manifest says"):
        seqs.load([last])


def test_a_shard_written_batch_by_batch_holds_what_one_write_holds(tmp_path):
    """ShardWriter lays the file out first and puts each batch's rows in place: the same tensors as the
    whole shard written at once (a plain safetensors file), the fp8 error over the whole shard, and a
    batch that does not fit or a shard left short is refused with nothing kept."""
    from safetensors.torch import load_file

    from headstart.precompute import shards

    torch.manual_seed(0)
    n, d, a = 4500, 16, 3  # the last batch spans three of the writer's 2,048-row quantisation chunks
    ids, mask, lens = torch.arange(n), (torch.arange(n) % 3 == 0).to(torch.uint8), [20, 7, 4473]
    h, aux = torch.randn(n, d) * torch.rand(n, 1) * 9, torch.randn(n, a, d) * torch.rand(n, a, 1) * 5
    for storage in ("fp8", "bf16"):
        whole = shards.write_shard(tmp_path / f"whole-{storage}.safetensors", 0, ids, mask, lens, h, aux, storage)
        with shards.ShardWriter(tmp_path / f"parts-{storage}.safetensors", 0, ids, mask, lens, d, a, storage) as w:
            for lo, hi in ((0, 13), (13, 14), (14, n)):
                w.add(h[lo:hi], aux[lo:hi])
            parts = w.close()
        one, many = load_file(tmp_path / whole.name), load_file(tmp_path / parts.name)
        assert one.keys() == many.keys() and all(torch.equal(one[k].view(torch.uint8) if one[k].dtype ==
                                                            torch.float8_e4m3fn else one[k], many[k].view(torch.uint8)
                                                            if many[k].dtype == torch.float8_e4m3fn else many[k])
                                                for k in one)
        back = shards.load_shard(tmp_path / parts.name)
        assert back.seq_lens == lens and torch.equal(back.input_ids, ids) and torch.equal(back.loss_mask, mask)
        torch.testing.assert_close(back.hidden.float(), h, rtol=0.07, atol=0.07)
        if storage == "fp8":  # every row of both tensors: each state's own quantisation
            assert torch.equal(back.hidden, shards.from_fp8(*shards.to_fp8(h)))
            assert torch.equal(back.aux_hidden, shards.from_fp8(*shards.to_fp8(aux)))
            q, s = shards.to_fp8(h)
            direct = float((shards.from_fp8(q, s) - h).norm() / h.norm())
            assert parts.fp8_rel_error == pytest.approx(direct, rel=1e-6) and whole.fp8_rel_error == pytest.approx(
                direct, rel=1e-6)
        else:
            assert parts.fp8_rel_error is None and torch.equal(back.hidden, h.bfloat16())
            assert torch.equal(back.aux_hidden, aux.bfloat16())
    w = shards.ShardWriter(tmp_path / "short.safetensors", 7, ids, mask, lens, d, a, "fp8")
    with pytest.raises(ValueError, match="shard 7: a batch of \\(5, 8\\) hidden states .* does not fit"):
        w.add(torch.ones(5, 8), torch.ones(5, a, 8))
    w = shards.ShardWriter(tmp_path / "short.safetensors", 7, ids, mask, lens, d, a, "fp8")
    w.add(h[:10], aux[:10])
    with pytest.raises(ValueError, match="shard 7: 10 of 4500 rows written"):
        w.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{k}-{s}.safetensors" for k in ("whole", "parts") for s in ("fp8", "bf16"))


def test_precompute_writes_each_batch_before_the_next_forward(tmp_path, model_dir, monkeypatch):
    """A rank holds one batch of states on the host, not a shard's (51.8 GB for one 4M-token shard of
    a 1B target on an H200): every batch reaches its shard's file before the next forward runs."""
    from headstart.precompute import run as run_mod
    from headstart.precompute.shards import ShardWriter

    events = []
    forward, add = run_mod.EngineForward.__call__, ShardWriter.add

    def spy_forward(self, seqs, aux):
        events.append(("forward", sum(len(s) for s in seqs)))
        return forward(self, seqs, aux)

    def spy_add(self, hidden, aux):
        events.append(("add", hidden.shape[0]))
        return add(self, hidden, aux)

    monkeypatch.setattr(run_mod.EngineForward, "__call__", spy_forward)
    monkeypatch.setattr(ShardWriter, "add", spy_add)
    manifest = run_precompute(load_recipe(_recipe(tmp_path, model_dir, storage="fp8")), progress=False)
    assert len(events) > 2 * len(manifest["shards"])  # several batches per shard
    assert events[0::2] == [("forward", m) for _, m in events[1::2]] and all(e[0] == "add" for e in events[1::2])
    verify(tmp_path / "r" / "precompute")
