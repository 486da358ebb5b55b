"""One meaning per flag across the verbs (issue 52): the artifact is the positional (`--draft` an alias), `-k` is K
and nothing else, `--prompts` names prompt sets or files and `--n-prompts` counts them, `--dtype` takes one list of
choices; and a verb refuses in one line when neither it nor its artifact names a target (no demo fallback)."""

import argparse
import json
from importlib import import_module

import pytest

from draftsmith.sampling.runtime import DTYPE_CHOICES

VERBS = {"generate": "draftsmith.sampling.generate", "export": "draftsmith.deploy.export",
         "deploy-check": "draftsmith.deploy.conformance", "bench paper": "draftsmith.deploy.bench.paper",
         "bench sampler": "draftsmith.deploy.bench.sampler", "bench memory": "draftsmith.deploy.bench.memory",
         "bench corpus": "draftsmith.deploy.bench.corpus", "bench store": "draftsmith.deploy.bench.store",
         "bench train-memory": "draftsmith.deploy.bench.train_memory", "recipes": "draftsmith.deploy.recipes"}
ARTIFACT_VERBS = ("generate", "bench paper", "bench sampler", "bench memory")


class Parsed(Exception):
    pass


def parser_of(module, monkeypatch) -> argparse.ArgumentParser:
    """The parser a verb's main() builds, caught at its parse_args."""
    seen = {}

    def catch(self, *a, **kw):
        seen["parser"] = self
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(Parsed):
        import_module(module).main([], prog="x")
    monkeypatch.undo()
    return seen["parser"]


@pytest.mark.parametrize("verb", VERBS)
def test_each_flag_means_one_thing(verb, monkeypatch):
    options = {o: a for a in parser_of(VERBS[verb], monkeypatch)._actions for o in a.option_strings}
    if "-k" in options or "--k" in options:  # K, the draft tokens a loop proposes
        k = options.get("-k") or options["--k"]
        assert "top" not in (k.help or "").lower() and "kept" not in (k.help or "").lower(), verb
    assert "--k" not in options or options["--k"] is options.get("-k"), verb
    if "--prompts" in options:  # names sets or files, never a count
        assert options["--prompts"].type in (None, str), verb
    if "--n-prompts" in options:
        assert options["--n-prompts"].type is int, verb
    if "--dtype" in options:
        assert list(options["--dtype"].choices) == DTYPE_CHOICES, verb
    if verb in ARTIFACT_VERBS:
        positional = [a for a in parser_of(VERBS[verb], monkeypatch)._actions if not a.option_strings]
        assert [a.dest for a in positional] == ["artifact"] and options["--draft"].dest == "draft_alias", verb


def test_the_artifact_is_the_positional_and_draft_its_alias(smoke_run, capsys):
    from draftsmith.sampling.generate import main

    out, _ = smoke_run
    args = ["--prompt", "def f(x):", "--max-new-tokens", "4", "--json"]
    assert main([str(out), *args]) == 0
    by_position = json.loads(capsys.readouterr().out)
    assert main(["--draft", str(out), *args]) == 0
    by_alias = json.loads(capsys.readouterr().out)
    # the same run, its target and settings, the same seed: the same tokens (timings aside)
    assert {k: v for k, v in by_alias.items() if k != "stats"} == {k: v for k, v in by_position.items() if k != "stats"}
    assert by_alias["stats"]["alpha"] == by_position["stats"]["alpha"]
    assert main([str(out), "--draft", str(out), *args]) == 2
    assert "give the artifact once" in capsys.readouterr().err


def test_no_verb_falls_back_to_the_demo_target(smoke_run, capsys):
    """A draft checkpoint names no target: each verb that takes one refuses in one line instead of running the demo
    target (the run directory, which does name its target, runs)."""
    out, _ = smoke_run
    draft = str(out / "best_draft")
    calls = {"generate": ("draftsmith.sampling.generate", [draft, "--prompt", "x"]),
             "generate without a draft": ("draftsmith.sampling.generate", ["--prompt", "x"]),
             "bench paper": ("draftsmith.deploy.bench.paper", [draft]),
             "bench sampler": ("draftsmith.deploy.bench.sampler", [draft]),
             "bench sampler without a draft": ("draftsmith.deploy.bench.sampler", []),
             "bench memory": ("draftsmith.deploy.bench.memory", [draft]),
             "bench corpus": ("draftsmith.deploy.bench.corpus", [])}
    for what, (module, argv) in calls.items():
        assert import_module(module).main(argv, prog="x") == 2, what
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: no target") and "--target" in err and "\n" not in err, (what, err)


def test_every_verbs_help_examples_parse(monkeypatch):
    """Each example a verb's --help shows (its docstring's) is a command line its parser accepts, and `train` and
    `plan`'s compose: a renamed flag cannot linger in an example."""
    import shlex

    from draftsmith.deploy.cli import VERBS as TOP
    from draftsmith.sampling.cli import examples
    from draftsmith.train import schema
    from draftsmith.train.draft import RECIPES

    checked = 0
    for verb, module in VERBS.items():
        parser = parser_of(module, monkeypatch)
        lines = [ln.strip() for ln in examples(import_module(module).__doc__).splitlines()[1:]]
        lines += [TOP[verb][2]] if verb in TOP else []
        for line in lines:
            words = shlex.split(line.split("  #")[0], comments=True)
            assert words[: len(verb.split()) + 1] == ["draftsmith", *verb.split()], (verb, line)
            parser.parse_args(words[len(verb.split()) + 1:])  # exits 2 on an unknown flag or a bad value
            checked += 1
    for verb in ("train", "plan"):
        overrides = shlex.split(TOP[verb][2])[2:]
        schema.preflight(overrides, RECIPES)
        checked += 1
    assert checked >= 25
