"""`draftsmith bench acceptance`: drafts scored on one set of the target's own samples, as the library scores one."""

import json

from draftsmith.deploy.bench.acceptance import main
from draftsmith.drafts.evaluate import alpha_on_samples, target_samples
from draftsmith.sampling.load import load_model, load_tokenizer
from draftsmith.sampling.names import resolve
from draftsmith.sampling.probs import SamplingConfig
from draftsmith.sampling.prompts import encode_prompts, load_prompts, pad_id


def test_every_draft_meets_the_same_target_samples(smoke_run, tmp_path, capsys):
    run, _ = smoke_run
    out = tmp_path / "acceptance.json"
    rc = main([str(run), str(resolve("tiny-random")), "--target", "tiny-random", "--prompts", "code",
               "--n-prompts", "3", "--max-new-tokens", "8", "--dtype", "fp32", "--seed", "5", "--json", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    table = record["alpha_on_target"]
    assert record["prompts"] == {"code": 3}
    assert set(table) == {run.name, "tiny-random"}
    assert abs(table["tiny-random"]["code"] - 1.0) < 1e-6  # the target as its own draft is always accepted
    tok, target = load_tokenizer("tiny-random"), load_model("tiny-random", "fp32")
    ids, mask = encode_prompts(tok, [r["prompt"] for r in load_prompts("code", 3)])
    samples = target_samples(target, ids, mask, max_new_tokens=8, temperature=0.8, top_p=0.95,
                             eos_token_id=tok.eos_token_id, pad_token_id=pad_id(tok), seed=5)
    draft = load_model(str(run / "best_draft"), "fp32")
    expected = alpha_on_samples(target, draft, samples, SamplingConfig(0.8, 0, 0.95), k=4)
    assert abs(table[run.name]["code"] - expected) < 1e-6 and expected < 1.0
    assert f"{run.name}" in capsys.readouterr().out


def test_no_artifact_is_one_line_and_exit_2(capsys):
    assert main(["--prompts", "code"]) == 2
    assert capsys.readouterr().err.startswith("error: no artifact")
