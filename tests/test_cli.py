"""`draftsmith generate`: text and stats out, one-line errors and exit code 2 for bad input."""

import json
import os
import subprocess
import sys

import pytest
from conftest import copy_with_swapped_tokens


def cli(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "draftsmith.deploy.cli", "generate", "--target", "tiny-random", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_generate_prints_text_and_stats(smoke_run):
    out, _ = smoke_run
    res = cli("--draft", str(out / "best_draft"), "--prompt", "def f(x):", "--max-new-tokens", "12", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    d = json.loads(res.stdout)
    s = d["stats"]
    assert s["new_tokens"] <= 12 and 1 <= s["tokens_per_call"] <= 5 and 0 <= s["alpha"] <= 1
    assert len(s["acceptance_by_position"]) == 4 and d["completion"] is not None
    plain = cli("--draft", str(out / "best_draft"), "--prompt", "def f(x):", "--max-new-tokens", "12")
    assert "alpha" in plain.stdout and "tokens_per_call" in plain.stdout and plain.stdout.startswith("def f(x):")


def test_pruned_draft_vocab_from_the_cli(smoke_run, tmp_path):
    """--draft-vocab prunes a full-head draft; a draft trained with a pruned head (the smoke recipe's) runs with
    it and refuses another."""
    import shutil

    from draftsmith.sampling.pruned import HEAD_TOKENS

    out, _ = smoke_run
    full = tmp_path / "full_head"
    shutil.copytree(out / "best_draft", full)
    (full / HEAD_TOKENS).unlink()
    res = cli("--draft", str(full), "--prompt", "import os", "--max-new-tokens", "8", "--draft-vocab", "64", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["stats"]["new_tokens"] == 8
    bad = cli("--draft", str(out / "best_draft"), "--prompt", "import os", "--draft-vocab", "64")
    assert bad.returncode == 2 and "trained with a head of" in bad.stderr and "drop --draft-vocab" in bad.stderr


@pytest.mark.parametrize("args,msg", [
    (["-k", "0"], "-k"), (["--temperature", "-1"], "temperature"), (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-3"], "top_k"), (["--prompt", ""], "empty"), (["--max-new-tokens", "100000"], "context"),
    (["--draft", "/no/such/draft"], "model not found"),
])
def test_bad_input_gives_one_line_and_exit_2(smoke_run, args, msg):
    out, _ = smoke_run
    base = {"--draft": str(out / "best_draft"), "--prompt": "x"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    res = cli(*[a for kv in base.items() for a in kv])
    assert res.returncode == 2 and msg in res.stderr
    assert len([ln for ln in res.stderr.splitlines() if ln.startswith("error:")]) == 1


def test_draft_with_another_tokenizer_is_refused(smoke_run, tmp_path):
    out, _ = smoke_run
    other = copy_with_swapped_tokens(out / "best_draft", tmp_path / "draft")
    res = cli("--draft", str(other), "--prompt", "x")
    assert res.returncode == 2 and "tokenizers differ" in res.stderr


@pytest.mark.slow
def test_compiled_generation_from_the_cli_matches_eager_greedy(smoke_run):
    out, _ = smoke_run
    args = ("--draft", str(out / "best_draft"), "--prompt", "def f(x):", "--max-new-tokens", "16", "--temperature",
            "0", "--json")
    eager, compiled = cli(*args), cli(*args, "--compile")
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    eager, compiled = json.loads(eager.stdout), json.loads(compiled.stdout)
    assert compiled["completion"] == eager["completion"]
    assert compiled["stats"]["new_tokens"] == 16
    # --compile reached the sampler: both models' steps were compiled (the eager run built none)
    assert len({r["model"] for r in compiled["compiled"]}) == 2 and eager["compiled"] == []


def test_one_command_lists_its_verbs_and_each_shows_an_example(capsys):
    """`draftsmith --help`: every verb with one line; `draftsmith VERB --help`: its options and an example."""
    from draftsmith.deploy.bench import BENCHES
    from draftsmith.deploy.cli import VERBS, main

    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    for verb in VERBS:
        assert f"\n    {verb}" in top, verb
    for verb in VERBS:
        try:
            rc = main([verb, "--help"])
        except SystemExit as e:  # argparse's --help
            rc = e.code
        out = capsys.readouterr().out
        assert rc == 0 and f"draftsmith {verb}" in out and "example" in out, (verb, out[-400:])
    for name in BENCHES:
        try:
            rc = main(["bench", name, "--help"])
        except SystemExit as e:
            rc = e.code
        out = capsys.readouterr().out
        assert rc == 0 and f"draftsmith bench {name}" in out and "examples:" in out, (name, out[-400:])
    assert main(["bench", "nope"]) == 2
    with pytest.raises(SystemExit):
        main(["nope"])
