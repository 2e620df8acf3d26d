"""`headstart eval` refuses before anything loads what it could not run or must not write: a report
directory that is not one of ours (or a file, or a link), lengths past the target's context, --k and
--temperature out of range, prompt files with unknown roles; and the report records what the engine
really ran (kernels, batch invariance) and tells heads with the same directory name apart."""

import json
import os

import pytest
from test_eval import _report
from test_eval import setup as setup  # noqa: F401 - the module fixture, shared
from test_train import _recipe

from headstart.cli import main
from headstart.errors import DataError
from headstart.eval_report import head_labels, is_report_dir, write_reports
from headstart.evaluate import EvalPlan, evaluate, read_prompt_file
from headstart.heads import HeadConfig, build_head, save_head


@pytest.fixture
def no_model(monkeypatch):
    import headstart.models.llama as llama

    def load(*args, **kwargs):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(llama, "load_llama", load)


@pytest.fixture
def eval_args(tmp_path, chat_model_dir):
    head = tmp_path / "head"
    (head).mkdir()
    (head / "config.json").write_text("{}")  # enough for the up-front checks; nothing loads it
    return ["eval", str(_recipe(tmp_path, chat_model_dir)), "--head", str(head), "--no-progress"]


def _fails(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and err.count("headstart: error:") == 1, err
    return err


def test_out_must_be_new_or_an_earlier_report(tmp_path, eval_args, capsys, no_model):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("my notes")
    _fails(capsys, eval_args + ["--out", str(mine)], f"{mine}: exists and is not empty")
    assert [p.name for p in mine.iterdir()] == ["report.md"] and (mine / "report.md").read_text() == "my notes"
    root = os.getcwd()  # the project root: never a report directory
    _fails(capsys, eval_args + ["--out", root], "exists and is not empty")
    (tmp_path / "afile").write_text("x")
    _fails(capsys, eval_args + ["--out", str(tmp_path / "afile")], "is a file")
    (tmp_path / "link").symlink_to(mine)
    _fails(capsys, eval_args + ["--out", str(tmp_path / "link")], "is a symbolic link")


def test_an_earlier_report_directory_is_rewritten(setup, tmp_path):  # noqa: F811
    report = _report(setup, temps=(0.0,))
    assert report["format"] == "headstart-eval/1"
    write_reports(report, tmp_path / "rep")
    assert is_report_dir(tmp_path / "rep")
    write_reports(report, tmp_path / "rep")  # a second eval into the same place
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "report.json").write_text(json.dumps({"mine": 1}))
    with pytest.raises(Exception, match="not an earlier eval report"):
        write_reports(report, tmp_path / "other")


@pytest.mark.parametrize(("args", "match"), [
    (["--max-tokens", "300000"], "--max-tokens 300,000 is not below the target's context"),
    (["--k", "10000"], "--k must list integers in 1..32"),
    (["--temperature", "nan"], "--temperature must list finite values"),
    (["--temperature", "inf"], "--temperature must list finite values"),
    (["--tree-tokens", "0"], "--tree-tokens must be in 1..256"),  # the flags reach the plan
    (["--tree-topk", "99"], "--tree-topk in 1..32"),
    (["--heldout-turn", "0"], "--heldout-turn 0: must be >= 1"),
    (["--prompts", "p.jsonl", "--heldout-turn", "2"], "--heldout-turn 2: picks held-out turns; not with --prompts"),
    (["--prompts", "p.jsonl", "--heldout-turn", "1"], "--heldout-turn 1: picks held-out turns; not with --prompts"),
    (["--heldout", "0"], "--heldout 0: must be >= 1"),
    (["--heldout-turn", "2", "--set", "data.max_turns=1"], "--heldout-turn 2: the recipe keeps data.max_turns 1"),
])
def test_arguments_are_checked_before_the_model_loads(eval_args, capsys, no_model, args, match):
    _fails(capsys, eval_args + args, match)


def test_a_prompt_past_the_context_is_refused_before_any_kv_page(setup):  # noqa: F811
    d, target, heads, prompts = setup
    ctx = target.config.max_position_embeddings
    with pytest.raises(DataError, match=f"prompt 1 has {ctx + 5:,} tokens; the target's context is {ctx:,}"):
        evaluate(target, None, [prompts[0], [3] * (ctx + 5)], [None, None], EvalPlan(heads=heads[:1], ks=[1]),
                 progress=False)


def test_prompt_roles_are_checked(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"messages": [{"role": "human", "content": "hi"}]}\n')
    with pytest.raises(DataError, match=r"p.jsonl:2: role 'human' is not one of system, user, assistant"):
        read_prompt_file(f)


def test_the_report_records_the_kernels_the_engine_used(setup, monkeypatch):  # noqa: F811
    import headstart.kernels as kernels
    from headstart.models.llama import load_llama

    monkeypatch.setattr(kernels, "_tried", True)  # as if the build failed / HEADSTART_KERNELS=0
    monkeypatch.setattr(kernels, "_module", None)
    d, target, heads, prompts = setup
    fresh = load_llama(d / "target", "fp32")  # the shared target has the kernels switched on already
    report = evaluate(fresh, None, prompts[:2], [None, None], EvalPlan(heads=heads[:1], ks=[1], max_tokens=4),
                      progress=False)
    assert report["engine"]["kernels"] != "rowwise" and report["engine"]["batch_invariant"] is False


def test_heads_with_the_same_directory_name_get_distinct_labels(setup, tmp_path):  # noqa: F811
    d, target, heads, prompts = setup
    paths = []
    for run in ("a", "b"):
        save_head(build_head(HeadConfig(head_type="mtp"), target), tmp_path / run / "head-best")
        paths.append(str(tmp_path / run / "head-best"))
    assert head_labels(paths) == {paths[0]: "a/head-best", paths[1]: "b/head-best"}
    plan = EvalPlan(heads=paths, ks=[1], max_tokens=4, batch_size=2, baseline=False)
    report = evaluate(target, None, prompts[:2], [None, None], plan, progress=False)
    assert {r["label"] for r in report["runs"]} == {"a/head-best", "b/head-best"}
    write_reports(report, tmp_path / "rep")
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| a/head-best |" in md and "| b/head-best |" in md


def test_eval_accepts_allow_other_target():
    from headstart.cli import build_parser

    args = build_parser().parse_args(["eval", "r.yaml", "--head", "h", "--allow-other-target"])
    assert args.allow_other_target


def test_eval_with_a_prompts_file_writes_its_report_where_asked(tmp_path, chat_model_dir, capsys):
    """End to end through the CLI with --prompts: the report lands in --out (the prompt loop once
    overwrote the report path), stdout holds the verb's lines only, the baseline rows are there."""
    from conftest import write_jsonl

    from headstart.heads import HeadConfig, build_head, save_head
    from headstart.models.llama import load_llama

    target = load_llama(chat_model_dir, "fp32")
    save_head(build_head(HeadConfig(head_type="mtp"), target), tmp_path / "head")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello there"}, {"prompt": "the fast draft"}])
    out = tmp_path / "report"
    argv = ["eval", str(_recipe(tmp_path, chat_model_dir)), "--head", str(tmp_path / "head"), "--prompts",
            str(prompts), "--k", "2", "--max-tokens", "4", "--batch-size", "2", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert {r["method"] for r in report["runs"]} == {"chain", "ngram"}
    assert all(line.startswith("eval: ") for line in stdout.splitlines())


def test_draft_threshold_is_refused_where_it_does_nothing(capsys):
    _fails(capsys, ["generate", "--prompt", "hi", "--spec", "tree", "--head", "h", "--draft-threshold", "0.5"],
           "--draft-threshold applies to --spec chain or draft")


def test_heldout_turn_t_is_the_t_th_user_turn_after_the_earlier_replies(tmp_path, chat_model_dir, capsys):
    """--heldout-turn 2 asks with the second user turn, its context the first turn and its reply as the chat
    template renders them; conversations without a second reply are left out, and none at all is an error."""
    from conftest import write_jsonl

    from headstart.config import DataConfig
    from headstart.data.dataset import build_dataset, load_tokenizer
    from headstart.train.validate import heldout_prompts

    one = [{"from": "human", "value": "hello heads"}, {"from": "gpt", "value": "draft tokens fast"}]
    two = one + [{"from": "human", "value": "more please"}, {"from": "gpt", "value": "the a b"}]
    src = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "conversations": one}, {"id": "b", "conversations": two}])
    built = build_dataset(DataConfig(source=str(src), max_length=96, heldout_fraction=0.0), str(chat_model_dir),
                          progress=False)
    ids, masks = [list(x) for x in built.train["input_ids"]], [list(x) for x in built.train["loss_mask"]]
    tok = load_tokenizer(chat_model_dir)
    msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in two[:3]]
    enc = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    assert heldout_prompts(ids, masks, 5, turn=2) == [list(enc["input_ids"] if hasattr(enc, "keys") else enc)]
    assert len(heldout_prompts(ids, masks, 5, turn=1)) == 2 and heldout_prompts(ids, masks, 5, turn=3) == []
    with pytest.raises(ValueError, match="turn must be >= 1"):
        heldout_prompts(ids, masks, 5, turn=0)
    from headstart.models.llama import load_llama

    save_head(build_head(HeadConfig(head_type="mtp"), load_llama(chat_model_dir, "fp32")), tmp_path / "head")
    recipe = _recipe(tmp_path, chat_model_dir)  # 48 random chats of one or two rounds, 15 % held out
    base = ["eval", str(recipe), "--head", str(tmp_path / "head"), "--k", "1", "--max-tokens", "2", "--no-progress",
            "--no-baseline"]
    _fails(capsys, base + ["--heldout-turn", "9"], "--heldout-turn 9: none of the")
    _fails(capsys, base + ["--set", "data.heldout_fraction=0"], "holds no held-out conversation")
    from headstart.data.dataset import build_dataset
    from headstart.recipe_io import load_recipe

    held = build_dataset(load_recipe(recipe).data, str(chat_model_dir), progress=False).heldout
    want = heldout_prompts([list(x) for x in held["input_ids"]], [list(x) for x in held["loss_mask"]], 99, turn=2)
    assert 0 < len(want) < len(held)  # some held-out chats have a second reply, not all
    assert main(base + ["--heldout", "99", "--heldout-turn", "2", "--out", str(tmp_path / "ev")]) == 0
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert f"{len(want)} user turns before reply 2" in report["settings"]["prompt_source"]
    assert report["prompts"] == len(want)


def test_first_turns_counts_assistant_replies_only():
    from headstart.data.dataset import first_turns

    s, u, a = ({"role": r, "content": r[0]} for r in ("system", "user", "assistant"))
    conv = [s, u, a, u, a, u, a]
    assert first_turns(conv, 1) == [s, u, a] and first_turns(conv, 2) == conv[:5]
    assert first_turns(conv, 3) == conv and first_turns(conv, 9) == conv
    assert first_turns([u, u, a, u, a], 1) == [u, u, a]


def test_heldout_prompts_on_hand_made_masks():
    from headstart.train.validate import heldout_prompts

    ids, mask = list(range(12)), [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert heldout_prompts([ids], [mask], 5, 1) == [ids[:3]]
    assert heldout_prompts([ids], [mask], 5, 2) == [ids[:8]]  # a reply of several tokens is one reply
    assert heldout_prompts([ids], [mask], 5, 3) == []
    assert heldout_prompts([ids[:10]], [mask[:10]], 5, 2) == [ids[:8]]  # cut inside reply 2: still asked
    assert heldout_prompts([ids[:7]], [mask[:7]], 5, 2) == []  # cut before reply 2: left out
    assert heldout_prompts([ids] * 3, [mask] * 3, 2, 1) == [ids[:3]] * 2  # n caps
    assert heldout_prompts([ids, ids], [[1] * 12, mask], 5, 1) == [ids[:3]]  # no empty prompt
