"""Precision chosen per machine (sampling/precision.py): the choice logic against stubbed probe timings, the cache
and its key, explicit choices with their warning, CUDA's rule, and the real probe's shape. No test assumes which
way this machine goes."""

import warnings

import pytest
import torch
from conftest import tiny_llama

from draftsmith.sampling import precision

SLOW = {"train": {"fp32": 10.0, "bf16": 650.0}, "teacher": {"fp32": 5.0, "bf16": 320.0},
        "screen": {"fp32": 1.0, "bf16": 65.0}}  # an AVX2-only CPU: bf16 GEMM is the reference fallback
FAST = {"train": {"fp32": 14.0, "bf16": 8.0}, "teacher": {"fp32": 6.0, "bf16": 3.5},
        "screen": {"fp32": 1.0, "bf16": 0.6}}  # native bf16 (AVX-512 BF16 / AMX)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path))
    return tmp_path


def stub_probe(monkeypatch, ms, gemm="native"):
    calls = []

    def probe():
        calls.append(1)
        return {"ms": ms, "bf16_gemm": gemm, "probe_s": 0.01}

    monkeypatch.setattr(precision, "probe", probe)
    return calls


def test_slow_bf16_chooses_fp32_and_says_why(home, monkeypatch, capsys):
    stub_probe(monkeypatch, SLOW, "reference fallback")
    assert precision.resolve("auto", "train") == "fp32"
    assert precision.resolve("auto", "teacher") == "fp32"
    assert precision.trainer_precision("auto", "cpu") == "32-true"
    line = capsys.readouterr().err
    assert "training in fp32" in line and "65x slower" in line and "no native bf16 GEMM" in line


def test_fast_bf16_chooses_bf16(home, monkeypatch):
    stub_probe(monkeypatch, FAST)
    assert precision.resolve("auto", "train") == "bf16"
    assert precision.trainer_precision("auto", "cpu") == "bf16-mixed"


def test_roles_may_differ(home, monkeypatch):
    stub_probe(monkeypatch, {**SLOW, "teacher": {"fp32": 5.0, "bf16": 4.0}})
    assert (precision.resolve("auto", "train"), precision.resolve("auto", "teacher")) == ("fp32", "bf16")


def test_verdict_is_cached_and_reused(home, monkeypatch):
    calls = stub_probe(monkeypatch, SLOW)
    for _ in range(3):
        precision.resolve("auto", "train")
    assert len(calls) == 1
    assert len(list((home / "precision").glob("*.json"))) == 1


def test_cache_is_invalidated_when_its_key_changes(home, monkeypatch):
    calls = stub_probe(monkeypatch, SLOW)
    precision.resolve("auto", "train")
    real = precision.machine
    # each a real change on any machine: native_bf16 flips whatever this CPU has
    for change in ({"threads": 64}, {"torch": "9.9.9"}, {"cpu": "Another CPU"},
                   {"native_bf16": not real()["native_bf16"]}):
        monkeypatch.setattr(precision, "machine", lambda c=change: {**real(), **c})
        precision.resolve("auto", "train")
    assert len(calls) == 5
    assert len(list((home / "precision").glob("*.json"))) == 5


def test_damaged_cache_is_measured_again(home, monkeypatch):
    calls = stub_probe(monkeypatch, SLOW)
    precision.resolve("auto", "train")
    (path,) = (home / "precision").glob("*.json")
    path.write_text("{not json")
    assert precision.resolve("auto", "train") == "fp32"
    assert len(calls) == 2


def test_explicit_choice_is_kept_with_a_warning_when_slow(home, monkeypatch):
    stub_probe(monkeypatch, SLOW)
    precision.verdict()
    with pytest.warns(UserWarning, match="bf16 is 65.0x slower than fp32 for train"):
        assert precision.trainer_precision("bf16-mixed", "cpu") == "bf16-mixed"
    with pytest.warns(UserWarning, match="for teacher"):
        assert precision.resolve("bf16", "teacher") == "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert precision.resolve("fp32", "teacher") == "fp32"
        assert precision.trainer_precision("32-true", "cpu") == "32-true"


def test_explicit_choice_is_silent_when_fast(home, monkeypatch):
    stub_probe(monkeypatch, FAST)
    precision.verdict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert precision.trainer_precision("bf16-mixed", "cpu") == "bf16-mixed"
        assert precision.resolve("bf16", "teacher") == "bf16"


def test_cuda_rule_needs_no_probe(home, monkeypatch):
    calls = stub_probe(monkeypatch, SLOW)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert precision.resolve("auto", "teacher", device="cuda") == "bf16"
    assert precision.trainer_precision("auto", "gpu") == "bf16-mixed"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert precision.resolve("auto", "teacher", device="cuda:0") == "fp16"
    assert precision.trainer_precision("auto", "gpu") == "16-mixed"
    assert calls == []


def test_bad_requests_are_refused(home):
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        precision.resolve("int8", "train")
    with pytest.raises(ValueError, match="role"):
        precision.resolve("auto", "decode")


def test_decode_dtype_times_the_model_and_caches_per_model(home, monkeypatch):
    stub_probe(monkeypatch, SLOW)
    timed = []

    def fake_decode_ms(model, k, **kw):
        timed.append((model.dtype, k))
        return {torch.float32: 146.0, torch.bfloat16: 300.0}[model.dtype]

    monkeypatch.setattr(precision, "_decode_ms", fake_decode_ms)
    model = tiny_llama(vocab=16)
    assert precision.decode_dtype(model, k=4) == "fp32"
    assert precision.decode_dtype(model, k=4) == "fp32"  # cached
    assert timed == [(torch.float32, 4), (torch.bfloat16, 4)]
    assert model.dtype == torch.float32  # timed on a copy, the model is untouched
    other = tiny_llama(vocab=16, hidden=64)  # another config is another model
    monkeypatch.setattr(precision, "_decode_ms", lambda m, k, **kw: {torch.float32: 57.0,
                                                                      torch.bfloat16: 47.0}[m.dtype])
    assert precision.decode_dtype(other, k=4) == "bf16"
    with pytest.warns(UserWarning, match="for decode"):
        precision.check_choice("bf16", "decode", model)
    with pytest.raises(ValueError, match="fp32 model"):
        precision.decode_dtype(tiny_llama(vocab=16, hidden=48).to(torch.bfloat16))


def test_real_probe_measures_both_dtypes_quickly(home):
    v = precision.verdict(refresh=True, quiet=True)
    for role in ("train", "teacher"):
        assert v["ms"][role]["fp32"] > 0 and v["ms"][role]["bf16"] > 0
        assert v["dtype"][role] in ("fp32", "bf16")
    assert v["probe_s"] < 5  # well under a second on 2 cores; generous for a loaded CI machine
    assert v["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_real_decode_probe_on_a_tiny_model(home):
    model = tiny_llama(vocab=64, hidden=64)
    assert precision.decode_dtype(model, k=2, quiet=True) in ("fp32", "bf16")
    v = precision.verdict(quiet=True)
    (entry,) = v["models"].values()
    assert entry["k"] == 2 and entry["ms"]["fp32"] > 0 and entry["ms"]["bf16"] > 0


def test_load_model_auto_roles(home, monkeypatch):
    from draftsmith.sampling.load import load_model
    from draftsmith.sampling.runtime import prepared_model

    stub_probe(monkeypatch, SLOW)
    monkeypatch.setattr(precision, "_decode_ms", lambda m, k, **kw: {torch.float32: 10.0,
                                                                      torch.bfloat16: 5.0}[m.dtype])
    path = str(home / "model")
    tiny_llama(vocab=16).save_pretrained(path)
    teacher = prepared_model(path, "auto", role="teacher")
    assert teacher.dtype == torch.float32 and teacher.draftsmith_choices["dtype_by"] == "probed"
    auto = prepared_model(path, "auto", role="decode")
    assert auto.dtype == torch.bfloat16 and auto.draftsmith_choices == {"dtype": "bf16", "dtype_by": "timed",
                                                                         "kernels": {}}
    # the same model a user loads with dtype=bf16, buffers included (a cast would also cast RoPE's inv_freq)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8] * 8])
    with torch.no_grad():
        assert torch.equal(auto(input_ids=ids).logits, load_model(path, "bf16")(input_ids=ids).logits)
    assert load_model(path, "fp32").dtype == torch.float32
    with pytest.raises(ValueError, match="dtype must be one of auto"):
        prepared_model(path, "half")
    with pytest.raises(ValueError, match="dtype must be one of bf16, fp32, fp16, got 'auto'"):
        load_model(path, "auto")  # choosing is runtime's step, not the loader's


def test_loading_with_an_explicit_dtype_times_nothing_and_installs_nothing(home, monkeypatch):
    """load_model only loads: no precision probe or model timing, no kernel table, not even a cached one; the
    command's own step (runtime.prepared_model) installs the kernels, and says so on the model."""
    from draftsmith.sampling import kernels
    from draftsmith.sampling.load import load_model
    from draftsmith.sampling.runtime import prepared_model

    calls = []
    for mod, name in [(precision, "probe"), (precision, "decode_dtype"), (precision, "verdict"),
                      (precision, "check_choice"), (kernels, "calibrate")]:
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    installs, real_install = [], kernels.install
    monkeypatch.setattr(kernels, "install", lambda m, **k: installs.append(m) or real_install(m, force={1: "padded"}))
    monkeypatch.setattr(kernels, "MIN_BYTES", 0)
    path = str(home / "model")
    tiny_llama(vocab=16).save_pretrained(path)
    for dtype in ("fp32", "bf16"):
        model = load_model(path, dtype)
        assert not any(hasattr(m, "kernels") for m in model.modules()) and not hasattr(model, "draftsmith_choices")
    assert calls == [] and installs == []
    # and the step that installs them does, where a test of this one would see it
    model = prepared_model(path, "fp32")
    assert installs == [model] and model.draftsmith_choices == {"dtype": "fp32", "dtype_by": "asked",
                                                               "kernels": {1: "padded"}}
    assert any(getattr(m, "kernels", None) == {1: "padded"} for m in model.modules())
    # what the steps chose reaches the run record and the card's line
    info = precision.run_info(target=model, draft=load_model(path, "fp32"))
    assert info["chosen"] == {"target": {"dtype_by": "asked", "kernels": {"1": "padded"}}}
    assert precision.describe_run(info).endswith("target fp32 (asked; kernels 1:padded), draft fp32")
